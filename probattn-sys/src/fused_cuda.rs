//! The fused CUDA route's entry points: the embedded kernels (probattn-kernels) registered with
//! the launcher once and the driver's status for a device (csrc/fused_launch.cpp), and the
//! attention call itself (csrc/fused_cuda.cpp).

use std::ffi::{c_char, CString};
use std::ptr;
use std::sync::OnceLock;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::{check, take_string, Error, Result};

extern "C" {
    fn pa_fused_register(
        kernel: *const c_char,
        arch: i32,
        dtype: *const c_char,
        head_dim: i64,
        key: *const c_char,
        params: *const c_char,
        num_warps: u32,
        shared_bytes: u32,
        block_m: i64,
        block_n: i64,
        symbol: *const c_char,
        cubin: *const u8,
        cubin_len: usize,
    ) -> *mut c_char;
    fn pa_fused_cuda_status(device_index: i64, arch: *mut i32, shared_optin: *mut i32, why: *mut *mut c_char) -> *mut c_char;
    fn pa_fused_cuda_dry_run(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        key_padding: *const C_tensor,
        query_padding: *const C_tensor,
        pattern: *const C_tensor,
        bias: *const C_tensor,
        prior: *const C_tensor,
        hybrid_logit: *const C_tensor,
        spec: *const CSpec,
        arch: i32,
        json: *mut *mut c_char,
    ) -> *mut c_char;
    fn pa_fused_linear_kl_terms(
        q: *const C_tensor,
        k: *const C_tensor,
        prior: *const C_tensor,
        query_padding: *const C_tensor,
        key_padding: *const C_tensor,
        causal: i32,
        scale: f64,
        kl: i32,
        rb: *const C_tensor,
        dkl: *const C_tensor,
        terms: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn pa_fused_cuda_attention(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        key_padding: *const C_tensor,
        query_padding: *const C_tensor,
        pattern: *const C_tensor,
        bias: *const C_tensor,
        prior: *const C_tensor,
        hybrid_logit: *const C_tensor,
        spec: *const CSpec,
        out: *mut *mut C_tensor,
        kl_part: *mut *mut C_tensor,
        mass: *mut *mut C_tensor,
    ) -> *mut c_char;
}

fn c_string(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Config(format!("{s:?}: a name with a NUL byte")))
}

/// Hands every embedded kernel to the launcher, once per process; the same result after.
fn registered() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for k in probattn_kernels::kernels() {
            let key = k.key.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>().join(",");
            // "name:type", with "/16" where the cubin assumes a multiple of 16 (the launcher checks it).
            let params = k
                .params
                .iter()
                .map(|p| if p.divisible > 1 { format!("{}:{}/{}", p.name, p.ty, p.divisible) } else { format!("{}:{}", p.name, p.ty) })
                .collect::<Vec<_>>()
                .join(",");
            let strings = [k.kernel.as_str(), k.dtype.as_str(), &key, &params, k.symbol.as_str()].map(c_string);
            let [Ok(kernel), Ok(dtype), Ok(key), Ok(params), Ok(symbol)] = strings else {
                return Err(format!("{}: a manifest entry with a NUL byte", k.file));
            };
            let cubin = k.cubin();
            // SAFETY: every pointer is to a live C string or to the unpacked cubin, which is
            // 'static (the launcher keeps that pointer, and only that one).
            let status = unsafe {
                pa_fused_register(
                    kernel.as_ptr(),
                    k.arch_number() as i32,
                    dtype.as_ptr(),
                    k.head_dim,
                    key.as_ptr(),
                    params.as_ptr(),
                    k.num_warps,
                    k.shared_bytes,
                    k.block_m,
                    k.block_n,
                    symbol.as_ptr(),
                    cubin.as_ptr(),
                    cubin.len(),
                )
            };
            check(status, Error::Torch).map_err(|e| e.to_string())?;
        }
        Ok(())
    })
    .clone()
    .map_err(Error::Torch)
}

/// What the driver says of a CUDA device the embedded kernels may launch on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    /// The compute capability: 90 for sm_90.
    pub arch: u32,
    /// The shared memory one block may opt into, in bytes (227 KiB on sm_90, 163 KiB on sm_80,
    /// 99 KiB on sm_86 and sm_89).
    pub shared_optin: u32,
}

