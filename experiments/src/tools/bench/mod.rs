//! `probattn bench`: forward+backward time of `MultiHeadAttention` with each normalizer over a
//! grid of sequence lengths (B = 8, H = 8, E = 512, float32, training mode), against PyTorch eager
//! with the reference implementations and PyTorch's `scaled_dot_product_attention`, measured in
//! the same invocation; and one optimizer step of a Transformer-small-sized stack with and without
//! the repulsive (SVGD) hook. Writes `bench.json` and `bench.md` (the ratios that matter, and
//! each row's layer throughput in TFLOP/s: `table::layer_flops` says what is counted).
//!
//! Memory: after the timed steps, one more step of each variant, untimed, reports the peak bytes
//! it allocated above what was held before it (activations, the S × S weights autograd keeps,
//! gradients; not the inputs and parameters). Both sides count the same way: on CUDA the caching
//! allocator's statistics, on the CPU the counting allocator of `probattn::memory`, loaded into
//! PyTorch's process too (python/probattn_tools/baselines/bench.py --memory-lib).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use probattn::backend::Backend;
use probattn::repulsive::{RepulsiveConfig, RepulsiveHook, Selection};
use probattn::{memory, MhaConfig, MhaInput, MultiHeadAttention, Variant};
use probattn_models::transformer::{Transformer, TransformerConfig};
use serde::{Deserialize, Serialize};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::common::CommonArgs;
use crate::provenance::{run_dir, run_python, write_results, Provenance};
use probattn::precision::Precision;

mod table;
mod timing;
use table::MIB;
pub use table::{layer_flops, ratio_table, throughput_table};
use timing::{catch_torch_panic, first_line, sync, time_interleaved};

/// The registry's benchmarked variants (softmax, dnas, hnas, sinkhorn-3, bam-lc, bam-wc).
fn variants() -> Vec<&'static str> {
    probattn::normalize::registry::benchmarked()
}
const MEMORY_EFFICIENT: &str = "probattn-memory-efficient";
const FUSED: &str = "probattn-fused";
const HEADS: i64 = 8;
const EMBED: i64 = 512;

/// Flags of `probattn bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A short grid (S = 64 and 256, 3 repeats, a smaller SVGD step) that finishes in under 3
    /// minutes on 2 CPU cores.
    #[arg(long)]
    pub quick: bool,
    /// Sequence lengths (default: 64,128,256,512,1024 on CPU; 64,256,1024,2048,4096 on CUDA). A length at which a step fails (CUDA out of memory) is reported and skipped with the longer ones.
    #[arg(long, value_delimiter = ',')]
    pub seq_lens: Option<Vec<i64>>,
    /// Timed repeats per configuration, after two warm-up runs (default 10; 3 with --quick).
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Skip the PyTorch side (python/probattn_tools/baselines/bench.py).
    #[arg(long)]
    pub no_pytorch: bool,
    #[command(flatten)]
    pub memory: crate::common::MemoryEfficientArgs,
    /// Also measure each variant with the fused backend forced (`probattn-fused` rows, as
    /// `--attention-backend fused`): on CUDA the plan's embedded Triton kernels (softmax: SDPA's),
    /// on the CPU libtorch's fused kernel under the plan. A variant it does not serve is left out,
    /// with the reason, in bench.json's `unserved` and under the table.
    #[arg(long)]
    pub fused: bool,
    /// Skip the eager rows (for lengths the eager path cannot hold; with --memory-efficient): ours,
    /// and PyTorch's eager reference, whose side then measures SDPA and, on CUDA, DNAS composed
    /// from two FlexAttention calls.
    #[arg(long)]
    pub no_eager: bool,
    /// Skip the SVGD hook's timing (an Adam step of the 6+6-layer translation Transformer with and
    /// without the hook, the longest part of a run on the CPU): bench.json's `svgd` is then null
    /// and the table has no SVGD line.
    #[arg(long)]
    pub no_svgd: bool,
    /// Variants to measure, from the registry's benchmarked ones: softmax, dnas, hnas, sinkhorn-3, bam-lc, bam-wc (default: all
    /// six); both sides measure the same ones.
    #[arg(long, visible_alias = "attention", value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(variants()))]
    pub variants: Option<Vec<String>>,
    /// Batch size B of the attention layer.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..))]
    pub batch: i64,
    /// Output folder (default: runs/bench/<UTC stamp>-<device>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub precision: crate::common::PrecisionArgs,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// One timed configuration (bench.json's `measurements`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Measurement {
    pub variant: String,
    #[serde(rename = "impl")]
    pub implementation: String,
    pub device: String,
    pub batch: i64,
    pub heads: i64,
    pub embed: i64,
    pub seq_len: i64,
    pub fwd_bwd_ms: f64,
    pub fwd_bwd_ms_iqr: f64,
    /// Peak bytes one forward+backward step allocated above what was held before it (the module
    /// doc says how each side counts); `null` where not measured.
    pub peak_mem_bytes: Option<u64>,
    /// The forward pass's precision, the same on both sides (`--precision`; absent from records
    /// written before it: float32).
    #[serde(default)]
    pub precision: Precision,
    /// The route that served this configuration's attention calls (`eager`, `kernel`, `tiles`,
    /// `fused-cpu`, `fused-cuda`; `probattn::backend`), several joined by `+`; absent for PyTorch's rows and
    /// from records written before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// The layer's throughput, [`layer_flops`] over `fwd_bwd_ms`, in TFLOP/s (absent from records
    /// written before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tflops: Option<f64>,
}

