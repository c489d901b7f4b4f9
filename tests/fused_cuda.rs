//! The fused CUDA route (src/attention/fused_cuda.rs, probattn-sys/csrc/fused_cuda.cpp): what it
//! launches, checked on any machine against the Python orchestration that the kernel check holds
//! to the formulas under Triton's interpreter; and, where a GPU is present, its results against
//! the float64 tiles, forward and gradients, and the backend's choice of it.

mod common;

use anyhow::{ensure, Context, Result};
use probattn::backend::{Backend, Route};
use probattn::normalize::BamKind;
use probattn::normalize::{Dnas, Softmax};
use probattn::tiled::{attend_tiled, counter_noise, Kl, KlForm, NoiseKind, PriorFn, Sampling, Tiled, TiledOptions};
use probattn::{attend_with_choice, AttendOptions, Masks, Mode};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

/// One call: (B, H, H_KV, S_Q, S_K, D, DV), its plan and its masks.
#[derive(Clone, Copy, Debug)]
struct Case {
    shape: [i64; 7],
    /// 0 softmax, 1 DNAS, N Sinkhorn-N.
    sweeps: i64,
    causal: bool,
    /// The last key of the first batch padded.
    key_padding: bool,
    /// The first query of the last batch padded.
    query_padding: bool,
    /// BAM's noise: 0 none, 1 Weibull and 2 Lognormal with their KL terms, 3 Weibull without
    /// (bam-nokl), 4 Lognormal without.
    noise: i32,
    /// HNAS: one sweep mixed with softmax.
    hybrid: bool,
    /// A boolean (S_q, S_k) pattern broadcast over batch and heads, and an additive (1, H, S_q, S_k)
    /// mask with `-inf` entries, as launches.py draws them.
    pattern: bool,
    additive: bool,
    /// The received mass asked for too (with BAM, of the sampled weights).
    mass: bool,
}

const fn case(shape: [i64; 7], sweeps: i64, causal: bool, (key_padding, query_padding): (bool, bool), noise: i32, hybrid: bool) -> Case {
    Case { shape, sweeps, causal, key_padding, query_padding, noise, hybrid, pattern: false, additive: false, mass: false }
}

/// A case that asks for the received mass too.
const fn with_mass(c: Case) -> Case {
    Case { mass: true, ..c }
}

/// A case under a boolean pattern, an additive mask, or both.
const fn masked(c: Case, pattern: bool, additive: bool) -> Case {
    Case { pattern, additive, ..c }
}

const NONE: (bool, bool) = (false, false);
const KEYS: (bool, bool) = (true, false);
const QUERIES: (bool, bool) = (false, true);
const BOTH: (bool, bool) = (true, true);

impl Case {
    /// Whether the backward adds dQ by atomics from the key pass in a 16-bit dtype (the one these
    /// cases are compared in): softmax's base (softmax, and BAM over it: no sweeps, no mixture) up to
    /// head dimension 128 (settings.py's atomic_dq).
    fn atomic_dq(&self) -> bool {
        self.sweeps == 0 && !self.hybrid && self.shape[5].max(self.shape[6]) <= 128
    }

    /// The kernels' noise code and KL form.
    fn noise_and_kl(&self) -> (i32, i32) {
        match self.noise {
            3 => (1, 0),
            4 => (2, 0),
            n => (n, n),
        }
    }
}

