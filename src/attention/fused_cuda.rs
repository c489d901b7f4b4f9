//! The fused CUDA route: a plan run by the Triton kernels of python/probattn_tools/kernels/
//! (docs/kernels.md), compiled ahead of time for sm_80 and sm_90 and embedded by the
//! `probattn-kernels` crate, launched on libtorch's current stream through the CUDA driver API
//! (probattn-sys/csrc/fused_cuda.cpp). One (query block × key block) tile stays on chip with
//! online log-sum-exps; only O(S) statistics reach global memory, forward and backward.
//!
//! What it serves ([`unserved`] says why not, for the backend record): bfloat16 and float16 on a
//! GPU the embedded cubins fit, and float32 while libtorch allows TF32 in float32 products
//! ([`Precision::Tf32`](crate::precision::Precision::Tf32); the deterministic plans only);
//! softmax, DNAS, HNAS (both branches from one row pass) and Sinkhorn-N for any N, with any score
//! scale; key and query padding, causal (softmax), a boolean pattern and an additive mask that
//! needs no gradient; grouped key/value heads; head dimensions up to 256 (128 in float32); no
//! attention dropout; and BAM's sampling over every one of those bases (without a pattern or
//! additive mask), Weibull and Lognormal, with its KL term or without, its noise drawn in the
//! kernels from the same counter-based hash as the tiles' (the same ε for the same seed), on both
//! sides of 2^32 score entries, for up to 2^24 keys. It returns no
//! weights, and the received mass when the call asks for it ([`AttendOptions::need_mass`]: one
//! more key pass per branch; for BAM, of the sampled weights, its draws made again). Anything
//! else runs on the tiles.

use tch::{Device, Kind, Tensor};

use crate::call::AttendOptions;
use crate::cxx;
use crate::mask::{Masks, ScoreShape};
use crate::plan::Tiled;
use crate::precision::statistics_kind;
use crate::tiled::{check_hybrid_logit, libtorch_seed, tiled_kl, MaskCounts};
use crate::{Error, Result};

/// Whether `auto` takes this route where it serves a memory-efficient call (a tile set, no
/// weights asked for) that the normalizer's own kernel does not (`false`: only when forced,
/// `--attention-backend fused`). The CUDA tests (`tests/fused_cuda.rs`) and compute-sanitizer
/// passed on an H200, where the route also ran each deterministic plan and BAM-WC 3.5-21× faster
/// than the tiles had on the same kind of GPU (results/cuda/2026-11-29/).
pub const AUTO_TAKES_IT: bool = true;

/// Why the route does not serve this call (`None`: it does).
pub fn unserved(shape: ScoreShape, q: &Tensor, v: &Tensor, masks: &Masks, plan: &Tiled, opts: &AttendOptions) -> Option<String> {
    let Device::Cuda(index) = q.device() else {
        return Some("it runs on CUDA devices".into());
    };
    let sampling = plan.sampling.as_ref().filter(|_| opts.mode.sample);
    // As the manifest names the embedded sets' dtypes.
    let dtype = match q.kind() {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Float if !cxx::allow_tf32().unwrap_or(false) => {
            return Some(
                "float32 takes it with TF32 products only, and libtorch's switch for them is off \
                 (Precision::Tf32, torch.backends.cuda.matmul.allow_tf32)"
                    .into(),
            )
        }
        Kind::Float if sampling.is_some() => return Some(format!("{}: BAM's sampling in float32 is not in the embedded set", plan.name)),
        Kind::Float => "float32",
        other => return Some(format!("it takes bfloat16, float16 and float32 (with TF32), not {other:?}")),
    };
    if sampling.is_some() {
        let why = if opts.noise.is_some() {
            Some("given draws are not in the embedded set (the kernels draw from a seed)")
        } else if shape.dims()[3] > 1 << 24 {
            Some("BAM's kernels draw for at most 2^24 keys (a tile's positions span two of the hash's high words at most)")
        } else {
            None
        };
        if let Some(why) = why {
            return Some(format!("{}: {why}", plan.name));
        }
    }
    if opts.dropout_active() {
        return Some("attention dropout forms the weights".into());
    }
    if masks.bias.is_some_and(Tensor::requires_grad) {
        return Some("an additive mask that needs its gradient (the kernels compute none)".into());
    }
    let patterned = masks.attn_mask.is_some() || masks.bias.is_some();
    if patterned && plan.sampling.is_some() && opts.mode.sample {
        return Some(format!("{}: BAM under a boolean or additive mask is not in the embedded set", plan.name));
    }
    let widest = q.size()[3].max(v.size()[3]);
    let [b, h, sq, sk] = shape.dims();
    if [b * h * sq * widest, b * v.size()[1] * sk * widest].iter().any(|&n| n > i64::from(i32::MAX)) {
        return Some("the kernels index with 32-bit integers and the tensors are larger".into());
    }
    if let Some(why) = cxx::kernels::missing() {
        return Some(format!("this build embeds no kernel ({why})"));
    }
    match cxx::kernels::kernels().iter().filter(|k| k.dtype == dtype).map(|k| k.head_dim).max() {
        None => return Some(format!("this build embeds no {dtype} kernel")),
        Some(embedded) if widest > embedded => {
            return Some(format!("head dimension {widest} is wider than the embedded {dtype} kernels' {embedded}"))
        }
        Some(_) => {}
    }
    let device = match device_status(index as i64) {
        Err(why) => return Some(why),
        Ok(device) => device,
    };
    if !fits(device.arch) {
        return Some(format!("no embedded kernel runs on sm_{} (embedded: {})", device.arch, embedded_archs()));
    }
    too_little_shared_memory(device, dtype, widest)
}