/// The SVGD hook's cost (bench.json's `svgd`).
#[derive(Clone, Debug, Serialize)]
pub struct SvgdTiming {
    pub step_ms_without: f64,
    pub step_ms_with: f64,
    pub ratio: f64,
    pub hook_ms: f64,
    pub tokens_per_side: i64,
    /// The most memory one step without the hook held above what was allocated at its start
    /// (weights, gradients and Adam's state included there), in bytes.
    pub step_peak_bytes: u64,
}

#[derive(Debug, Serialize)]
struct Bench {
    measurements: Vec<Measurement>,
    skipped: Vec<Skipped>,
    unserved: Vec<Unserved>,
    /// `null` with `--no-svgd`.
    svgd: Option<SvgdTiming>,
    provenance: Provenance,
}

/// A sequence length left out of the grid (bench.json's `skipped`): the first at which a step
/// failed (on CUDA, running out of memory), and every longer one after it.
#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    pub seq_len: i64,
    pub reason: String,
}

/// A row left out because its forced backend does not serve it (bench.json's `unserved`).
#[derive(Clone, Debug, Serialize)]
pub struct Unserved {
    pub variant: String,
    #[serde(rename = "impl")]
    pub implementation: String,
    pub reason: String,
}

/// The rows whose backend serves them, tried once at `s`; the others with the reason.
fn served(device: Device, s: i64, rows: Vec<Row>, precision: Precision) -> (Vec<Row>, Vec<Unserved>) {
    let (mut kept, mut left) = (vec![], vec![]);
    for row in rows {
        // A row that forces nothing runs on the command's backend: tried like the others when
        // `--attention-backend` forces one.
        if row.backend == Backend::Auto && probattn::backend::default() == Backend::Auto {
            kept.push(row);
            continue;
        }
        match catch_torch_panic(|| measure_length(device, s, 1, std::slice::from_ref(&row), precision)) {
            Ok(_) => kept.push(row),
            Err(e) => {
                let reason = first_line(&e);
                eprintln!("{} {}: not served ({reason}); left out", row.implementation, row.variant);
                left.push(Unserved { variant: row.variant.into(), implementation: row.implementation.into(), reason });
            }
        }
    }
    (kept, left)
}

/// probattn's timings over `seq_lens`, stopping at the first length where a step fails (returned
/// as skipped with the lengths after it) instead of aborting the whole benchmark.
fn measure_ours(
    device: Device,
    seq_lens: &[i64],
    repeats: usize,
    rows: &[Row],
    precision: Precision,
) -> Result<(Vec<Measurement>, Vec<Skipped>)> {
    let mut out = vec![];
    for (i, &s) in seq_lens.iter().enumerate() {
        match catch_torch_panic(|| measure_length(device, s, repeats, rows, precision)) {
            Ok(m) => out.extend(m),
            Err(e) => {
                let reason = first_line(&e);
                eprintln!("probattn S={s}: {reason}; S = {:?} skipped", &seq_lens[i..]);
                let skipped = seq_lens[i..].iter().map(|&seq_len| Skipped { seq_len, reason: reason.clone() }).collect();
                return Ok((out, skipped));
            }
        }
    }
    Ok((out, vec![]))
}

/// One configuration of our side: a variant, the implementation's name, its tile (None: eager),
/// the batch size and the backend its forward passes are forced to (`Auto`: none forced).
#[derive(Clone, Debug)]
struct Row {
    variant: &'static str,
    implementation: &'static str,
    tile: Option<i64>,
    batch: i64,
    backend: Backend,
}

