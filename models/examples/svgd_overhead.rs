//! The repulsive hook's cost relative to one training step of a Transformer-small-sized stack
//! (6+6 layers, E = 512, FFN 1024, 4 heads; fairseq's transformer_iwslt_de_en), with nn::Adam.
//! `cargo run --release -p probattn-models --example svgd_overhead -- [TOKENS_PER_SIDE] [REPEATS]`
//! (defaults 1024 tokens per side as 32 sentences, 10 repeats). A step is forward, backward,
//! (hook), Adam step; the two kinds of step take turns so machine drift affects both alike.
//! The paper reports 1.13x training time on GPUs; the target is under 1.05x.

use std::time::Instant;

use probattn::repulsive::{RepulsiveConfig, RepulsiveHook, Selection};
use probattn_models::transformer::{Transformer, TransformerConfig};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> probattn::Result<()> {
    let args: Vec<i64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (tokens, repeats) = (*args.first().unwrap_or(&1024), *args.get(1).unwrap_or(&10) as usize);
    let (batch, len) = (32, tokens / 32);
    tch::manual_seed(0);
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let model = Transformer::new(&vs.root(), TransformerConfig::iwslt())?;
    let mut hook = RepulsiveHook::new(RepulsiveConfig::default(), Selection::default())?;
    model.register_repulsive(&mut hook);
    let mut adam = nn::Adam { beta1: 0.9, beta2: 0.98, eps: 1e-8, wd: 1e-4, amsgrad: false }.build(&vs, 5e-4)?;
    let src = Tensor::randn([batch, len, 512], (Kind::Float, device));
    let tgt = Tensor::randn([batch, len, 512], (Kind::Float, device));
    let (mut plain, mut with_hook, mut hook_only) = (vec![], vec![], vec![]);
    for round in 0..repeats + 2 {
        for use_hook in [false, true] {
            let sync = || if let Device::Cuda(d) = device { tch::Cuda::synchronize(d as i64) };
            sync();
            let start = Instant::now();
            let out = model.forward_t(&src, None, &tgt, None, true)?;
            adam.zero_grad();
            out.output.square().mean(Kind::Float).backward();
            let mut hook_ms = 0.0;
            if use_hook {
                sync();
                let h = Instant::now();
                hook.apply()?;
                sync();
                hook_ms = h.elapsed().as_secs_f64() * 1e3;
            }
            adam.step();
            sync();
            let ms = start.elapsed().as_secs_f64() * 1e3;
            if round >= 2 {
                if use_hook {
                    with_hook.push(ms);
                    hook_only.push(hook_ms);
                } else {
                    plain.push(ms);
                }
            }
        }
    }
    let (p, w, h) = (median(plain), median(with_hook), median(hook_only));
    println!(
        "{device:?}, {} threads, {} particle sets, batch {batch} x {len} tokens per side, median of {repeats}:",
        tch::get_num_threads(),
        hook.sets().len()
    );
    println!("step without hook {p:.1} ms, with hook {w:.1} ms (ratio {:.3}); hook alone {h:.1} ms = {:.1}% of a step", w / p, 100.0 * h / p);
    Ok(())
}
