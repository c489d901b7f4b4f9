//! The memory-efficient attention's entry points in csrc/ (tiled.cpp, fused_cpu.cpp, noise.cpp):
//! the tile loop and the fused CPU kernel behind one call, the widened bfloat16 softmax, and the
//! counter-based BAM draws.

use std::ffi::c_char;
use std::ptr;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::{check, Error, Result};

extern "C" {
    fn pa_tiled_attention(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        excluded: *const C_tensor,
        bias: *const C_tensor,
        noise: *const C_tensor,
        prior: *const C_tensor,
        hybrid_logit: *const C_tensor,
        spec: *const TiledSpec,
        out: *mut *mut C_tensor,
        received_mass: *mut *mut C_tensor,
        kl_part: *mut *mut C_tensor,
        route_taken: *mut i32,
    ) -> *mut c_char;
    fn pa_widened_softmax(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        allowed: *const C_tensor,
        scale: f64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn pa_widened_matmul(a: *const C_tensor, b: *const C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
    fn pa_counter_noise(
        like: *const C_tensor,
        shape: *const i64,
        noise: i32,
        seed: u64,
        start: i64,
        len: i64,
        aten_ops: i32,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
}

/// `pa_tiled_spec` of csrc/probattn.h: what the tiled attention computes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TiledSpec {
    /// Queries per tile.
    pub tile: i64,
    /// Column/row normalizations before the last row softmax: 0 softmax, 1 DNAS, N Sinkhorn-N.
    pub sweeps: i64,
    /// BAM's noise: 0 none, 1 Weibull, 2 Lognormal ([`TiledSpec::WEIBULL`], [`TiledSpec::LOGNORMAL`]).
    pub noise: i32,
    /// `1/k` (Weibull) or `σ` (Lognormal).
    pub noise_scale: f64,
    /// The key of the counter-based draws, when no noise tensor is given.
    pub seed: u64,
    /// The KL's score-dependent part: 0 none, 1 `Σ a_j log π_ij`, 2 `Σ (log π_ij − a_j)²`.
    pub kl: i32,
    /// 1: softmax and DNAS without noise take libtorch's fused CPU kernel where it applies; 0:
    /// always the tiles; 2: the fused kernel or an error ([`TiledSpec::FUSED_WHERE_APPLIES`], ...).
    pub fused_cpu: i32,
}

// The layout of `pa_tiled_spec`, which csrc/probattn.h asserts too: a field added or moved on one
// side only fails the build instead of reading the wrong bytes.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<TiledSpec>() == 48);
    assert!(offset_of!(TiledSpec, tile) == 0 && offset_of!(TiledSpec, sweeps) == 8 && offset_of!(TiledSpec, noise) == 16);
    assert!(offset_of!(TiledSpec, noise_scale) == 24 && offset_of!(TiledSpec, seed) == 32);
    assert!(offset_of!(TiledSpec, kl) == 40 && offset_of!(TiledSpec, fused_cpu) == 44);
};

impl TiledSpec {
    pub const WEIBULL: i32 = 1;
    pub const LOGNORMAL: i32 = 2;
    pub const KL_WEIBULL: i32 = 1;
    pub const KL_LOGNORMAL: i32 = 2;
    pub const FUSED_NEVER: i32 = 0;
    pub const FUSED_WHERE_APPLIES: i32 = 1;
    pub const FUSED_REQUIRED: i32 = 2;
}

/// The route [`tiled_attention`] took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TiledRoute {
    /// The tile loop.
    Tiles,
    /// libtorch's fused CPU kernel (softmax, DNAS, Sinkhorn-N).
    FusedCpu,
    /// The fused CPU kernel's BAM form (sampling over a softmax base).
    FusedCpuBam,
}

/// What [`tiled_attention`] returns.
#[derive(Debug)]
pub struct TiledOutput {
    /// `(B, H, S_q, d_v)`, differentiable in q, k, v and `prior`.
    pub output: Tensor,
    /// `(B, H, S_k)`: the weight each key received.
    pub received_mass: Tensor,
    /// `(B, H)`: the KL's score-dependent part (zeros without a KL term).
    pub kl_part: Tensor,
    /// The route that ran (csrc/tiled.h's `tiled_route`, the one place that decides).
    pub route: TiledRoute,
}