/// Sets the process's attention backend until dropped, then restores the one before. `Auto`
/// forces nothing: the command's own choice (`--attention-backend`) stays.
struct BackendScope(Option<Backend>);

impl BackendScope {
    fn enter(backend: Backend) -> Self {
        Self((backend != Backend::Auto).then(|| probattn::backend::set_default(backend)))
    }
}

impl Drop for BackendScope {
    fn drop(&mut self) {
        if let Some(before) = self.0 {
            probattn::backend::set_default(before);
        }
    }
}

/// The rows `args` asks for: every variant eagerly, memory-efficiently with --memory-efficient,
/// and on the fused backend with --fused.
fn rows(args: &BenchArgs) -> Vec<Row> {
    let chosen = |v: &&str| args.variants.as_ref().map_or(true, |list| list.iter().any(|c| c == v));
    let eager = variants().into_iter().filter(chosen).filter(|_| !args.no_eager).map(|variant| Row {
        variant,
        implementation: "probattn",
        tile: None,
        batch: args.batch,
        backend: Backend::Auto,
    });
    let fused = variants().into_iter().filter(chosen).filter(|_| args.fused).map(|variant| Row {
        variant,
        implementation: FUSED,
        tile: None,
        batch: args.batch,
        backend: Backend::Fused,
    });
    let tiled = variants().into_iter().filter(chosen).filter(|_| args.memory.memory_efficient).map(|variant| Row {
        variant,
        implementation: MEMORY_EFFICIENT,
        tile: Some(args.memory.tile),
        batch: args.batch,
        backend: Backend::Auto,
    });
    eager.chain(tiled).chain(fused).collect()
}

/// Every row at one sequence length.
/// The forward pass in `precision` (an autocast region), the backward pass after it, as PyTorch's
/// side does.
fn measure_length(device: Device, s: i64, repeats: usize, rows: &[Row], precision: Precision) -> Result<Vec<Measurement>> {
    let mut out = vec![];
    let batch = rows.first().map_or(1, |r| r.batch);
    let x = Tensor::randn([batch, s, EMBED], (Kind::Float, device)).set_requires_grad(true);
    let mut layers = vec![];
    for row in rows {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(device);
        let mut cfg = MhaConfig::new(EMBED, HEADS).with_variant(row.variant.parse::<Variant>()?);
        cfg.tile = row.tile;
        let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
        layers.push((vs, mha));
    }
    let mut steps: Vec<Box<dyn FnMut() -> Result<()> + '_>> = layers
        .iter()
        .zip(rows)
        .map(|((_, mha), row)| {
            let x = &x;
            Box::new(move || {
                let region = precision.enter(device)?;
                let scope = BackendScope::enter(row.backend);
                let o = mha.forward_t(&MhaInput::self_attention(x), true)?;
                drop(scope);
                region.exit()?;
                let mut loss = o.context.sum(Kind::Float);
                if let Some(kl) = o.kl {
                    loss += kl;
                }
                loss.backward();
                Ok(())
            }) as Box<dyn FnMut() -> Result<()> + '_>
        })
        .collect();
    let timings = time_interleaved(device, repeats, &mut steps)?;
    let (mut peaks, mut routes) = (vec![], vec![]);
    for step in &mut steps {
        probattn::backend::reset_routes_taken();
        let (result, peak) = memory::peak_during(device, step)?;
        result?;
        peaks.push(peak);
        routes.push(probattn::backend::routes_taken().iter().map(|(r, _)| r.name()).collect::<Vec<_>>().join("+"));
    }
    for (((row, (median, iqr)), peak), route) in rows.iter().zip(timings).zip(peaks).zip(routes) {
        eprintln!("{:26} {:12} S={s:5}: {median:9.1} ms, peak {:8.1} MiB", row.implementation, row.variant, peak as f64 / MIB);
        out.push(Measurement {
            variant: row.variant.into(),
            implementation: row.implementation.into(),
            device: probattn::device::device_name(device),
            batch,
            heads: HEADS,
            embed: EMBED,
            seq_len: s,
            fwd_bwd_ms: median,
            fwd_bwd_ms_iqr: iqr,
            peak_mem_bytes: Some(peak.max(0) as u64),
            precision,
            route: Some(route),
            tflops: None,
        });
    }
    Ok(out)
}