/// Whether the driver can launch the embedded kernels on CUDA device `index`: `Ok(Ok(device))`
/// with its compute capability and shared memory, `Ok(Err(why))` when the driver library is
/// missing or sees no GPU.
pub fn fused_cuda_status(index: i64) -> Result<std::result::Result<CudaDevice, String>> {
    let (mut arch, mut shared_optin, mut why) = (0i32, 0i32, ptr::null_mut());
    // SAFETY: the outputs are live locals; `why` is a new string or NULL, taken once.
    let status = unsafe { pa_fused_cuda_status(index, &mut arch, &mut shared_optin, &mut why) };
    check(status, Error::Device)?;
    Ok(match take_string(why) {
        Some(why) => Err(why),
        None => Ok(CudaDevice { arch: arch.max(0) as u32, shared_optin: shared_optin.max(0) as u32 }),
    })
}

/// What a fused call computes besides its inputs: the plan's sweeps and mask, and BAM's sampling.
#[derive(Clone, Copy, Debug, Default)]
pub struct FusedSpec<'a> {
    /// The factor of `q·kᵀ`.
    pub scale: f64,
    /// 0 softmax, 1 DNAS, N ≥ 2 Sinkhorn-N.
    pub sweeps: i64,
    /// HNAS (with one sweep): `u·DNAS + (1 − u)·softmax` per head with the gate
    /// `u = sigmoid(hybrid_logit)`; under BAM's noise the kernels mix the two bases' weights.
    pub hybrid: bool,
    /// `(B, S_k)` bool, true = excluded.
    pub key_padding: Option<&'a Tensor>,
    /// `(B, S_q)` bool, true = excluded: the row gets a zero output and takes no part in the
    /// column statistics.
    pub query_padding: Option<&'a Tensor>,
    /// Bool, broadcastable to `(B, H, S_q, S_k)`, true = takes part (as SDPA's boolean `attn_mask`).
    pub pattern: Option<&'a Tensor>,
    /// A floating-point additive mask broadcastable to `(B, H, S_q, S_k)`, added to the scores; its
    /// `-inf` entries are excluded. No gradient reaches it.
    pub bias: Option<&'a Tensor>,
    /// Top-left causal (softmax only).
    pub causal: bool,
    /// BAM's noise: 0 none, 1 Weibull, 2 Lognormal ([`crate::TiledSpec::WEIBULL`], ...).
    pub noise: i32,
    /// BAM's KL form: 0 none, else equal to `noise`.
    pub kl: i32,
    /// `1/k` or `σ`.
    pub noise_scale: f64,
    /// The key of the counter-based draws.
    pub seed: u64,
    /// The prior's per-key values `a_j`, broadcastable to `(B, H, 1, S_k)`, with a KL term.
    pub prior: Option<&'a Tensor>,
    /// HNAS's gate logits `(H,)`, with `hybrid`; differentiable.
    pub hybrid_logit: Option<&'a Tensor>,
    /// Also the received mass ([`FusedOutput::mass`]): one more key pass per branch after the
    /// forward. Deterministic plans only (no `noise`).
    pub mass: bool,
}

/// `pa_fused_spec` (csrc/probattn.h): a [`FusedSpec`] without its tensors.
#[repr(C)]
struct CSpec {
    scale: f64,
    sweeps: i64,
    hybrid: i32,
    causal: i32,
    noise: i32,
    kl: i32,
    mass: i32,
    noise_scale: f64,
    seed: u64,
}

impl FusedSpec<'_> {
    fn c(&self) -> CSpec {
        CSpec {
            scale: self.scale,
            sweeps: self.sweeps,
            hybrid: i32::from(self.hybrid),
            causal: i32::from(self.causal),
            noise: self.noise,
            kl: self.kl,
            mass: i32::from(self.mass),
            noise_scale: self.noise_scale,
            seed: self.seed,
        }
    }
}

/// What [`fused_cuda_attention`] returns.
#[derive(Debug)]
pub struct FusedOutput {
    /// The attention output `(B, H, S_q, d_v)`, in q's dtype (with `hybrid`, the mixture).
    pub out: Tensor,
    /// The KL term's score-dependent part `(B, H)` (zeros without one).
    pub kl_part: Tensor,
    /// With [`FusedSpec::mass`], the received mass `Σ_i p_ij`, `(1, B, H, S_k)` in float32, without
    /// a gradient (with `hybrid`, the mixture's).
    pub mass: Option<Tensor>,
}