/// The tiled attention of csrc/tiled.cpp, through the fused CPU kernel where `spec.fused_cpu`
/// allows it and it applies. (Its arguments are those of `pa_tiled_attention`, one for one;
/// `hybrid_logit`: HNAS's gate logits, mixing DNAS's and softmax's weights as the base of BAM's
/// sampling, on the tiles only.)
#[allow(clippy::too_many_arguments)]
pub fn tiled_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    excluded: Option<&Tensor>,
    bias: Option<&Tensor>,
    noise: Option<&Tensor>,
    prior: Option<&Tensor>,
    hybrid_logit: Option<&Tensor>,
    spec: &TiledSpec,
) -> Result<TiledOutput> {
    let (mut out, mut mass, mut kl, mut route) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut(), -1);
    let optional = |t: Option<&Tensor>| t.map_or(ptr::null(), |t| t.as_ptr());
    // SAFETY: the tensor pointers and `spec` borrow live values for the call; the three outputs
    // are new tensors written on success only, owned by `Tensor::from_ptr` from then on.
    unsafe {
        let status = pa_tiled_attention(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            optional(excluded),
            optional(bias),
            optional(noise),
            optional(prior),
            optional(hybrid_logit),
            spec,
            &mut out,
            &mut mass,
            &mut kl,
            &mut route,
        );
        check(status, Error::Torch)?;
        if out.is_null() && spec.fused_cpu == TiledSpec::FUSED_REQUIRED {
            return Err(Error::NotServed(
                "the fused CPU kernel does not serve this call: it takes softmax, DNAS and Sinkhorn-N without sampling, and BAM \
                 sampling over a softmax base in float32 or float64, on the CPU, with d_v = d and no mask or a key padding mask \
                 that leaves every batch entry a key"
                    .into(),
            ));
        }
        let route = match route {
            1 => TiledRoute::FusedCpu,
            2 => TiledRoute::FusedCpuBam,
            _ => TiledRoute::Tiles,
        };
        Ok(TiledOutput { output: Tensor::from_ptr(out), received_mass: Tensor::from_ptr(mass), kl_part: Tensor::from_ptr(kl), route })
    }
}

/// Softmax attention of bfloat16 or float16 `q`, `k`, `v` `(B, H, S, d)` computed in float32,
/// differentiable, keeping the inputs rather than float32 copies of them for the backward pass
/// (csrc/fused_cpu.cpp). `allowed`: bool, broadcastable to the scores, true = taking part; a query
/// with no allowed key gets zeros. The output has `v`'s dtype.
pub fn widened_softmax(q: &Tensor, k: &Tensor, v: &Tensor, allowed: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let mut out = ptr::null_mut();
    // SAFETY: the tensor pointers borrow live values for the call; the output is a new tensor
    // written on success only, owned by `Tensor::from_ptr` from then on.
    unsafe {
        let allowed = allowed.map_or(ptr::null(), |t| t.as_ptr());
        check(pa_widened_softmax(q.as_ptr(), k.as_ptr(), v.as_ptr(), allowed, scale, &mut out), Error::Torch)?;
        Ok(Tensor::from_ptr(out))
    }
}

/// `a · b` (matmul's broadcasting) with `a` in bfloat16 or float16 widened to `b`'s dtype,
/// differentiable in both, keeping `a` rather than its widened copy (twice its size in float32)
/// for the backward pass (csrc/fused_cpu.cpp). The output has `b`'s dtype.
pub fn widened_matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let mut out = ptr::null_mut();
    // SAFETY: the tensor pointers borrow live values for the call; the output is a new tensor
    // written on success only, owned by `Tensor::from_ptr` from then on.
    unsafe {
        check(pa_widened_matmul(a.as_ptr(), b.as_ptr(), &mut out), Error::Torch)?;
        Ok(Tensor::from_ptr(out))
    }
}

/// The tiled path's counter-based draws for a whole `(B, H, S_q, S_k)` score tensor, in the dtype
/// and on the device of `like` (see csrc/noise.cpp), the rows (queries) in `rows`; `aten_ops`: by
/// ATen's integer ops (CUDA's way) even on the CPU.
pub fn counter_noise(like: &Tensor, shape: [i64; 4], noise: i32, seed: u64, rows: std::ops::Range<i64>, aten_ops: bool) -> Result<Tensor> {
    let mut out = ptr::null_mut();
    // SAFETY: `like` and `shape` (four values) are borrowed for the call; the output is a new
    // tensor written on success only.
    unsafe {
        let len = rows.end - rows.start;
        check(pa_counter_noise(like.as_ptr(), shape.as_ptr(), noise, seed, rows.start, len, aten_ops as i32, &mut out), Error::Torch)?;
        Ok(Tensor::from_ptr(out))
    }
}
