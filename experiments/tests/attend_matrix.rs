//! `probattn attend` over its input matrix, as users call it: every variant × every dtype
//! (float32, float64, bfloat16 inputs, and float32 under `--precision bf16`) × every mask layout
//! (none, key padding, query and key padding, an attention mask, causal) × every path a user can
//! ask for (eager; memory-efficient, whose route the library picks; `--attention-backend tiles`
//! and `fused`, forced) × odd sizes (S = 1, S not a multiple of the tile, S_q ≠ S_k).
//!
//! Each run must write the library's eager result (output, received mass, KL), computed here from
//! the same file with the library's own call, on the route the library chooses, or, where the
//! library refuses the call, fail with the library's reason and write nothing; never panic.
//!
//! Every run is made through the command's own code, parsed from its arguments, in this process
//! (a libtorch start-up per `probattn` process would take most of the test's time), and one run in
//! seven again through the binary, where it must also exit 0 or exit 1 with a named error, never
//! with a panic (status 101, or the binary's "internal error" line) or a signal. The runs come in
//! blocks of the 44 (variant, path) pairs, one block per dtype and mask, and 7 is prime to 44, so
//! every pair reaches the binary in two or three of the blocks.
//!
//! `cargo test` runs every variant, dtype, mask and path, with the sizes taken in turn (one per
//! combination); `PROBATTN_MATRIX=full` runs every size of every combination, each through the
//! binary too.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::process::Command;

use anyhow::{anyhow, bail, ensure, Context, Result};
use clap::Parser;
use common::TempDir;
use probattn::backend::Route;
use probattn::io::{read_safetensors, write_safetensors_atomic};
use probattn::normalize::BamConfig;
use probattn::precision::Precision;
use probattn::{attend_with_choice, AttendOptions, Backend, Masks, Mode, NormalizerConfig, Variant};
use tch::{nn, Device, Kind, Tensor};

/// The variants, as `attend` flags: every built-in normalizer, BAM sampling (`--train`) and at its
/// mean, over softmax and DNAS bases.
const VARIANTS: [&[&str]; 11] = [
    &["softmax"],
    &["dnas"],
    &["hnas"],
    &["sinkhorn-3"],
    &["bam-wc", "--train"],
    &["bam-wf", "--train", "--base", "dnas"],
    &["bam-lc", "--train"],
    &["bam-lf", "--train", "--base", "sinkhorn-2"],
    &["bam-nokl", "--train"],
    &["bam-wc"],
    &["bam-lc", "--base", "dnas"],
];

/// Input dtypes, and `--precision bf16` over float32 inputs.
const DTYPES: [(&str, Kind, Precision); 4] = [
    ("f32", Kind::Float, Precision::F32),
    ("f64", Kind::Double, Precision::F32),
    ("bf16", Kind::BFloat16, Precision::F32),
    ("f32-autocast-bf16", Kind::Float, Precision::Bf16),
];

const MASKS: [&str; 5] = ["none", "key-padding", "query-key-padding", "attn-mask", "causal"];

/// `(S_q, S_k, d_v)` with `d = 4`: S = 1, S not a multiple of the tile (3), S_q ≠ S_k both ways;
/// `d_v = d` (where the CPU's fused kernel serves the memory-efficient path) and `d_v ≠ d` (the
/// tiles).
const SIZES: [(i64, i64, i64); 6] = [(1, 1, 4), (7, 7, 4), (5, 9, 4), (8, 2, 4), (7, 7, 3), (5, 9, 3)];

/// The paths a user can ask for: eager (the default with weights), memory-efficient (tiles of 3
/// queries, the fused CPU route where the mask allows it), and the forced `tiles` and `fused`
/// backends.
const PATHS: [&str; 4] = ["eager", "memory-efficient", "tiles", "fused"];

/// One run in `BINARY_EVERY` goes through the binary too (prime to the 44 pairs of a block).
const BINARY_EVERY: usize = 7;

const TILE: i64 = 3;
const HIDDEN: i64 = 4;