const CASES: [Case; 41] = [
    case([1, 2, 2, 30, 50, 32, 32], 0, false, KEYS, 0, false),
    with_mass(case([1, 2, 2, 64, 64, 64, 64], 0, false, NONE, 0, false)),
    with_mass(case([2, 4, 2, 70, 90, 48, 48], 1, false, KEYS, 0, false)),
    with_mass(case([1, 2, 1, 100, 77, 64, 64], 0, true, KEYS, 0, false)),
    case([2, 2, 2, 65, 130, 128, 128], 1, false, NONE, 0, false),
    case([1, 4, 4, 33, 33, 100, 100], 0, true, NONE, 0, false),
    case([1, 1, 1, 1, 5, 16, 16], 1, false, KEYS, 0, false),
    with_mass(case([2, 4, 2, 70, 90, 48, 48], 1, false, BOTH, 0, true)),
    case([1, 2, 1, 33, 65, 64, 64], 1, false, NONE, 0, true),
    with_mass(case([2, 4, 2, 70, 90, 48, 48], 3, false, BOTH, 0, false)),
    case([1, 2, 2, 65, 130, 128, 128], 3, false, NONE, 0, false),
    case([2, 2, 2, 64, 40, 64, 64], 1, false, QUERIES, 0, false),
    with_mass(case([2, 2, 1, 50, 50, 64, 64], 0, true, BOTH, 0, false)),
    with_mass(case([1, 2, 2, 40, 40, 64, 64], 0, false, NONE, 1, false)),
    case([2, 4, 2, 70, 90, 48, 48], 1, false, BOTH, 1, false),
    with_mass(case([1, 2, 1, 65, 33, 128, 128], 0, false, KEYS, 2, false)),
    with_mass(case([2, 2, 2, 50, 70, 64, 64], 1, false, NONE, 2, false)),
    with_mass(case([2, 2, 1, 100, 77, 64, 64], 0, true, BOTH, 1, false)),
    with_mass(case([1, 4, 2, 65, 65, 32, 32], 0, true, NONE, 2, false)),
    with_mass(case([2, 4, 2, 70, 90, 48, 48], 1, false, BOTH, 1, true)),
    with_mass(case([1, 2, 1, 40, 65, 64, 64], 1, false, NONE, 2, true)),
    with_mass(case([1, 2, 2, 50, 70, 64, 64], 3, false, KEYS, 1, false)),
    case([2, 2, 1, 33, 40, 32, 32], 3, false, QUERIES, 2, false),
    case([1, 2, 2, 40, 40, 64, 64], 0, false, NONE, 3, false),
    with_mass(case([2, 2, 2, 64, 40, 64, 64], 1, false, BOTH, 3, false)),
    case([1, 2, 1, 50, 50, 64, 64], 0, true, KEYS, 3, false),
    // Without a KL term over every base: Lognormal, and Weibull over HNAS and Sinkhorn-N.
    with_mass(case([1, 2, 1, 65, 33, 128, 128], 0, false, KEYS, 4, false)),
    case([2, 2, 1, 100, 77, 64, 64], 0, true, BOTH, 4, false),
    with_mass(case([2, 2, 2, 50, 70, 64, 64], 1, false, NONE, 4, false)),
    with_mass(case([2, 4, 2, 70, 90, 48, 48], 1, false, BOTH, 3, true)),
    case([1, 2, 1, 40, 65, 64, 64], 1, false, KEYS, 4, true),
    case([1, 2, 2, 50, 70, 64, 64], 3, false, KEYS, 3, false),
    with_mass(case([2, 2, 1, 33, 40, 32, 32], 2, false, QUERIES, 4, false)),
    with_mass(masked(case([2, 4, 2, 70, 90, 48, 48], 1, false, NONE, 0, false), true, false)),
    masked(case([1, 2, 1, 100, 77, 64, 64], 0, true, KEYS, 0, false), false, true),
    with_mass(masked(case([1, 2, 2, 65, 70, 64, 64], 1, false, QUERIES, 0, true), true, true)),
    masked(case([1, 2, 2, 50, 70, 64, 64], 3, false, NONE, 0, false), true, false),
    // Sinkhorn-N for other N: one gradient kernel takes N at run time.
    with_mass(case([2, 2, 1, 40, 70, 64, 64], 2, false, KEYS, 0, false)),
    case([1, 2, 2, 50, 50, 64, 64], 5, false, BOTH, 1, false),
    // Head dimensions past 128: the 256 set.
    with_mass(case([1, 2, 1, 40, 70, 200, 136], 1, false, KEYS, 0, false)),
    case([1, 2, 2, 33, 50, 256, 256], 0, true, NONE, 2, false),
];

const NOISE_NAMES: [&str; 3] = ["", "weibull", "lognormal"];
/// The draws' key: its high word nonzero, as the kernel check's seeds.
const SEED: u64 = (5 << 32) + 11;
const NOISE_SCALE: f64 = 0.4;

/// A case's tensors: q, k, v, and its masks in the shapes launches.py draws them.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// (B, S_k) and (B, S_q), true = excluded.
    kpad: Tensor,
    qpad: Tensor,
    /// (S_q, S_k), true = excluded (the library's convention).
    excluded: Tensor,
    /// (1, H, S_q, S_k): an ALiBi-like bias per head, `-inf` where a key is more than 6 ahead.
    additive: Tensor,
}

fn inputs(shape: [i64; 7], kind: Kind, device: Device) -> Inputs {
    let [b, h, h_kv, s_q, s_k, d, dv] = shape;
    let opts = (Kind::Float, Device::Cpu);
    let q = Tensor::randn([b, h, s_q, d], opts).to_kind(kind).to_device(device);
    let k = Tensor::randn([b, h_kv, s_k, d], opts).to_kind(kind).to_device(device);
    let v = Tensor::randn([b, h_kv, s_k, dv], opts).to_kind(kind).to_device(device);
    // The last key of the first batch and the first query of the last batch, as launches.py pads them.
    let kpad = Tensor::zeros([b, s_k], (Kind::Bool, Device::Cpu));
    let _ = kpad.get(0).get(s_k - 1).fill_(1);
    let qpad = Tensor::zeros([b, s_q], (Kind::Bool, Device::Cpu));
    let _ = qpad.get(b - 1).get(0).fill_(1);
    // The pattern and the additive mask are (S_q, S_k) and (1, H, S_q, S_k): drawn for the cases'
    // sizes, and left as one entry for a call too large to hold them (which asks for neither).
    let (s_q, s_k) = if s_q * s_k > 1 << 22 { (1, 1) } else { (s_q, s_k) };
    let excluded = Tensor::rand([s_q, s_k], opts).ge(0.7);
    let i = Tensor::arange(s_q, opts).view([-1, 1]);
    let j = Tensor::arange(s_k, opts).view([1, -1]);
    let slopes = Tensor::from_slice(&(1..=h).map(|t| 0.5f32.powi(t as i32)).collect::<Vec<_>>()).view([-1, 1, 1]);
    let additive = (-slopes * (&i - &j).abs()).masked_fill(&(&j - &i).gt(6.0), f64::NEG_INFINITY).unsqueeze(0);
    let on = |t: Tensor| t.to_device(device);
    Inputs { q, k, v, kpad: on(kpad), qpad: on(qpad), excluded: on(excluded), additive: on(additive) }
}

impl Case {
    /// The case's masks over `x`'s tensors.
    fn masks<'a>(&self, x: &'a Inputs) -> Masks<'a> {
        Masks {
            key_padding: self.key_padding.then_some(&x.kpad),
            query_padding: self.query_padding.then_some(&x.qpad),
            attn_mask: self.pattern.then_some(&x.excluded),
            bias: self.additive.then_some(&x.additive),
            causal: self.causal,
        }
    }
}