/// One Adam step of the 6+6-layer, E = 512, 4-head stack, with and without the hook (the two
/// take turns so machine drift hits both alike).
fn measure_svgd(device: Device, tokens: i64, repeats: usize, precision: Precision) -> Result<SvgdTiming> {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = Transformer::new(&vs.root(), TransformerConfig::iwslt())?;
    let mut hook = RepulsiveHook::new(RepulsiveConfig::default(), Selection::default())?;
    model.register_repulsive(&mut hook);
    let mut adam = nn::Adam { beta1: 0.9, beta2: 0.98, eps: 1e-8, wd: 1e-4, amsgrad: false }.build(&vs, 5e-4)?;
    let (batch, len) = (32, (tokens / 32).max(1));
    let src = Tensor::randn([batch, len, 512], (Kind::Float, device));
    let tgt = Tensor::randn([batch, len, 512], (Kind::Float, device));
    let (mut without, mut with, mut hook_only) = (vec![], vec![], vec![]);
    for round in 0..repeats + 1 {
        for use_hook in [false, true] {
            sync(device);
            let start = Instant::now();
            let out = precision.run(device, || model.forward_t(&src, None, &tgt, None, true))??;
            adam.zero_grad();
            out.output.square().mean(Kind::Float).backward();
            let mut h = 0.0;
            if use_hook {
                sync(device);
                let t = Instant::now();
                hook.apply()?;
                sync(device);
                h = t.elapsed().as_secs_f64() * 1e3;
            }
            adam.step();
            sync(device);
            let ms = start.elapsed().as_secs_f64() * 1e3;
            if round > 0 {
                if use_hook {
                    with.push(ms);
                    hook_only.push(h);
                } else {
                    without.push(ms);
                }
            }
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, b, h) = (median(without), median(with), median(hook_only));
    let (result, peak) = memory::peak_during(device, || -> Result<()> {
        let out = precision.run(device, || model.forward_t(&src, None, &tgt, None, true))??;
        adam.zero_grad();
        out.output.square().mean(Kind::Float).backward();
        adam.step();
        Ok(())
    })?;
    result?;
    let step_peak_bytes = peak.max(0) as u64;
    eprintln!("svgd: step {a:.1} ms without the hook, {b:.1} ms with (hook alone {h:.1} ms); peak {:.1} MiB", step_peak_bytes as f64 / MIB);
    Ok(SvgdTiming { step_ms_without: a, step_ms_with: b, ratio: b / a, hook_ms: h, tokens_per_side: batch * len, step_peak_bytes })
}

/// PyTorch's side (python/probattn_tools/baselines/bench.py) in its own process, on the same
/// lengths, repeats, threads, batch, variants and precision.
fn measure_pytorch(args: &BenchArgs, device: Device, seq_lens: &[i64], repeats: usize) -> Result<Vec<Measurement>> {
    let lens = seq_lens.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let dev = match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".into(),
    };
    let threads = tch::get_num_threads().to_string();
    let lib = memory::python_counter_library();
    let variants = args.variants.as_ref().map_or_else(|| variants().join(","), |v| v.join(","));
    let json = run_python(
        "baselines.bench",
        &[
            "--device",
            &dev,
            "--seq-lens",
            &lens,
            "--repeats",
            &repeats.to_string(),
            "--threads",
            &threads,
            "--memory-lib",
            &lib.to_string_lossy(),
            "--batch",
            &args.batch.to_string(),
            "--variants",
            &variants,
            "--precision",
            args.precision.precision.name(),
        ]
        .into_iter()
        .chain(args.no_eager.then_some("--no-eager"))
        .collect::<Vec<_>>(),
    )
    .context("running the PyTorch side (python/probattn_tools/baselines/bench.py); --no-pytorch skips it")?;
    let theirs: Vec<Measurement> =
        serde_json::from_str(json.trim()).context("reading python/probattn_tools/baselines/bench.py's output")?;
    Ok(theirs)
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let device = args.common.setup()?;
    let _precision = args.precision.begin(device)?;
    let cuda = device != Device::Cpu;
    let seq_lens = match (&args.seq_lens, args.quick, cuda) {
        (Some(s), _, _) => s.clone(),
        (None, true, _) => vec![64, 256],
        (None, false, false) => vec![64, 128, 256, 512, 1024],
        // At 8192 one score tensor (B·H·S² floats) is 17 GB and a step holds several: more than
        // an 80 GB card has (it fails cleanly, and is skipped, when asked for).
        (None, false, true) => vec![64, 256, 1024, 2048, 4096],
    };
    anyhow::ensure!(seq_lens.iter().all(|&s| s > 0), "--seq-lens must be positive");
    let repeats = args.repeats.unwrap_or(if args.quick { 3 } else { 10 }).max(1);
    // Counting starts before the first tensor of the benchmark exists.
    memory::track(device).context("memory statistics")?;
    println!(
        "bench on {} ({} threads, {}): S = {seq_lens:?}, {repeats} repeats",
        probattn::device::device_name(device),
        tch::get_num_threads(),
        args.precision.precision
    );
    // The PyTorch side first, in its own process: run after ours, it would find the GPU's memory
    // still held by this process's caching allocator and run out of it early.
    let mut measurements = vec![];
    if !args.no_pytorch {
        measurements.extend(measure_pytorch(args, device, &seq_lens, repeats)?);
    }
    anyhow::ensure!(
        !args.no_eager || args.memory.memory_efficient || args.fused,
        "--no-eager leaves nothing to measure without --memory-efficient or --fused"
    );
    let (rows, unserved) = served(device, seq_lens[0], rows(args), args.precision.precision);
    anyhow::ensure!(
        !rows.is_empty(),
        "nothing to measure: no configuration asked for is served here ({})",
        unserved.iter().map(|u| format!("{} {}: {}", u.implementation, u.variant, u.reason)).collect::<Vec<_>>().join("; ")
    );
    let (ours, skipped) = measure_ours(device, &seq_lens, repeats, &rows, args.precision.precision)?;
    let why = skipped.first().map_or("no reason recorded", |s| s.reason.as_str());
    anyhow::ensure!(!ours.is_empty(), "no sequence length could be measured: {why}");
    measurements.extend(ours);
    for m in &mut measurements {
        m.tflops = Some(layer_flops(m.batch, m.heads, m.embed, m.seq_len) / (m.fwd_bwd_ms * 1e-3) / 1e12);
    }
    let svgd = if args.no_svgd {
        None
    } else {
        Some(measure_svgd(device, if args.quick { 256 } else { 1024 }, if args.quick { 3 } else { repeats }, args.precision.precision)?)
    };
    let mut table = ratio_table(&measurements, svgd.as_ref()) + &throughput_table(&measurements);
    for u in &unserved {
        table += &format!("\nNot served: {} {} ({}).\n", u.implementation, u.variant, u.reason);
    }
    if table.contains("| – |") {
        table += "\nA – is a configuration that side did not run (python/probattn_tools/baselines/bench.py reports on stderr which ran out of memory).\n";
    }
    if let Some(first) = skipped.first() {
        let lens: Vec<String> = skipped.iter().map(|k| k.seq_len.to_string()).collect();
        table += &format!("\nNot measured: S = {} ({}).\n", lens.join(", "), first.reason);
    }
    // The folder is made once there is something to write: a run that fails leaves none behind.
    let dir = run_dir(args.out.as_deref(), "bench", &probattn::device::device_name(device).replace(':', ""))?;
    write_results(&dir.join("bench.json"), &Bench { measurements, skipped, unserved, svgd, provenance: Provenance::gather(device) })?;
    match args.precision.precision {
        Precision::F32 => {}
        Precision::Tf32 => {
            table += "\nPrecision: tf32 (float32, CUDA's matrix products in TF32 for the whole run on both sides; docs/precision.md).\n"
        }
        Precision::Bf16 => table += "\nPrecision: bf16 (forward passes in an autocast region on both sides; docs/precision.md).\n",
    }
    probattn::io::write_bytes_atomic(&dir.join("bench.md"), table.as_bytes())?;
    println!("\n{table}\nresults in {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torch_panic_becomes_an_error_with_libtorchs_first_line() {
        // Adding tensors of shapes [2] and [3] panics inside tch, as running out of memory does.
        let err = catch_torch_panic(|| Ok(Tensor::ones([2], (Kind::Float, Device::Cpu)) + Tensor::ones([3], (Kind::Float, Device::Cpu))))
            .expect_err("mismatched shapes must fail");
        let line = first_line(&err);
        assert!(line.starts_with("The size of tensor a (2) must match the size of tensor b (3)"), "{line}");
        assert!(!line.contains("\\n") && !line.contains("Torch(") && !line.contains("frame #"), "{line}");
        // A success passes through.
        assert_eq!(catch_torch_panic(|| Ok(3)).unwrap(), 3);
    }
}