/// Attention of bfloat16 or float16 `q (B, H, S_q, d)`, `k (B, H_kv, S_k, d)`, `v (B, H_kv, S_k,
/// d_v)` on one CUDA device by the embedded kernels, as `spec` says ([`FusedOutput`]),
/// differentiable in q, k, v and the prior. What the route serves is the caller's to decide
/// (src/attention/fused_cuda.rs); anything else is an error that names it.
pub fn fused_cuda_attention(q: &Tensor, k: &Tensor, v: &Tensor, spec: &FusedSpec) -> Result<FusedOutput> {
    registered()?;
    let (mut out, mut part, mut mass) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
    let optional = |t: Option<&Tensor>| t.map_or(ptr::null(), |t| t.as_ptr());
    let c_spec = spec.c();
    // SAFETY: the tensor pointers borrow live tensors for the call and `c_spec` is a live local;
    // the three outputs are new tensors written on success only, owned by `Tensor::from_ptr`
    // from then on.
    unsafe {
        let status = pa_fused_cuda_attention(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            optional(spec.key_padding),
            optional(spec.query_padding),
            optional(spec.pattern),
            optional(spec.bias),
            optional(spec.prior),
            optional(spec.hybrid_logit),
            &c_spec,
            &mut out,
            &mut part,
            &mut mass,
        );
        check(status, Error::Torch)?;
        let mass = Tensor::from_ptr(mass);
        Ok(FusedOutput { out: Tensor::from_ptr(out), kl_part: Tensor::from_ptr(part), mass: spec.mass.then_some(mass) })
    }
}

/// What [`fused_cuda_attention`] would launch for a GPU of compute capability `arch` (90 for
/// sm_90), forward (and the mass, with [`FusedSpec::mass`]) then backward, without a driver and
/// on tensors of any device: a JSON array of `{kernel, key, grid, ints, tensors}` per launch, in
/// order. The tests compare it with the Python
/// orchestration's own launches (`plans.launches()`).
#[doc(hidden)]
pub fn fused_cuda_dry_run(q: &Tensor, k: &Tensor, v: &Tensor, spec: &FusedSpec, arch: u32) -> Result<String> {
    registered()?;
    let mut json = ptr::null_mut();
    let optional = |t: Option<&Tensor>| t.map_or(ptr::null(), |t| t.as_ptr());
    let c_spec = spec.c();
    // SAFETY: the tensor pointers borrow live tensors for the call and `c_spec` is a live local;
    // `json` is a new string written on success only, taken once.
    let status = unsafe {
        pa_fused_cuda_dry_run(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            optional(spec.key_padding),
            optional(spec.query_padding),
            optional(spec.pattern),
            optional(spec.bias),
            optional(spec.prior),
            optional(spec.hybrid_logit),
            &c_spec,
            arch as i32,
            &mut json,
        )
    };
    check(status, Error::Torch)?;
    take_string(json).ok_or_else(|| Error::Torch("pa_fused_cuda_dry_run returned no record".into()))
}

/// The KL part's terms that are sums over the logits, which the fused route forms from sums over
/// the sequence rather than in its kernels (over softmax's base; docs/kernels.md): `[KS, TROW,
/// QBAR, dA, the dQ term]` for `q` (B, H, S_q, d), `k` (B, H_kv, S_k, d), the prior's values
/// `prior` (B, H, S_k; its dtype is the sums'), the paddings (B, S, nonzero where padded), the
/// causal mask, the score scale, the part `kl` (1 Weibull's, 2 Lognormal's, which refuses the
/// causal mask), the row pass's log-sum-exps `rb` (B, H, S_q) and the gradient `dkl` (B, H) in
/// the part. For the tests, which hold them to the same terms over the whole score matrix; on any
/// device.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn fused_linear_kl_terms(
    q: &Tensor,
    k: &Tensor,
    prior: &Tensor,
    query_padding: &Tensor,
    key_padding: &Tensor,
    causal: bool,
    scale: f64,
    kl: i32,
    rb: &Tensor,
    dkl: &Tensor,
) -> Result<[Tensor; 5]> {
    let mut terms = [ptr::null_mut(); 5];
    // SAFETY: the tensor pointers borrow live tensors for the call; `terms` receives five new
    // tensors on success only, each taken once below.
    let status = unsafe {
        pa_fused_linear_kl_terms(
            q.as_ptr(),
            k.as_ptr(),
            prior.as_ptr(),
            query_padding.as_ptr(),
            key_padding.as_ptr(),
            i32::from(causal),
            scale,
            kl,
            rb.as_ptr(),
            dkl.as_ptr(),
            terms.as_mut_ptr(),
        )
    };
    check(status, Error::Torch)?;
    // SAFETY: on success each entry is a new tensor the call handed over.
    Ok(terms.map(|t| unsafe { Tensor::from_ptr(t) }))
}