/// The name Python and the manifest give a dtype.
fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "float32",
        Kind::BFloat16 => "bfloat16",
        _ => "float16",
    }
}

/// The embedded sm_90 cubins' launch settings in `kind` for a case's head dimensions (those the
/// route takes: the smallest embedded head dimension that holds d and d_v), as launches.py's
/// `--config`.
fn embedded_config(shape: [i64; 7], kind: Kind) -> Result<String> {
    let widest = shape[5].max(shape[6]);
    let dtype = dtype_name(kind);
    let chosen = probattn_sys::kernels::kernels()
        .iter()
        .filter(|k| k.arch_number() == 90 && k.dtype == dtype && k.head_dim >= widest)
        .min_by_key(|k| k.head_dim)
        .with_context(|| format!("an embedded sm_90 {dtype} kernel for the case"))?;
    Ok(format!("{},{},{},{}", chosen.block_m, chosen.block_n, chosen.num_warps, chosen.num_stages))
}

/// The arguments of launches.py for a case in `kind`: one line of its `--batch` input.
fn python_arguments(case: &Case, scale: f64, kind: Kind) -> Result<String> {
    let mut args = vec![
        format!("--config {} --dtype {}", embedded_config(case.shape, kind)?, dtype_name(kind)),
        format!("--shape {} --sweeps {} --scale {scale}", case.shape.map(|n| n.to_string()).join(","), case.sweeps),
    ];
    for (on, flag) in [
        (case.causal, "--causal"),
        (case.key_padding, "--key-padding"),
        (case.query_padding, "--query-padding"),
        (case.hybrid, "--hybrid"),
        (case.pattern, "--pattern"),
        (case.additive, "--additive"),
        (case.mass, "--mass"),
    ] {
        if on {
            args.push(flag.into());
        }
    }
    let (noise, kl) = case.noise_and_kl();
    if noise > 0 {
        args.push(format!("--noise {} --seed {SEED} --noise-scale {NOISE_SCALE}", NOISE_NAMES[noise as usize]));
    }
    if noise > 0 && kl == 0 {
        args.push("--no-kl".into());
    }
    Ok(args.join(" "))
}

/// The launches plans.py makes for each case in `kind`, from one Python process; `deterministic`:
/// with libtorch's deterministic algorithms asked for.
fn python_launches(cases: &[Case], scale: f64, kind: Kind, deterministic: bool) -> Result<Vec<Value>> {
    let flag = if deterministic { " --deterministic" } else { "" };
    let lines = cases.iter().map(|c| Ok(python_arguments(c, scale, kind)? + flag)).collect::<Result<Vec<_>>>()?.join("\n");
    let mut command = common::python_module("kernels.launches")?;
    command.arg("--batch").stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    command.stderr(std::process::Stdio::piped());
    let mut child = command.spawn().context("running probattn_tools.kernels.launches")?;
    std::io::Write::write_all(&mut child.stdin.take().context("its standard input")?, lines.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "kernels.launches failed: {}", String::from_utf8_lossy(&out.stderr));
    let all: Vec<Value> = serde_json::from_slice(&out.stdout)?;
    ensure!(all.len() == cases.len(), "kernels.launches described {} calls of {}", all.len(), cases.len());
    Ok(all)
}

/// Tensor arguments the Python side passes as one- or two-element stand-ins for a feature the call
/// does not use; the dry run leaves them out of its record.
fn unused_stand_in(entry: &Value) -> bool {
    entry[0].as_array().is_some_and(|shape| shape.len() == 1 && shape[0].as_i64().is_some_and(|n| n <= 2))
}

#[test]
fn the_route_launches_what_the_checked_python_orchestration_launches() -> Result<()> {
    // libtorch's deterministic switch is process-wide: the tests that depend on it hold the lock.
    let _serial = common::serial();
    let launched = compare_launches(&CASES, Kind::Half)?;
    // Sinkhorn-N adds dQ by atomics from its dK/dV stage, softmax's base (softmax and BAM over it,
    // up to head dimension 128) from its key pass: no pass of dQ's own.
    for (case, kernels) in CASES.iter().zip(launched) {
        assert!(!kernels.iter().any(|k| k == "_sink_query_grads"), "{case:?}: {kernels:?}");
        if case.atomic_dq() {
            assert!(!kernels.iter().any(|k| k == "_query_pass"), "{case:?}: {kernels:?}");
        }
    }
    Ok(())
}

#[test]
fn with_deterministic_algorithms_asked_for_dq_takes_a_pass_of_its_own_in_both() -> Result<()> {
    let _serial = common::serial();
    let cases: Vec<Case> = CASES.iter().copied().filter(|c| c.sweeps > 1 || c.atomic_dq()).collect();
    let before = probattn_sys::set_deterministic_algorithms(true)?;
    let launched = compare_launches_with(&cases, Kind::Half, true);
    probattn_sys::set_deterministic_algorithms(before)?;
    let launched = launched?;
    assert!(!cases.is_empty());
    for (case, kernels) in cases.iter().zip(launched) {
        if kernels.is_empty() {
            continue; // this build embeds no kernel (compare_launches_with said so)
        }
        // The backward ends with the dK/dV stage (the key pass), then dQ's own.
        let last = if case.sweeps > 1 { ["_sink_key_grads", "_sink_query_grads"] } else { ["_key_pass", "_query_pass"] };
        assert!(kernels.ends_with(&last.map(String::from)), "{case:?}: {kernels:?}");
    }
    Ok(())
}