/// Why the cubins a call of `dtype` and head dimension `widest` takes on `device` cannot load
/// there (`None`: they can): a cubin for sm_80 also serves sm_86 and sm_89, which allow a block
/// less shared memory than the build checked against (float32 at head dimension 128 needs more).
/// The launcher picks the same cubins: the newest embedded architecture of the device's major
/// version not newer than it, the smallest embedded head dimension that holds d and d_v.
fn too_little_shared_memory(device: cxx::CudaDevice, dtype: &str, widest: i64) -> Option<String> {
    let kernels = cxx::kernels::kernels();
    let arch = embedded_arch(device.arch)?;
    let ours = |k: &&cxx::kernels::Kernel| k.arch_number() == arch && k.dtype == dtype;
    let head_dim = kernels.iter().filter(ours).map(|k| k.head_dim).filter(|&d| d >= widest).min()?;
    let needed = kernels.iter().filter(ours).filter(|k| k.head_dim == head_dim).map(|k| k.shared_bytes).max()?;
    (needed > device.shared_optin).then(|| {
        format!(
            "the sm_{arch} {dtype} cubins for head dimension {head_dim} need up to {needed} bytes of shared memory per block; \
             this GPU (sm_{}) allows {}",
            device.arch, device.shared_optin
        )
    })
}

/// The driver's answer for CUDA device `index` (its compute capability and shared memory, or why
/// it cannot launch), asked once per device and process: every call's route choice reads it.
fn device_status(index: i64) -> std::result::Result<cxx::CudaDevice, String> {
    type Status = std::result::Result<cxx::CudaDevice, String>;
    static SEEN: std::sync::Mutex<Vec<(i64, Status)>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, status)) = seen.iter().find(|(i, _)| *i == index) {
        return status.clone();
    }
    let status = cxx::fused_cuda_status(index).map_err(|e| e.to_string()).and_then(|s| s);
    seen.push((index, status.clone()));
    status
}

/// Whether an embedded cubin runs on compute capability `arch`: one of the same major version,
/// not newer.
pub fn fits(arch: u32) -> bool {
    embedded_arch(arch).is_some()
}

/// The embedded architecture whose cubins the launcher takes on compute capability `arch`: the
/// newest of the same major version not newer than it.
fn embedded_arch(arch: u32) -> Option<u32> {
    cxx::kernels::kernels().iter().map(|k| k.arch_number()).filter(|&a| a / 10 == arch / 10 && a <= arch).max()
}

/// The embedded architectures, `sm_80, sm_90`.
pub fn embedded_archs() -> String {
    let archs: Vec<String> = cxx::kernels::architectures().into_iter().map(|(a, _)| a).collect();
    if archs.is_empty() {
        "none".into()
    } else {
        archs.join(", ")
    }
}

/// What the route returns: the output `(B, H, S_q, d_v)`; when sampling with a KL term, BAM's KL
/// (a scalar, as the tiles' and the eager path's); with [`AttendOptions::need_mass`], the received
/// mass `(B, H, S_k)` in float32 (without a gradient; for BAM, of the sampled weights).
pub struct FusedAttended {
    pub output: Tensor,
    pub kl: Option<Tensor>,
    pub received_mass: Option<Tensor>,
}

