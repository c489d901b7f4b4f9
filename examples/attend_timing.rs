//! Time of one `probattn::attend` call from Rust, forward alone and forward + backward, on
//! heads-first inputs, in a process of its own. (The Python package's overhead benchmark,
//! python/probattn/benchmarks/bench.py, times the same call inside the Python process instead,
//! through `probattn._native.rust_timing`: across two processes the machine's drift outweighs
//! the difference measured.)
//!
//! `cargo run --release --example attend_timing -- VARIANT S [--memory-efficient] [--repeats N]
//! [--batch B] [--heads H] [--dim D] [--seed S] [--device cpu|cuda]`: prints one JSON line with the
//! medians in ms (on CUDA each call is timed to its completion: synchronized before and after).
//! Inputs are `randn (B, H, S, D)` float32 from `--seed` (default B 1, H 8, D 64, 20 repeats after
//! two warm-up calls, one thread unless `RAYON`/`OMP` settings say otherwise: the caller sets
//! threads with `--threads T`).

use std::time::Instant;

use probattn::{attend, AttendOptions, Masks, NormalizerConfig, Variant};
use tch::{nn, Device, Kind, Tensor};

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str, default: i64| -> Result<i64, Box<dyn std::error::Error>> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(args.get(i + 1).ok_or(format!("{name} needs a value"))?.parse()?),
            None => Ok(default),
        }
    };
    let usage =
        "usage: attend_timing VARIANT S [--memory-efficient] [--repeats N] [--batch B] [--heads H] [--dim D] [--seed S] [--threads T] [--device cpu|cuda]";
    let variant: Variant = args.first().ok_or(usage)?.parse()?;
    let s: i64 = args.get(1).ok_or(usage)?.parse()?;
    let memory_efficient = args.iter().any(|a| a == "--memory-efficient");
    let (repeats, b, h, d, seed) =
        (flag("--repeats", 20)?, flag("--batch", 1)?, flag("--heads", 8)?, flag("--dim", 64)?, flag("--seed", 0)?);
    tch::set_num_threads(flag("--threads", 1)? as i32);
    tch::manual_seed(seed);
    let device = match args.iter().position(|a| a == "--device").map(|i| args.get(i + 1).map(String::as_str)) {
        None | Some(Some("cpu")) => Device::Cpu,
        Some(Some("cuda")) if tch::Cuda::is_available() => Device::Cuda(0),
        Some(Some("cuda")) => return Err("--device cuda: CUDA is not available".into()),
        Some(other) => return Err(format!("--device takes cpu or cuda, not {}", other.unwrap_or("nothing")).into()),
    };
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    let opts = (Kind::Float, device);
    let (q, k, v) = (Tensor::randn([b, h, s, d], opts), Tensor::randn([b, h, s, d], opts), Tensor::randn([b, h, s, d], opts));
    let vs = nn::VarStore::new(device);
    let normalizer = variant.build(&vs.root(), h, d, &NormalizerConfig::default())?;
    let call = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let options = AttendOptions { need_weights: false, tile: memory_efficient.then_some(256), ..Default::default() };
        attend(q, k, v, &Masks::default(), normalizer.as_ref(), options)
    };
    let (mut forward, mut backward) = (vec![], vec![]);
    for round in 0..repeats + 2 {
        sync();
        let start = Instant::now();
        tch::no_grad(|| call(&q, &k, &v))?;
        sync();
        let f = start.elapsed().as_secs_f64() * 1e3;
        let (mut qg, mut kg, mut vg) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
        sync();
        let start = Instant::now();
        let out = call(&qg, &kg, &vg)?.output;
        out.sum(Kind::Float).backward();
        sync();
        let fb = start.elapsed().as_secs_f64() * 1e3;
        for t in [&mut qg, &mut kg, &mut vg] {
            t.zero_grad();
        }
        if round >= 2 {
            forward.push(f);
            backward.push(fb);
        }
    }
    println!(
        "{{\"variant\": \"{variant}\", \"s\": {s}, \"memory_efficient\": {memory_efficient}, \"forward_ms\": {:.4}, \"forward_backward_ms\": {:.4}, \"repeats\": {repeats}, \"threads\": {}}}",
        median(forward),
        median(backward),
        tch::get_num_threads()
    );
    Ok(())
}