/// Whether float32's embedded set serves a case: the deterministic plans (BAM's sampling in float32
/// takes the tiles) up to head dimension 128.
fn in_float32_set(c: &Case) -> bool {
    c.noise == 0 && c.shape[5].max(c.shape[6]) <= 128
}

#[test]
fn float32_with_tf32_allowed_launches_what_python_launches_and_without_it_is_refused_by_name() -> Result<()> {
    if let Some(why) = probattn_sys::kernels::missing() {
        eprintln!("skipped: this build embeds no kernel ({why})");
        return Ok(());
    }
    // libtorch's switch is process-wide: the tests that read it hold the lock.
    let _serial = common::serial();
    let before = probattn_sys::set_allow_tf32(false)?;
    let Inputs { q, k, v, .. } = inputs([1, 2, 2, 8, 8, 64, 64], Kind::Float, Device::Cpu);
    let spec = probattn_sys::FusedSpec { scale: 0.3, sweeps: 1, ..Default::default() };
    let refused = probattn_sys::fused_cuda_dry_run(&q, &k, &v, &spec, 90).err().map(|e| e.to_string()).unwrap_or_default();
    probattn_sys::set_allow_tf32(true)?;
    let cases: Vec<Case> = CASES.iter().copied().filter(in_float32_set).collect();
    let compared = compare_launches(&cases, Kind::Float).map(drop);
    probattn_sys::set_allow_tf32(before)?;
    assert!(refused.contains("TF32") && refused.contains("allow_tf32"), "{refused}");
    compared
}

#[test]
fn a_bam_call_past_2_32_score_entries_launches_what_python_launches() -> Result<()> {
    // 2 × 50,000 × 50,000 entries: positions past 2^32, the draws' hash taking each position's high
    // word (the same kernels as below it).
    const PAST: Case = case([1, 2, 1, 50_000, 50_000, 64, 64], 1, false, KEYS, 1, false);
    let [b, h, _, s_q, s_k, ..] = PAST.shape;
    assert!(b * h * s_q * s_k > 1 << 32);
    let _serial = common::serial();
    compare_launches(&[PAST], Kind::Half).map(drop)
}

/// Holds the dry run's launches for each case in `kind` equal to plans.py's, launch by launch;
/// returns the kernels each case launched, in order (none where the build embeds no kernel).
fn compare_launches(cases: &[Case], kind: Kind) -> Result<Vec<Vec<String>>> {
    compare_launches_with(cases, kind, false)
}

/// [`compare_launches`], plans.py's launches with libtorch's deterministic algorithms asked for
/// where `deterministic` (the dry run reads libtorch's switch as the caller left it).
fn compare_launches_with(cases: &[Case], kind: Kind, deterministic: bool) -> Result<Vec<Vec<String>>> {
    if let Some(why) = probattn_sys::kernels::missing() {
        eprintln!("skipped: this build embeds no kernel ({why})");
        return Ok(vec![Vec::new(); cases.len()]);
    }
    const SCALE: f64 = 0.3;
    let python = python_launches(cases, SCALE, kind, deterministic)?;
    let mut launched = Vec::new();
    for (case, theirs) in cases.iter().zip(python) {
        let (shape, (noise, kl)) = (case.shape, case.noise_and_kl());
        let x = inputs(shape, kind, Device::Cpu);
        let (q, k, v) = (&x.q, &x.k, &x.v);
        let prior = Tensor::rand([shape[0], shape[1], 1, shape[4]], (Kind::Float, Device::Cpu));
        let logit = Tensor::randn([shape[1]], (Kind::Float, Device::Cpu));
        let pattern = x.excluded.logical_not();
        let spec = probattn_sys::FusedSpec {
            scale: SCALE,
            sweeps: case.sweeps,
            hybrid: case.hybrid,
            key_padding: case.key_padding.then_some(&x.kpad),
            query_padding: case.query_padding.then_some(&x.qpad),
            pattern: case.pattern.then_some(&pattern),
            bias: case.additive.then_some(&x.additive),
            causal: case.causal,
            noise,
            kl,
            noise_scale: NOISE_SCALE,
            seed: SEED,
            prior: (kl > 0).then_some(&prior),
            hybrid_logit: case.hybrid.then_some(&logit),
            mass: case.mass,
        };
        let ours: Value = serde_json::from_str(&probattn_sys::fused_cuda_dry_run(q, k, v, &spec, 90)?)?;
        let (ours, theirs) = (ours.as_array().context("an array")?, theirs.as_array().context("an array")?);
        let kernels = |l: &[Value]| l.iter().map(|x| x["kernel"].as_str().unwrap_or("").to_string()).collect::<Vec<_>>();
        assert_eq!(kernels(ours), kernels(theirs), "{case:?}: the kernels launched, in order");
        launched.push(kernels(ours));
        for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
            let at = format!("{case:?}, launch {i} ({})", o["kernel"]);
            assert_eq!(o["key"], t["key"], "{at}: the specialization");
            assert_eq!(o["grid"], t["grid"], "{at}: the grid");
            assert_eq!(o["ints"], t["ints"], "{at}: the integer arguments");
            let (ot, tt) = (o["tensors"].as_object().context("tensors")?, t["tensors"].as_object().context("tensors")?);
            for (name, entry) in tt {
                match ot.get(name) {
                    Some(ours) => assert_eq!(ours, entry, "{at}: tensor {name}"),
                    None => assert!(unused_stand_in(entry), "{at}: tensor {name} {entry} is not passed"),
                }
            }
            assert!(ot.keys().all(|n| tt.contains_key(n)), "{at}: {:?} against {:?}", ot.keys(), tt.keys());
        }
    }
    Ok(launched)
}