/// Runs a call [`unserved`] accepted ([`FusedAttended`]), differentiable in q, k, v (and HNAS's
/// gate logits, and the prior's network).
pub fn attend(
    shape: ScoreShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    plan: &Tiled,
    opts: &AttendOptions,
) -> Result<FusedAttended> {
    // Every mask checked against the call's shape and dtype as on the other routes; combined into
    // one boolean tensor only where the KL term's counts need it (the kernels read each mask
    // themselves, and a causal mask combined is S_q × S_k).
    let sampling = plan.sampling.as_ref().filter(|_| opts.mode.sample);
    let allowed = if sampling.is_some_and(|s| s.kl.is_some()) {
        masks.allowed(shape, q.device())?
    } else {
        masks.check(shape)?;
        None
    };
    check_hybrid_logit(plan, shape)?;
    // The kernels read a pattern as SDPA does, true = takes part; the library's is true = excluded.
    let pattern = masks.attn_mask.map(|m| m.ne(0).logical_not());
    let d = q.size()[3] as f64;
    let spec = cxx::FusedSpec {
        scale: plan.score_scale * opts.scale.unwrap_or(1.0 / d.sqrt()),
        sweeps: i64::from(plan.sweeps),
        key_padding: masks.key_padding,
        query_padding: masks.query_padding,
        pattern: pattern.as_ref(),
        bias: masks.bias,
        causal: masks.causal,
        mass: opts.need_mass,
        // HNAS: the route mixes the branches with the gate itself (under BAM's noise, in its
        // kernels), and the gate's gradient follows.
        hybrid: plan.hybrid_logit.is_some(),
        hybrid_logit: plan.hybrid_logit,
        ..Default::default()
    };
    let run = |spec: &cxx::FusedSpec| cxx::fused_cuda_attention(q, k, v, spec).map_err(Error::from);
    let Some(sampling) = sampling else {
        let fused = run(&spec)?;
        return Ok(FusedAttended { output: fused.out, kl: None, received_mass: fused.mass.map(|m| m.squeeze_dim(0)) });
    };
    // The draws from the seed in the kernels; over HNAS the kernels mix the bases themselves.
    let seed = opts.seed.unwrap_or_else(libtorch_seed);
    let spec = cxx::FusedSpec { noise: sampling.noise.code(), noise_scale: sampling.scale, seed, ..spec };
    let Some(kl) = sampling.kl.as_ref() else {
        let fused = run(&spec)?;
        return Ok(FusedAttended { output: fused.out, kl: None, received_mass: fused.mass.map(|m| m.squeeze_dim(0)) });
    };
    let stats = statistics_kind(q.kind());
    let prior = (kl.prior)(k, allowed.as_ref())?;
    let fused = run(&cxx::FusedSpec { kl: kl.form.code(), prior: Some(&prior), ..spec })?;
    let counts = MaskCounts::new(allowed.as_ref(), shape, crate::backend::DEFAULT_TILE, stats, q.device());
    let kl = tiled_kl(kl.form, &fused.kl_part, &prior, &counts);
    Ok(FusedAttended { output: fused.out, kl: Some(kl), received_mass: fused.mass.map(|m| m.squeeze_dim(0)) })
}

/// What this build embeds and whether the first CUDA device can run it (`probattn doctor`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Availability {
    /// Kernels per architecture, `{"sm_80": 80, "sm_90": 80}`.
    pub embedded: std::collections::BTreeMap<String, usize>,
    /// The embedded sets by dtype and head dimension, `["bfloat16 d 64", ..., "float32 d 128"]`:
    /// a call takes the narrowest that holds its d and d_v (the same on every architecture).
    pub sets: Vec<String>,
    /// The Triton version that compiled them.
    pub triton: String,
    /// Why the build embedded none.
    pub missing: Option<String>,
    /// The first CUDA device's compute capability (90 for sm_90), when the driver reports one.
    pub gpu: Option<u32>,
    /// Whether an embedded kernel runs on that device.
    pub gpu_matches: bool,
    /// The shared memory one block may opt into on that device, in bytes.
    pub gpu_shared_optin: Option<u32>,
    /// The embedded sets (`"float32 d 128"`) whose cubins need more shared memory a block than
    /// that device allows: calls that would take them run on the tiles there.
    pub too_large_here: Vec<String>,
    /// Why the route cannot run here, when it cannot.
    pub why_not: Option<String>,
    /// [`AUTO_TAKES_IT`].
    pub auto: bool,
}

