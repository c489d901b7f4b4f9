//! Forward+backward time of one MultiHeadAttention layer with each normalizer, relative to
//! softmax, in training mode (BAM samples and returns its KL, which enters the loss).
//! `cargo run --release --example variant_timing -- [SEQ_LEN] [REPEATS] [system]` (defaults 256,
//! 10). Freed memory is retained for reuse as the `probattn` binary does by default
//! ([`probattn::allocator`]); `system` keeps glibc's default instead.
//! Median of the repeats after two warm-up rounds; the variants take turns within each round so
//! that drift in the machine's speed affects all alike. B = 8, H = 8, E = 512, float32, CPU.
//! The full benchmark against PyTorch is `probattn bench`.

use std::time::Instant;

use probattn::{MhaConfig, MhaInput, MultiHeadAttention, Variant};
use tch::{nn, Device, Kind, Tensor};

fn main() -> probattn::Result<()> {
    let system = std::env::args().any(|a| a == "system");
    let retained = !system && probattn::allocator::retain_freed_memory();
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (seq, repeats) = (*args.first().unwrap_or(&256) as i64, *args.get(1).unwrap_or(&10));
    let device = Device::Cpu;
    let allocator = if retained { "retain" } else { "system" };
    println!("B=8 H=8 E=512 S={seq}, {} threads, allocator {allocator}, median of {repeats}", tch::get_num_threads());
    let names = probattn::normalize::registry::examples();
    let stores: Vec<nn::VarStore> = names.iter().map(|_| nn::VarStore::new(device)).collect();
    let layers = names
        .iter()
        .zip(&stores)
        .map(|(name, vs)| MultiHeadAttention::new(&vs.root(), MhaConfig::new(512, 8).with_variant(name.parse::<Variant>()?)))
        .collect::<probattn::Result<Vec<_>>>()?;
    let x = Tensor::randn([8, seq, 512], (Kind::Float, device)).set_requires_grad(true);
    let mut times = vec![vec![]; names.len()];
    for round in 0..repeats + 2 {
        for (layer, t) in layers.iter().zip(&mut times) {
            let start = Instant::now();
            let out = layer.forward_t(&MhaInput::self_attention(&x), true)?;
            let mut loss = out.context.sum(Kind::Float);
            if let Some(kl) = out.kl {
                loss += kl;
            }
            loss.backward();
            if round >= 2 {
                t.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let medians: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect();
    for (name, median) in names.iter().zip(&medians) {
        println!("{name:12} {median:9.1} ms   {:.2}x softmax", median / medians[0]);
    }
    Ok(())
}