#[test]
fn without_a_driver_the_status_says_why_and_the_route_is_refused_by_name() -> Result<()> {
    match probattn_sys::fused_cuda_status(0)? {
        Ok(device) => assert!(device.arch >= 50 && device.shared_optin >= 48 << 10, "{device:?}"),
        Err(why) => assert!(why.contains("libcuda.so.1") || why.contains("cuInit"), "{why}"),
    }
    // The launcher refuses CPU tensors by name, after every embedded kernel registered.
    let Inputs { q, k, v, .. } = inputs([1, 1, 1, 4, 4, 16, 16], Kind::BFloat16, Device::Cpu);
    let spec = probattn_sys::FusedSpec { scale: 0.25, sweeps: 1, ..Default::default() };
    let err = probattn_sys::fused_cuda_attention(&q, &k, &v, &spec).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("CUDA"), "{err}");
    // The backend's reason for a CPU call.
    let plan = Tiled::dnas();
    let shape = probattn::ScoreShape { batch: 1, heads: 1, queries: 4, keys: 4 };
    let why = probattn::fused_cuda::unserved(shape, &q, &v, &Masks::default(), &plan, &AttendOptions::default());
    assert_eq!(why.as_deref(), Some("it runs on CUDA devices"));
    Ok(())
}

/// The Lognormal KL part's terms over the whole score matrix, in float64, from the allowed pairs
/// (no causal mask): `[KS, TROW, QBAR, dA, the dQ term]` as `fused_linear_kl_terms` returns them,
/// for T = Σ e_ij², e_ij = z_ij − RB_i − a_j, and of T's gradient the terms that do not pass
/// through RB_i.
#[allow(clippy::too_many_arguments)]
fn lognormal_kl_dense(
    q: &Tensor,
    k: &Tensor,
    a: &Tensor,
    qpad: &Tensor,
    kpad: &Tensor,
    scale: f64,
    rb: &Tensor,
    dkl: &Tensor,
) -> [Tensor; 5] {
    let kk = k.repeat_interleave_self_int(q.size()[1] / k.size()[1], 1, None::<i64>);
    let z = q.matmul(&kk.transpose(-2, -1)) * scale;
    let allowed = qpad.eq(0).unsqueeze(1).unsqueeze(-1).logical_and(&kpad.eq(0).unsqueeze(1).unsqueeze(2));
    let e = (z - rb.unsqueeze(-1) - a.unsqueeze(2)) * allowed.to_kind(Kind::Double);
    let dkl = dkl.unsqueeze(-1);
    let dz = dkl.unsqueeze(-1) * &e * 2.0; // ∂T/∂z_ij at fixed RB_i, times dkl
    let ks = e.sum_dim_intlist(-1, false, Kind::Double) * 2.0;
    let trow = (&e * &e).sum_dim_intlist(-1, false, Kind::Double);
    let qbar = dz.transpose(-2, -1).matmul(q);
    let da = &dkl * e.sum_dim_intlist(-2, false, Kind::Double) * -2.0;
    let dq = dz.matmul(&kk) * scale;
    [ks, trow, qbar, da, dq]
}

/// The Weibull KL part's terms over the whole score matrix, in float64, from the allowed pairs:
/// `[KS, TROW, QBAR, dA, the dQ term]` as `fused_linear_kl_terms` returns them.
#[allow(clippy::too_many_arguments)]
fn linear_kl_dense(
    q: &Tensor,
    k: &Tensor,
    a: &Tensor,
    qpad: &Tensor,
    kpad: &Tensor,
    causal: bool,
    scale: f64,
    rb: &Tensor,
    dkl: &Tensor,
) -> [Tensor; 5] {
    let (s_q, s_k) = (q.size()[2], k.size()[2]);
    let kk = k.repeat_interleave_self_int(q.size()[1] / k.size()[1], 1, None::<i64>);
    let z = q.matmul(&kk.transpose(-2, -1)) * scale;
    let mut allowed = qpad.eq(0).unsqueeze(1).unsqueeze(-1).logical_and(&kpad.eq(0).unsqueeze(1).unsqueeze(2));
    if causal {
        allowed = allowed.logical_and(&Tensor::ones([s_q, s_k], (Kind::Bool, Device::Cpu)).tril(0));
    }
    let m = allowed.to_kind(Kind::Double);
    let am = a.unsqueeze(2) * &m; // a_j on each allowed pair
    let centred = &z - rb.unsqueeze(-1);
    let dkl = dkl.unsqueeze(-1);
    let ks = am.sum_dim_intlist(-1, false, Kind::Double);
    let trow = (&am * &centred).sum_dim_intlist(-1, false, Kind::Double);
    let qsum = m.transpose(-2, -1).matmul(q); // Σ_i q_i over the queries that see key j
    let qbar = (&dkl * a).unsqueeze(-1) * qsum;
    let da = &dkl * (&m * &centred).sum_dim_intlist(-2, false, Kind::Double);
    let dq = dkl.unsqueeze(-1) * am.matmul(&kk) * scale;
    [ks, trow, qbar, da, dq]
}