/// [`Availability`] of this build on this machine; `cuda`: whether libtorch sees a CUDA device
/// (the driver is not asked otherwise).
pub fn availability(cuda: bool) -> Availability {
    let embedded = cxx::kernels::architectures().into_iter().collect();
    let missing = cxx::kernels::missing().map(String::from);
    let (device, why_not) = if !cuda {
        (None, Some("libtorch sees no CUDA device".to_string()))
    } else {
        match device_status(0) {
            Ok(device) => (Some(device), None),
            Err(why) => (None, Some(why)),
        }
    };
    let gpu = device.map(|d| d.arch);
    let gpu_matches = gpu.is_some_and(fits);
    let too_large_here = device.filter(|_| gpu_matches).map(too_large_sets).unwrap_or_default();
    let why_not = why_not
        .or_else(|| missing.as_ref().map(|m| format!("this build embeds no kernel ({m})")))
        .or_else(|| (!gpu_matches).then(|| format!("no embedded kernel runs on sm_{} (embedded: {})", gpu.unwrap_or(0), embedded_archs())));
    Availability {
        embedded,
        sets: embedded_sets().into_iter().map(|(dtype, head_dim)| format!("{dtype} d {head_dim}")).collect(),
        triton: cxx::kernels::triton_version().to_string(),
        missing,
        gpu,
        gpu_matches,
        gpu_shared_optin: device.map(|d| d.shared_optin),
        too_large_here,
        why_not,
        auto: AUTO_TAKES_IT,
    }
}

/// The embedded (dtype, head dimension) sets, in the manifest's dtype names.
fn embedded_sets() -> Vec<(String, i64)> {
    let mut sets: Vec<(String, i64)> = cxx::kernels::kernels().iter().map(|k| (k.dtype.clone(), k.head_dim)).collect();
    sets.sort();
    sets.dedup();
    sets
}

/// The embedded (dtype, head dimension) sets, as `"float32 d 128"`, that [`too_little_shared_memory`]
/// refuses on `device`.
fn too_large_sets(device: cxx::CudaDevice) -> Vec<String> {
    embedded_sets()
        .into_iter()
        .filter(|(dtype, head_dim)| too_little_shared_memory(device, dtype, *head_dim).is_some())
        .map(|(dtype, head_dim)| format!("{dtype} d {head_dim}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_with_less_shared_memory_than_the_cubins_need_is_refused_by_name() {
        if !embedded_archs().contains("sm_80") {
            eprintln!("no sm_80 cubins embedded ({}): nothing to check", embedded_archs());
            return;
        }
        let device = |arch, kib: u32| cxx::CudaDevice { arch, shared_optin: kib << 10 };
        // sm_86 and sm_89 take sm_80's cubins with 99 KiB a block: the 16-bit ones fit up to head
        // dimension 128, not at 256 (138 KiB), and float32's at head dimension 128 do not (120 KiB).
        for dtype in ["bfloat16", "float16"] {
            for widest in [32, 64, 100, 128] {
                assert_eq!(too_little_shared_memory(device(86, 99), dtype, widest), None, "{dtype}, {widest}");
            }
            let why = too_little_shared_memory(device(89, 99), dtype, 200).unwrap_or_default();
            assert!(why.contains(&format!("sm_80 {dtype} cubins for head dimension 256")), "{why}");
        }
        assert_eq!(too_little_shared_memory(device(89, 99), "float32", 64), None);
        let why = too_little_shared_memory(device(86, 99), "float32", 128).unwrap_or_default();
        assert!(why.contains("sm_80 float32 cubins for head dimension 128") && why.contains("(sm_86) allows 101376"), "{why}");
        // sm_80 and sm_90 allow what the build checked against.
        assert_eq!(too_little_shared_memory(device(80, 163), "float32", 128), None);
        assert_eq!(too_little_shared_memory(device(90, 227), "float32", 128), None);
        assert_eq!(too_little_shared_memory(device(80, 163), "bfloat16", 256), None);
        // What doctor lists for such a device.
        assert_eq!(too_large_sets(device(86, 99)), ["bfloat16 d 256", "float16 d 256", "float32 d 128"]);
        assert!(too_large_sets(device(90, 227)).is_empty());
    }
}