#[test]
fn attend_exits_cleanly_with_the_eager_result_over_the_input_matrix() -> Result<()> {
    let full = std::env::var("PROBATTN_MATRIX").is_ok_and(|v| v == "full");
    let dir = TempDir::new("attend-matrix")?;
    let mut runs = vec![];
    let mut turn = 0;
    for (d, &(dtype, kind, _)) in DTYPES.iter().enumerate() {
        for (m, &mask) in MASKS.iter().enumerate() {
            for (s, &(sq, sk, dv)) in SIZES.iter().enumerate() {
                let input = dir.path(&format!("{dtype}-{mask}-{sq}x{sk}x{dv}.safetensors"));
                write_input(&input, kind, mask, [sq, sk, dv], (d * 100 + m * 10 + s) as i64)?;
            }
            for variant in VARIANTS {
                for path in PATHS {
                    let sizes: Vec<usize> = if full { (0..SIZES.len()).collect() } else { vec![turn % SIZES.len()] };
                    turn += 1;
                    runs.extend(sizes.into_iter().map(|s| Run { variant, dtype: d, mask, size: s, path }));
                }
            }
        }
    }
    // In this process, one run at a time: the command sets the process's default backend.
    let mut failures: Vec<String> =
        runs.iter().filter_map(|run| run.check_in_process(&dir).err().map(|e| format!("{run} (in process): {e:#}"))).collect();
    probattn::backend::set_default(Backend::Auto);
    // Through the binary, two processes at a time (our machines have two cores); each run's
    // libtorch uses one thread.
    let chosen: Vec<&Run> = runs.iter().enumerate().filter(|(i, _)| full || i % BINARY_EVERY == 0).map(|(_, r)| r).collect();
    failures.extend(std::thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|w| {
                let (chosen, dir) = (&chosen, &dir);
                scope.spawn(move || {
                    chosen
                        .iter()
                        .skip(w)
                        .step_by(2)
                        .filter_map(|run| run.check_binary(dir).err().map(|e| format!("{run} (binary): {e:#}")))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_else(|_| vec!["a worker panicked".into()])).collect::<Vec<_>>()
    }));
    let made = runs.len() + chosen.len();
    ensure!(
        failures.is_empty(),
        "{} of {made} runs failed ({} through the binary):\n{}",
        failures.len(),
        chosen.len(),
        failures.join("\n")
    );
    Ok(())
}

/// One `probattn attend` call of the matrix.
struct Run {
    variant: &'static [&'static str],
    dtype: usize,
    mask: &'static str,
    size: usize,
    path: &'static str,
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (sq, sk, dv) = SIZES[self.size];
        write!(f, "{} {} {} S_q {sq} S_k {sk} d_v {dv} {}", self.variant.join(" "), DTYPES[self.dtype].0, self.mask, self.path)
    }
}

/// What a call did: wrote its output (with what it printed, where that was captured), or failed
/// with a message.
enum Outcome {
    Wrote(Option<String>),
    Refused(String),
}

impl Run {
    fn input(&self, dir: &TempDir) -> std::path::PathBuf {
        let (sq, sk, dv) = SIZES[self.size];
        dir.path(&format!("{}-{}-{sq}x{sk}x{dv}.safetensors", DTYPES[self.dtype].0, self.mask))
    }

    /// `attend`'s arguments for this run, writing to the output file named by `how`.
    fn args(&self, dir: &TempDir, how: &str) -> (Vec<String>, std::path::PathBuf) {
        let output = dir.path(&format!("out-{how}-{}.safetensors", self.to_string().replace(' ', "_")));
        let precision = DTYPES[self.dtype].2;
        let mut args: Vec<String> = ["attend", "--variant"].iter().chain(self.variant).map(|a| a.to_string()).collect();
        args.extend(["--seed", "5", "--device", "cpu", "--threads", "1", "--precision", precision.name()].map(String::from));
        args.extend(["--input".into(), self.input(dir).display().to_string(), "--output".into(), output.display().to_string()]);
        if self.mask == "causal" {
            args.push("--causal".into());
        }
        match self.path {
            "memory-efficient" => args.extend(["--memory-efficient", "--tile", &TILE.to_string()].map(String::from)),
            "tiles" | "fused" => args.extend(["--attention-backend", self.path, "--tile", &TILE.to_string()].map(String::from)),
            _ => {}
        }
        (args, output)
    }