#[test]
fn the_kl_terms_the_route_forms_from_sums_equal_those_over_the_score_matrix() -> Result<()> {
    // What the route's C++ side forms where the kernels leave the KL part's sums over the logits
    // to it (over softmax's base): Weibull's with and without the causal mask, Lognormal's without
    // it; bam.py's twin is held to the same in python/tests/test_linear_kl.py.
    tch::manual_seed(11);
    let opts = (Kind::Double, Device::Cpu);
    for (kl, (s_q, s_k), causal, padded, (h, h_kv)) in [(9, 6), (5, 11)]
        .into_iter()
        .flat_map(|l| [false, true].into_iter().map(move |c| (l, c)))
        .flat_map(|(l, c)| [false, true].into_iter().map(move |p| (l, c, p)))
        .flat_map(|(l, c, p)| [(4, 2), (2, 2)].into_iter().map(move |g| (l, c, p, g)))
        .flat_map(|(l, c, p, g)| [1, 2].into_iter().map(move |kl| (kl, l, c, p, g)))
        .filter(|&(kl, _, causal, _, _)| kl == 1 || !causal)
    {
        let (b, d, scale) = (2, 8, 0.6 / 8f64.sqrt());
        let q = Tensor::randn([b, h, s_q, d], opts);
        let k = Tensor::randn([b, h_kv, s_k, d], opts);
        let a = Tensor::rand([b, h, s_k], opts) + 0.1;
        let pad = |n: i64| {
            if padded {
                Tensor::rand([b, n], opts).lt(0.3).to_kind(Kind::Uint8)
            } else {
                Tensor::zeros([b, n], (Kind::Uint8, Device::Cpu))
            }
        };
        let (qpad, kpad) = (pad(s_q), pad(s_k));
        let rb = Tensor::randn([b, h, s_q], opts);
        let dkl = Tensor::randn([b, h], opts);
        let ours = probattn_sys::fused_linear_kl_terms(&q, &k, &a, &qpad, &kpad, causal, scale, kl, &rb, &dkl)?;
        let want = if kl == 1 {
            linear_kl_dense(&q, &k, &a, &qpad, &kpad, causal, scale, &rb, &dkl)
        } else {
            lognormal_kl_dense(&q, &k, &a, &qpad, &kpad, scale, &rb, &dkl)
        };
        for ((name, got), want) in ["KS", "TROW", "QBAR", "dA", "dQ"].iter().zip(&ours).zip(&want) {
            let at = format!("KL {kl}, {name}: S_q {s_q}, S_k {s_k}, causal {causal}, padded {padded}, heads {h}/{h_kv}");
            ensure!(got.size() == want.size(), "{at}: shape {:?} against {:?}", got.size(), want.size());
            let diff = common::max_diff(got, want);
            ensure!(diff <= 1e-12 * (1.0 + common::max_abs(want)), "{at}: differs by {diff:e}");
        }
    }
    // Lognormal's part under the causal mask (a d × d sum per key) and a part that is neither are
    // refused by name.
    let (q, a, pad, rb, dkl) = (
        Tensor::randn([1, 1, 3, 4], opts),
        Tensor::rand([1, 1, 3], opts),
        Tensor::zeros([1, 3], (Kind::Uint8, Device::Cpu)),
        Tensor::zeros([1, 1, 3], opts),
        Tensor::ones([1, 1], opts),
    );
    for (kl, causal, says) in [(2, true, "causal mask"), (3, false, "kl is 1 (Weibull) or 2 (Lognormal)")] {
        let err = probattn_sys::fused_linear_kl_terms(&q, &q, &a, &pad, &pad, causal, 1.0, kl, &rb, &dkl).err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        ensure!(err.contains(says), "KL {kl}, causal {causal}: {err:?}");
    }
    Ok(())
}

/// The GPU's compute capability when the route can run here.
fn gpu() -> Option<u32> {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return None;
    }
    match probattn_sys::fused_cuda_status(0) {
        Ok(Ok(device)) if probattn::fused_cuda::fits(device.arch) => Some(device.arch),
        other => {
            eprintln!("skipped: the fused CUDA route cannot run here: {other:?}");
            None
        }
    }
}

/// A plan for a case: softmax, DNAS, HNAS, Sinkhorn-N, or BAM over one of them, with its KL term
/// against the fixed per-key values `prior` or without one.
fn plan_for<'a>(case: &Case, logit: &'a Tensor, prior: &'a Tensor) -> Tiled<'a> {
    let mut plan = match case.sweeps {
        _ if case.hybrid => Tiled::hnas(logit),
        0 => Tiled::softmax(),
        1 => Tiled::dnas(),
        n => Tiled::sinkhorn(n as u32),
    };
    let (noise, kl) = case.noise_and_kl();
    if noise > 0 {
        let (kind, form) = if noise == 1 {
            (NoiseKind::Weibull, KlForm::WeibullGamma { k: 1.0 / NOISE_SCALE, beta: 1.5 })
        } else {
            (NoiseKind::Lognormal, KlForm::Lognormal { sigma: NOISE_SCALE, sigma_p: 1.3 })
        };
        let prior: PriorFn<'a> = Box::new(move |keys: &Tensor, _| Ok(prior.to_device(keys.device()).to_kind(keys.kind())));
        let kl = (kl > 0).then_some(Kl { form, prior });
        plan.sampling = Some(Sampling { noise: kind, scale: NOISE_SCALE, kl });
    }
    plan
}

/// The cases the GPU comparison runs: all, or those `FUSED_CUDA_CASES` lists by index
/// ("0,3,9"; the sanitizer's step runs a few, since memcheck and racecheck slow every launch).
fn gpu_cases() -> Result<Vec<&'static Case>> {
    let Ok(list) = std::env::var("FUSED_CUDA_CASES") else { return Ok(CASES.iter().collect()) };
    list.split(',')
        .map(|i| {
            let i: usize = i.trim().parse().with_context(|| format!("FUSED_CUDA_CASES: {i:?} is not an index"))?;
            CASES.get(i).with_context(|| format!("FUSED_CUDA_CASES: no case {i} (there are {})", CASES.len()))
        })
        .collect()
}

