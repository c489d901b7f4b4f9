//! The fused CUDA route's entry points in csrc/fused_cuda.cpp: the embedded kernels
//! (probattn-kernels) registered with the launcher once, the driver's status for a device, and
//! the attention call itself.

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
    fn pa_fused_cuda_status(device_index: i64, arch: *mut i32, why: *mut *mut c_char) -> *mut c_char;
    fn pa_fused_cuda_dry_run(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        key_padding: *const C_tensor,
        scale: f64,
        sweeps: i64,
        causal: i32,
        arch: i32,
        json: *mut *mut c_char,
    ) -> *mut c_char;
    fn pa_fused_cuda_attention(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        key_padding: *const C_tensor,
        scale: f64,
        sweeps: i64,
        causal: i32,
        out: *mut *mut C_tensor,
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
            let params = k.params.iter().map(|p| format!("{}:{}", p.name, p.ty)).collect::<Vec<_>>().join(",");
            let strings = [k.kernel.as_str(), k.dtype.as_str(), &key, &params, k.symbol.as_str()].map(c_string);
            let [Ok(kernel), Ok(dtype), Ok(key), Ok(params), Ok(symbol)] = strings else {
                return Err(format!("{}: a manifest entry with a NUL byte", k.file));
            };
            // SAFETY: every pointer is to a live C string or to the embedded cubin, which is
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
                    k.cubin.as_ptr(),
                    k.cubin.len(),
                )
            };
            check(status, Error::Torch).map_err(|e| e.to_string())?;
        }
        Ok(())
    })
    .clone()
    .map_err(Error::Torch)
}

/// Whether the driver can launch the embedded kernels on CUDA device `index`: `Ok(Ok(90))` its
/// compute capability, `Ok(Err(why))` when the driver library is missing or sees no GPU.
pub fn fused_cuda_status(index: i64) -> Result<std::result::Result<u32, String>> {
    let (mut arch, mut why) = (0i32, ptr::null_mut());
    // SAFETY: both outputs are live locals; `why` is a new string or NULL, taken once.
    let status = unsafe { pa_fused_cuda_status(index, &mut arch, &mut why) };
    check(status, Error::Device)?;
    Ok(match take_string(why) {
        Some(why) => Err(why),
        None => Ok(arch.max(0) as u32),
    })
}

/// Attention of bfloat16 or float16 `q (B, H, S_q, d)`, `k (B, H_kv, S_k, d)`, `v (B, H_kv, S_k,
/// d_v)` on one CUDA device by the embedded kernels: scores `scale · q·kᵀ`, `sweeps` 0 (softmax)
/// or 1 (DNAS), `key_padding` (bool `(B, S_k)`, true = excluded), `causal` (softmax only).
/// Differentiable in q, k and v. What the route serves is the caller's to decide
/// (src/attention/fused_cuda.rs); anything else is an error that names it.
pub fn fused_cuda_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_padding: Option<&Tensor>,
    scale: f64,
    sweeps: i64,
    causal: bool,
) -> Result<Tensor> {
    registered()?;
    let mut out = ptr::null_mut();
    // SAFETY: the tensor pointers borrow live tensors for the call; `out` is a new tensor written
    // on success only, owned by `Tensor::from_ptr` from then on.
    unsafe {
        let status = pa_fused_cuda_attention(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            key_padding.map_or(ptr::null(), |t| t.as_ptr()),
            scale,
            sweeps,
            i32::from(causal),
            &mut out,
        );
        check(status, Error::Torch)?;
        Ok(Tensor::from_ptr(out))
    }
}

/// What [`fused_cuda_attention`] would launch for a GPU of compute capability `arch` (90 for
/// sm_90), forward then backward, without a driver and on tensors of any device: a JSON array of
/// `{kernel, key, grid, ints, tensors}` per launch, in order. The tests compare it with the Python
/// orchestration's own launches (`plans.launches()`).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn fused_cuda_dry_run(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_padding: Option<&Tensor>,
    scale: f64,
    sweeps: i64,
    causal: bool,
    arch: u32,
) -> Result<String> {
    registered()?;
    let mut json = ptr::null_mut();
    // SAFETY: the tensor pointers borrow live tensors for the call; `json` is a new string written
    // on success only, taken once.
    let status = unsafe {
        pa_fused_cuda_dry_run(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            key_padding.map_or(ptr::null(), |t| t.as_ptr()),
            scale,
            sweeps,
            i32::from(causal),
            arch as i32,
            &mut json,
        )
    };
    check(status, Error::Torch)?;
    take_string(json).ok_or_else(|| Error::Torch("pa_fused_cuda_dry_run returned no record".into()))
}