    /// The command's code, from its parsed arguments, in this process: a panic is caught and
    /// reported as the failure it is.
    fn check_in_process(&self, dir: &TempDir) -> Result<()> {
        let (args, output) = self.args(dir, "in-process");
        let cli = probattn_experiments::Cli::try_parse_from(std::iter::once("probattn".to_string()).chain(args))?;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| probattn_experiments::run(&cli)));
        let result = result
            .map_err(|payload| anyhow!("panicked: {}", probattn::panic_message(payload.as_ref()).unwrap_or("a panic without a message")))?;
        // The command set the process default from --attention-backend: the reference takes auto's.
        probattn::backend::set_default(Backend::Auto);
        let outcome = match result {
            Ok(()) => Outcome::Wrote(None),
            Err(e) => Outcome::Refused(format!("error: {e:#}")),
        };
        self.judge(dir, outcome, &output)
    }

    /// Runs the binary: status 0, or status 1 with a named error; never a panic or a signal.
    fn check_binary(&self, dir: &TempDir) -> Result<()> {
        let (args, output) = self.args(dir, "binary");
        let run = Command::new(env!("CARGO_BIN_EXE_probattn")).args(&args).env_remove("RUST_BACKTRACE").output()?;
        let said = binary::text(&run);
        let Some(code) = run.status.code() else { bail!("killed by a signal ({:?}):\n{said}", run.status) };
        ensure!(
            !said.contains("panicked") && !said.contains("internal error") && !said.contains("RUST_BACKTRACE"),
            "a panic reached the user (status {code}):\n{said}"
        );
        let outcome = match code {
            0 => Outcome::Wrote(Some(said)),
            1 => Outcome::Refused(said),
            _ => bail!("status {code} (a named error is status 1):\n{said}"),
        };
        self.judge(dir, outcome, &output)
    }

    /// Holds what a call did to the library's eager result on the same file.
    fn judge(&self, dir: &TempDir, outcome: Outcome, output: &std::path::Path) -> Result<()> {
        let expected = eager(&read_safetensors(&self.input(dir))?, self);
        match (outcome, expected) {
            (Outcome::Wrote(said), Ok((expected, route))) => {
                if let Some(said) = said {
                    ensure!(
                        said.contains(&format!("(route {route})")),
                        "the library's call takes the {route} route; the binary said:\n{said}"
                    );
                }
                let got = read_safetensors(output).context("reading the output")?;
                compare(&got, &expected, self, route == Route::Kernel)
            }
            (Outcome::Refused(said), Err(refused)) => {
                ensure!(said.contains("error: "), "a failure without a named error:\n{said}");
                ensure!(!output.exists(), "a refused call left {}", output.display());
                // The command refuses for the library's reason.
                let reason = refused.to_string();
                let head = reason.split(':').next().unwrap_or(&reason);
                ensure!(said.contains(head), "refused with\n{said}\nwhere the library says: {reason}");
                Ok(())
            }
            (Outcome::Wrote(_), Err(e)) => bail!("wrote an output where the library refuses: {e:#}"),
            (Outcome::Refused(said), Ok(_)) => bail!("failed where the library's call succeeds:\n{said}"),
        }
    }
}

/// The tensors of one input file: `q`, `k`, `v` in `kind`, the masks of `mask`, HNAS's logits, a
/// noise draw and a contextual prior, from `seed`.
fn write_input(path: &std::path::Path, kind: Kind, mask: &str, [sq, sk, dv]: [i64; 3], seed: i64) -> Result<()> {
    tch::manual_seed(seed);
    let (b, h, d) = (2, 2, 4);
    let randn = |shape: &[i64]| Tensor::randn(shape, (Kind::Double, Device::Cpu));
    let mut tensors: Vec<(&str, Tensor)> = vec![
        ("q", (randn(&[b, h, sq, d]) * 2.0).to_kind(kind)),
        ("k", randn(&[b, h, sk, d]).to_kind(kind)),
        ("v", randn(&[b, h, sk, dv]).to_kind(kind)),
        ("hybrid_logit", randn(&[h]).to_kind(Kind::Float)),
        // ε in (0, 1): a uniform draw for the Weibull variants, a valid (if narrow) normal one.
        ("noise", Tensor::rand([b, h, sq, sk], (Kind::Double, Device::Cpu)).clamp(1e-6, 1.0 - 1e-6).to_kind(to_stats(kind))),
        ("prior.f1.weight", randn(&[h, HIDDEN, d]).to_kind(Kind::Float)),
        ("prior.f1.bias", randn(&[h, HIDDEN]).to_kind(Kind::Float)),
        ("prior.f2.weight", randn(&[h, HIDDEN]).to_kind(Kind::Float)),
        ("prior.f2.bias", randn(&[h]).to_kind(Kind::Float)),
    ];
    // Padding ends each sequence of the second batch entry: a third of it, at least one (so a
    // single key or query is padded entirely).
    let padding = |len: i64| {
        let pad = Tensor::zeros([b, len], (Kind::Bool, Device::Cpu));
        let _ = pad.get(1).narrow(0, len - (len + 2) / 3, (len + 2) / 3).fill_(1);
        pad
    };
    match mask {
        "key-padding" => tensors.push(("key_padding_mask", padding(sk))),
        "query-key-padding" => {
            tensors.push(("key_padding_mask", padding(sk)));
            tensors.push(("query_padding_mask", padding(sq)));
        }
        // (B, 1, S_q, S_k), uint8: a random pattern, broadcast over the heads.
        "attn-mask" => tensors.push(("attn_mask", Tensor::rand([b, 1, sq, sk], (Kind::Float, Device::Cpu)).lt(0.3).to_kind(Kind::Uint8))),
        _ => {}
    }
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    Ok(write_safetensors_atomic(path, &named)?)
}