/// What a case's gradients are taken in: q, k, v, and HNAS's gate logits.
fn wrt<'a>(case: &Case, qkv: [&'a Tensor; 3], logit: &'a Tensor) -> Vec<&'a Tensor> {
    let mut all = qkv.to_vec();
    if case.hybrid {
        all.push(logit);
    }
    all
}

/// The reference for a case run on the GPU: the tiles in float64 on the CPU, on the same rounded
/// inputs, given the ε the kernels draw in float32 for this seed; the gradients of Σ output · g
/// (plus the KL) in what `wrt` names.
fn float64_reference(
    case: &Case,
    x: &Inputs,
    g: &Tensor,
    logit: &Tensor,
    prior: &Tensor,
) -> Result<(probattn::tiled::TiledAttended, Vec<Tensor>)> {
    let wide = |t: &Tensor| t.detach().to_device(Device::Cpu).to_kind(Kind::Double).set_requires_grad(true);
    let cpu = |t: &Tensor| t.to_device(Device::Cpu);
    let x64 = Inputs {
        q: wide(&x.q),
        k: wide(&x.k),
        v: wide(&x.v),
        kpad: cpu(&x.kpad),
        qpad: cpu(&x.qpad),
        excluded: cpu(&x.excluded),
        additive: cpu(&x.additive).to_kind(Kind::Double),
    };
    let (q64, k64, v64) = (&x64.q, &x64.k, &x64.v);
    let masks64 = case.masks(&x64);
    let plan64 = plan_for(case, logit, prior);
    let noise = case.noise_and_kl().0;
    let bam = if noise == 1 { BamKind::WeibullContextual } else { BamKind::LognormalContextual };
    let shape = case.shape;
    let dims = [shape[0], shape[1], shape[3], shape[4]];
    let eps = if noise > 0 { Some(counter_noise(bam, dims, SEED, (Kind::Float, Device::Cpu))?.to_kind(Kind::Double)) } else { None };
    let tiled_opts = TiledOptions {
        scale: Some(0.3),
        enable_gqa: true,
        fused_cpu: false,
        sample: noise > 0,
        noise: eps.as_ref(),
        ..TiledOptions::new(16)
    };
    let reference = attend_tiled(q64, k64, v64, &masks64, &plan64, tiled_opts)?;
    let g64 = g.to_device(Device::Cpu).to_kind(Kind::Double);
    let mut loss64 = (&reference.output * &g64).sum(Kind::Double);
    if let Some(kl) = &reference.kl {
        loss64 += kl;
    }
    let grads64 = Tensor::run_backward(&[loss64], &wrt(case, [q64, k64, v64], logit), false, false);
    Ok((reference, grads64))
}

#[test]
fn on_a_gpu_the_route_matches_the_float64_tiles_forward_and_backward() -> Result<()> {
    let Some(arch) = gpu() else { return Ok(()) };
    let _serial = common::serial();
    tch::manual_seed(7);
    let cuda = Device::Cuda(0);
    let logit = Tensor::from_slice(&[0.7f64, -1.2, 0.1, 2.0]);
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        // bfloat16 keeps 8 bits of mantissa, float16 11: the inputs' rounding bounds the agreement.
        // float32 runs with TF32 products (11 bits), which round inside the kernels what the
        // reference takes unrounded.
        let tolerance = match kind {
            Kind::BFloat16 => 3e-2,
            Kind::Half => 4e-3,
            _ => 1e-2,
        };
        let region = (kind == Kind::Float).then(|| probattn::precision::Precision::Tf32.enter(cuda)).transpose()?;
        for case in gpu_cases()?.into_iter().filter(|c| kind != Kind::Float || in_float32_set(c)) {
            let (shape, kl_form) = (case.shape, case.noise_and_kl().1);
            let x = inputs(shape, kind, cuda);
            let g = Tensor::randn([shape[0], shape[1], shape[3], shape[6]], (Kind::Float, cuda));
            let prior = Tensor::rand([shape[0], shape[1], 1, shape[4]], (Kind::Double, Device::Cpu)) + 0.5;
            let head_logit = logit.narrow(0, 0, shape[1]).copy().set_requires_grad(true);
            let masks = case.masks(&x);
            let (gpu_logit, gpu_prior) = (head_logit.detach().to_device(cuda).set_requires_grad(true), prior.to_device(cuda));
            let plan = plan_for(case, &gpu_logit, &gpu_prior);
            let opts = AttendOptions {
                scale: Some(0.3),
                enable_gqa: true,
                seed: Some(SEED),
                mode: Mode::train(true),
                need_mass: case.mass,
                ..Default::default()
            };
            let (q, k, v) = (x.q.set_requires_grad(true), x.k.set_requires_grad(true), x.v.set_requires_grad(true));
            let score_shape = probattn::ScoreShape { batch: shape[0], heads: shape[1], queries: shape[3], keys: shape[4] };
            let probattn::fused_cuda::FusedAttended { output: out, kl, received_mass: mass } =
                probattn::fused_cuda::attend(score_shape, &q, &k, &v, &masks, &plan, &opts)?;
            assert_eq!(out.kind(), kind);
            let mut loss = (&out.to_kind(Kind::Float) * &g).sum(Kind::Float);
            if let Some(kl) = &kl {
                loss += kl.to_kind(Kind::Float);
            }
            let grads = Tensor::run_backward(&[loss], &wrt(case, [&q, &k, &v], &gpu_logit), false, false);

            // x.q, x.k and x.v are q, k and v (set_requires_grad marks the tensor itself).
            let (reference, grads64) = float64_reference(case, &x, &g, &head_logit, &prior)?;
            let at = format!("sm_{arch}, {kind:?}, {case:?}");
            let error = common::scaled_error(&out, &reference.output)?;
            assert!(error < tolerance, "{at}: output off by {error:e}");
            assert_eq!(kl.is_some(), kl_form > 0, "{at}: a KL term exactly when sampling with one");
            if let (Some(ours), Some(theirs)) = (&kl, &reference.kl) {
                let error = common::scaled_error(ours, theirs)?;
                assert!(error < tolerance, "{at}: KL off by {error:e}");
            }
            assert_eq!(mass.is_some(), case.mass, "{at}: the received mass exactly when asked for");
            if let Some(mass) = &mass {
                assert_eq!(mass.kind(), Kind::Float, "{at}: the mass in float32");
                let error = common::scaled_error(mass, &reference.received_mass)?;
                assert!(error < tolerance, "{at}: received mass off by {error:e}");
            }
            for (name, (ours, theirs)) in ["dq", "dk", "dv", "dlogit"].iter().zip(grads.iter().zip(&grads64)) {
                let error = common::scaled_error(ours, theirs)?;
                assert!(error < tolerance * 4.0, "{at}: {name} off by {error:e}");
            }
            eprintln!("{at}: within {tolerance:e}");
        }
        drop(region);
    }
    Ok(())
}

#[test]
fn on_a_gpu_the_fused_backend_takes_the_route_and_says_why_where_it_cannot() -> Result<()> {
    if gpu().is_none() {
        return Ok(());
    }
    let _serial = common::serial();
    let cuda = Device::Cuda(0);
    let Inputs { q, k, v, kpad, .. } = inputs([2, 2, 2, 40, 40, 64, 64], Kind::BFloat16, cuda);
    let masks = Masks { key_padding: Some(&kpad), ..Default::default() };
    let forced = AttendOptions { need_weights: false, backend: Backend::Fused, ..Default::default() };
    let (_, choice) = attend_with_choice(&q, &k, &v, &masks, &Dnas, forced)?;
    assert_eq!(choice.route, Route::FusedCuda, "{choice:?}");
    // auto takes it for a memory-efficient call (a tile, no weights), after softmax's own kernel,
    // and leaves the tiles a call it does not serve (float64).
    let tiled = AttendOptions { need_weights: false, tile: Some(16), ..Default::default() };
    let (_, choice) = attend_with_choice(&q, &k, &v, &masks, &Dnas, tiled)?;
    assert_eq!(choice.route, Route::FusedCuda, "{choice:?}");
    let (_, choice) = attend_with_choice(&q, &k, &v, &Masks::default(), &Softmax, tiled)?;
    assert_eq!(choice.route, Route::Kernel, "{choice:?}");
    let wide = [&q, &k, &v].map(|t| t.to_kind(Kind::Double));
    let (_, choice) = attend_with_choice(&wide[0], &wide[1], &wide[2], &masks, &Dnas, tiled)?;
    assert_eq!(choice.route, Route::Tiles, "{choice:?}");
    // float32 is served with TF32 allowed; without, forced, it is a named error with the reason.
    let (q32, k32, v32) = (q.to_kind(Kind::Float), k.to_kind(Kind::Float), v.to_kind(Kind::Float));
    let before = probattn_sys::set_allow_tf32(false)?;
    let err = attend_with_choice(&q32, &k32, &v32, &masks, &Dnas, forced).err().map(|e| e.to_string()).unwrap_or_default();
    let tf32 = probattn::precision::Precision::Tf32.run(cuda, || attend_with_choice(&q32, &k32, &v32, &masks, &Dnas, forced))?;
    probattn_sys::set_allow_tf32(before)?;
    assert!(err.contains("TF32"), "{err}");
    let (out32, choice) = tf32?;
    assert_eq!((choice.route, out32.output.kind()), (Route::FusedCuda, Kind::Float), "{choice:?}");
    // The received mass comes back when asked for, of BAM's sampled weights too, on the route.
    let (out, choice) = attend_with_choice(&q, &k, &v, &masks, &Dnas, AttendOptions { need_mass: true, ..forced })?;
    assert_eq!(choice.route, Route::FusedCuda, "{choice:?}");
    assert!(out.received_mass.is_some());
    let (logit, prior) = (Tensor::zeros([2], (Kind::Float, cuda)), Tensor::ones([2, 2, 1, 40], (Kind::Float, cuda)));
    let bam = plan_for(&case([2, 2, 2, 40, 40, 64, 64], 1, false, KEYS, 1, false), &logit, &prior);
    let shape = probattn::ScoreShape { batch: 2, heads: 2, queries: 40, keys: 40 };
    let sampled = AttendOptions { mode: Mode::train(true), need_mass: true, seed: Some(SEED), ..Default::default() };
    assert_eq!(probattn::fused_cuda::unserved(shape, &q, &v, &masks, &bam, &sampled), None);
    let drawn = probattn::fused_cuda::attend(shape, &q, &k, &v, &masks, &bam, &sampled)?;
    assert!(drawn.received_mass.is_some() && drawn.kl.is_some());
    Ok(())
}