/// The dtype of the noise (and the library's statistics) for inputs of `kind`.
fn to_stats(kind: Kind) -> Kind {
    if kind == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// The library's eager result on the file's tensors, built as `attend` documents: the normalizer
/// with the file's HNAS logits and prior, the file's noise when sampling, the masks; and the route
/// of the run's path, as the library's own call with the command's options takes it. An error
/// where the library refuses the run's path.
fn eager(file: &HashMap<String, Tensor>, run: &Run) -> probattn::Result<(HashMap<String, Tensor>, Route)> {
    let variant: Variant = run.variant[0].parse()?;
    let flag = |name: &str| run.variant.iter().position(|a| *a == name);
    let train = flag("--train").is_some();
    let mut cfg = NormalizerConfig { bam: BamConfig { prior_hidden: HIDDEN, ..BamConfig::default() }, ..NormalizerConfig::default() };
    if let Some(i) = flag("--base") {
        cfg.bam.base = run.variant[i + 1].parse()?;
    }
    let (q, k, v) = (&file["q"], &file["k"], &file["v"]);
    let vs = nn::VarStore::new(Device::Cpu);
    let normalizer = variant.build(&vs.root(), q.size()[1], q.size()[3], &cfg)?;
    for (name, var) in vs.variables() {
        let given = file[&name].to_kind(if q.kind() == Kind::Double { Kind::Double } else { var.kind() });
        let mut var = var;
        tch::no_grad(|| var.set_data(&given));
    }
    let causal = run.mask == "causal";
    let masks = Masks {
        key_padding: file.get("key_padding_mask"),
        query_padding: file.get("query_padding_mask"),
        attn_mask: file.get("attn_mask"),
        causal,
        bias: None,
    };
    let opts = AttendOptions {
        mode: Mode { dropout: false, sample: train },
        noise: if train { file.get("noise") } else { None },
        need_mass: true,
        ..Default::default()
    };
    let precision = DTYPES[run.dtype].2;
    // Whether the library serves the run's path: its own call, without weights, decides.
    let backend = match run.path {
        "tiles" => Backend::Tiles,
        "fused" => Backend::Fused,
        _ => Backend::Auto,
    };
    let mut route = None;
    if run.path != "eager" {
        let path = AttendOptions { need_weights: false, tile: Some(TILE), seed: Some(5), backend, ..opts };
        let (_, choice) = tch::no_grad(|| precision.run(Device::Cpu, || attend_with_choice(q, k, v, &masks, normalizer.as_ref(), path)))??;
        route = Some(choice.route);
    }
    let (out, choice) = tch::no_grad(|| precision.run(Device::Cpu, || attend_with_choice(q, k, v, &masks, normalizer.as_ref(), opts)))??;
    let weights = out.weights()?;
    let mut expected = HashMap::from([
        ("output".to_string(), out.output.shallow_clone()),
        ("received_mass".to_string(), probattn::diagnostics::received_mass(weights)),
    ]);
    if let Some(kl) = &out.kl {
        expected.insert("kl".into(), kl.shallow_clone());
    }
    Ok((expected, route.unwrap_or(choice.route)))
}

/// The command's tensors against the eager ones: the same names, shapes and (to the path's and
/// dtype's rounding) values.
/// `kernel`: the run's route was a normalizer's kernel, which forms no received mass.
fn compare(got: &HashMap<String, Tensor>, expected: &HashMap<String, Tensor>, run: &Run, kernel: bool) -> Result<()> {
    let (_, kind, precision) = DTYPES[run.dtype];
    let low = kind == Kind::BFloat16 || precision == Precision::Bf16;
    let tolerance = match (kind, low, run.path) {
        (Kind::Double, _, "eager") => 1e-12,
        (Kind::Double, _, _) => 1e-10,
        (_, false, _) => 2e-5,
        // bfloat16's 8 bits: the tiles and the eager path round in other places.
        (_, true, "eager") => 1e-6,
        (_, true, _) => 4e-2,
    };
    let mut names: Vec<&String> = expected.keys().collect();
    names.sort();
    for name in names {
        if kernel && name == "received_mass" {
            ensure!(!got.contains_key(name), "the kernel route wrote a received mass");
            continue;
        }
        let want = &expected[name];
        let have = got.get(name).with_context(|| format!("no '{name}' in the output (it has {:?})", got.keys().collect::<Vec<_>>()))?;
        ensure!(have.size() == want.size(), "{name} has shape {:?}, expected {:?}", have.size(), want.size());
        ensure!(have.is_contiguous(), "{name} was written non-contiguous");
        let (have, want) = (have.to_kind(Kind::Double), want.to_kind(Kind::Double));
        ensure!(bool::try_from(have.isnan().eq_tensor(&want.isnan()).all())?, "{name}: NaN where the eager path has none, or the reverse");
        let diff = (&have - &want).nan_to_num(0.0, None, None).abs();
        let worst = if diff.numel() == 0 { 0.0 } else { f64::try_from(diff.max())? };
        // The KL is a sum over the entries: relative to its size.
        let scale = if name == "kl" { f64::try_from(want.abs().max())?.max(1.0) } else { 1.0 };
        ensure!(worst <= tolerance * scale, "{name} differs from the eager path's by {worst:e} (tolerance {tolerance:e})");
    }
    ensure!(got.contains_key("weights") == (run.path == "eager"), "weights written: {}", got.contains_key("weights"));
    Ok(())
}

#[test]
fn bench_measures_odd_lengths_on_every_path_and_precision() -> Result<()> {
    // `bench --quick` at S = 1 and 7 (not a multiple of the tile), eager, memory-efficient and on
    // the fused backend, in float32, tf32 (float32 on the CPU, which it says) and bfloat16: status
    // 0, no panic, a finite time for every variant at both lengths (on the fused backend: or the
    // reason it is not served). The SVGD hook's step, which takes most of a run (two minutes in
    // bfloat16, which this CPU emulates), is timed in the first run only and left out of the
    // others with --no-svgd.
    let dir = TempDir::new("bench-matrix")?;
    for precision in ["f32", "tf32", "bf16"] {
        for path in ["eager", "memory-efficient", "fused"] {
            let out = dir.path(&format!("{precision}-{path}"));
            let svgd = precision == "f32" && path == "eager";
            let mut args = vec!["bench", "--quick", "--seq-lens", "1,7", "--repeats", "1", "--no-pytorch", "--batch", "2"];
            args.extend(["--threads", "1", "--device", "cpu", "--precision", precision, "--out", out.to_str().context("path")?]);
            if !svgd {
                args.push("--no-svgd");
            }
            if path == "memory-efficient" {
                args.extend(["--memory-efficient", "--tile", "3"]);
            }
            if path == "fused" {
                args.extend(["--fused", "--no-eager"]);
            }
            let run = Command::new(env!("CARGO_BIN_EXE_probattn")).args(&args).env_remove("RUST_BACKTRACE").output()?;
            let said = binary::text(&run);
            ensure!(run.status.code() == Some(0), "bench {precision} {path}: status {:?}:\n{said}", run.status);
            ensure!(!said.contains("panicked") && !said.contains("internal error"), "bench {precision} {path}:\n{said}");
            ensure!((precision == "tf32") == said.contains("tf32 on the CPU runs as f32"), "bench {precision} {path}:\n{said}");
            let json = binary::json(&out.join("bench.json"))?;
            ensure!(
                json["svgd"].is_object() == svgd && said.contains("SVGD hook:") == svgd,
                "bench {precision} {path}: svgd {}:\n{said}",
                json["svgd"]
            );
            if svgd {
                let ms = json["svgd"]["step_ms_with"].as_f64();
                ensure!(ms.is_some_and(|ms| ms.is_finite() && ms > 0.0), "bench {precision} {path}: svgd {}", json["svgd"]);
            }
            let rows = json["measurements"].as_array().context("measurements")?;
            let implementation = match path {
                "eager" => "probattn",
                "fused" => "probattn-fused",
                _ => "probattn-memory-efficient",
            };
            for variant in probattn::normalize::registry::benchmarked() {
                let unserved = json["unserved"].as_array().context("unserved")?.iter().find(|u| u["variant"] == variant);
                if let Some(u) = unserved {
                    ensure!(path == "fused" && u["reason"].as_str().is_some_and(|r| !r.is_empty()), "bench {precision} {path}: {u}");
                    ensure!(said.contains(&format!("Not served: probattn-fused {variant} (")), "{said}");
                    continue;
                }
                for seq_len in [1, 7] {
                    let row = rows.iter().find(|r| r["variant"] == variant && r["seq_len"] == seq_len && r["impl"] == implementation);
                    let ms = row.and_then(|r| r["fwd_bwd_ms"].as_f64());
                    ensure!(
                        ms.is_some_and(|ms| ms.is_finite() && ms > 0.0),
                        "bench {precision} {path}: no {implementation} time for {variant} at S = {seq_len}"
                    );
                    let route = row.and_then(|r| r["route"].as_str()).unwrap_or_default();
                    let expected: &[&str] = match path {
                        "eager" => &["eager", "kernel"],
                        "fused" => &["kernel", "fused-cpu"],
                        _ => &["tiles", "fused-cpu"],
                    };
                    ensure!(expected.contains(&route), "bench {precision} {path}: {variant} at S = {seq_len} ran on route '{route}'");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn bench_keeps_the_backend_its_command_forces() -> Result<()> {
    // --attention-backend tiles reaches the memory-efficient rows: they ran on the fused CPU
    // kernel (auto's choice) before, whatever the flag said.
    let dir = TempDir::new("bench-backend")?;
    let out = dir.path("out");
    let run = Command::new(env!("CARGO_BIN_EXE_probattn"))
        .args(["bench", "--device", "cpu", "--batch", "1", "--memory-efficient", "--no-eager", "--variants", "dnas"])
        .args(["--attention-backend", "tiles", "--seq-lens", "16", "--repeats", "1", "--no-pytorch", "--no-svgd", "--out"])
        .arg(&out)
        .output()?;
    ensure!(run.status.success(), "{}", binary::text(&run));
    let bench = binary::json(&out.join("bench.json"))?;
    let routes: Vec<&str> = bench["measurements"].as_array().context("measurements")?.iter().filter_map(|m| m["route"].as_str()).collect();
    ensure!(routes == ["tiles"], "routes {routes:?}");
    Ok(())
}

#[test]
fn bench_with_nothing_it_can_serve_says_so_instead_of_panicking() -> Result<()> {
    // BAM's sampling in bfloat16 is not served by the fused CPU kernel: with --no-eager that leaves
    // no configuration to measure, which is a named error (status 1), not an index out of bounds.
    let dir = TempDir::new("bench-unserved")?;
    let out = dir.path("out");
    let args = ["bench", "--device", "cpu", "--batch", "1", "--fused", "--no-eager", "--precision", "bf16", "--variants", "bam-wc"];
    let run = Command::new(env!("CARGO_BIN_EXE_probattn"))
        .args(args)
        .args(["--seq-lens", "8", "--repeats", "1", "--no-pytorch", "--out", out.to_str().context("path")?])
        .env_remove("RUST_BACKTRACE")
        .output()?;
    let said = binary::text(&run);
    ensure!(run.status.code() == Some(1), "status {:?}:\n{said}", run.status);
    ensure!(!said.contains("panic") && !said.contains("internal error"), "{said}");
    ensure!(said.contains("nothing to measure") && said.contains("probattn-fused bam-wc: "), "{said}");
    ensure!(!out.exists(), "a run that measured nothing left {}", out.display());
    Ok(())
}
