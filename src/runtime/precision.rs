//! Mixed precision as PyTorch's autocast does it: [`Precision::Bf16`] runs a region of code with
//! libtorch's autocast on for the device, so matrix products (linear layers, `matmul`, attention's
//! value mix) run in bfloat16 while the weights, the optimizer state and everything outside the
//! region stay float32. probattn's attention forms its scores in float32 from bfloat16 inputs, as
//! libtorch's fused kernels do, and keeps its statistics wider than its inputs in every precision
//! ([`statistics_kind`]): softmax's and DNAS/Sinkhorn's log-sum-exps, BAM's noise transform and KL,
//! the received mass. Losses are the caller's to take in float32 (the models do, as fairseq does).
//!
//! ```
//! use probattn::precision::Precision;
//! use tch::{Device, Kind, Tensor};
//!
//! let (x, w) = (Tensor::randn([4, 8], (Kind::Float, Device::Cpu)), Tensor::randn([8, 8], (Kind::Float, Device::Cpu)));
//! let y = Precision::Bf16.run(Device::Cpu, || x.matmul(&w))?;
//! assert_eq!(y.kind(), Kind::BFloat16); // inside the region: bfloat16
//! assert_eq!(x.matmul(&w).kind(), Kind::Float); // after it: float32 again
//! # Ok::<(), probattn::Error>(())
//! ```

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::cxx;
use crate::{Error, Result};

/// The precision a run computes in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in float32 (the default).
    #[default]
    F32,
    /// float32 tensors whose matrix products on CUDA run in TF32 (10-bit mantissas in, float32
    /// out), as `torch.backends.cuda.matmul.allow_tf32 = True` makes them: cuBLAS's, and the
    /// fused CUDA route's, which takes float32 only then. The switch is libtorch's and
    /// process-wide; a region sets it and puts it back. On the CPU it changes nothing.
    Tf32,
    /// bfloat16 autocast, as `torch.autocast(device, torch.bfloat16)`: float32 weights.
    Bf16,
}

impl Precision {
    pub const NAMES: &'static str = "f32, tf32, bf16";

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Tf32 => "tf32",
            Self::Bf16 => "bf16",
        }
    }

    /// Why this precision is expected to run slower than float32 on `device`, or `None`: bfloat16
    /// on a CPU without bfloat16 instructions ([`cpu_has_bf16_instructions`]), or on one where a
    /// short matrix-product probe ([`cpu_bf16_matmul_speedup`], about a tenth of a second) finds
    /// bfloat16 no faster than float32: the instructions alone do not decide it (docs/precision.md).
    pub fn slower_than_f32(self, device: Device) -> Option<String> {
        if self != Self::Bf16 || device != Device::Cpu {
            return None;
        }
        if !cpu_has_bf16_instructions() {
            return Some(
                "bf16 on this CPU, which has no bfloat16 instructions (AVX512-BF16 or AMX): libtorch emulates \
                 bfloat16 with float32 instructions here, and it runs slower than f32 (docs/precision.md)"
                    .to_string(),
            );
        }
        let speedup = cpu_bf16_matmul_speedup().ok()?;
        (speedup < 1.0).then(|| {
            format!(
                "bf16 on this CPU: a matrix-product probe runs bfloat16 at {speedup:.2}× float32's speed, so training in \
                 bf16 is likely slower than in f32 here (docs/precision.md)"
            )
        })
    }

    /// Enters a region on `device` until the guard drops: autocast on for its device type
    /// ([`Precision::Bf16`]), or TF32 allowed ([`Precision::Tf32`]); a no-op guard for
    /// [`Precision::F32`]. Regions nest; the state before is restored on drop.
    pub fn enter(self, device: Device) -> Result<Autocast> {
        let cuda = device.is_cuda();
        let (previous, tf32_before) = match self {
            Self::F32 => (None, None),
            Self::Tf32 => (None, Some(cxx::set_allow_tf32(true)?)),
            Self::Bf16 => (Some(cxx::autocast_enter(cuda, cxx::AutocastDtype::BFloat16)?), None),
        };
        Ok(Autocast { cuda, previous, tf32_before })
    }

    /// Runs `f` in a region on `device` (see [`Precision::enter`]).
    pub fn run<T>(self, device: Device, f: impl FnOnce() -> T) -> Result<T> {
        let guard = self.enter(device)?;
        let out = f();
        guard.exit()?;
        Ok(out)
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Self::F32),
            "tf32" => Ok(Self::Tf32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            _ => Err(Error::Config(format!("unknown precision '{s}' (known: {})", Self::NAMES))),
        }
    }
}

/// A precision region; dropping it restores the state before ([`Autocast::exit`] reports an error
/// that a drop cannot).
#[must_use = "the region ends when the guard drops"]
#[derive(Debug)]
pub struct Autocast {
    cuda: bool,
    previous: Option<cxx::AutocastState>,
    /// [`Precision::Tf32`]: libtorch's TF32 switch before the region.
    tf32_before: Option<bool>,
}

impl Autocast {
    /// Ends the region.
    pub fn exit(mut self) -> Result<()> {
        self.restore()
    }

    fn restore(&mut self) -> Result<()> {
        if let Some(before) = self.tf32_before.take() {
            cxx::set_allow_tf32(before)?;
        }
        match self.previous.take() {
            Some(previous) => Ok(cxx::autocast_exit(self.cuda, &previous)?),
            None => Ok(()),
        }
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        // Restoring passes known-good values back; it fails only if libtorch itself is broken,
        // and a drop has no one to tell.
        let _ = self.restore();
    }
}

/// Whether libtorch lets CUDA's float32 matrix products run in TF32: PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32`, one switch for the process (off by default, as in
/// PyTorch). The fused CUDA route takes float32 only while it is on.
pub fn allow_tf32() -> Result<bool> {
    Ok(cxx::allow_tf32()?)
}

/// Sets the switch [`allow_tf32`] reads for the whole process; returns its value before.
/// [`Precision::Tf32`]'s regions set it and put it back.
pub fn set_allow_tf32(allow: bool) -> Result<bool> {
    Ok(cxx::set_allow_tf32(allow)?)
}

/// Whether libtorch's deterministic algorithms are asked for: PyTorch's
/// `torch.use_deterministic_algorithms`, one switch for the process (off by default). On the
/// fused CUDA route the backward of Sinkhorn-N and of softmax's base (softmax, and BAM over it, in
/// 16-bit dtypes up to head dimension 128) adds dQ tile by tile with atomic adds, whose order (and
/// so dQ's last bits) varies from run to run; with the switch on it forms dQ in a pass of its own
/// instead, at the cost of every tile's gradient (and BAM's draws) formed twice.
pub fn deterministic_algorithms() -> Result<bool> {
    Ok(cxx::deterministic_algorithms()?)
}

/// Sets the switch [`deterministic_algorithms`] reads for the whole process; returns its value
/// before. libtorch then also refuses its own operations that have no deterministic form.
pub fn set_deterministic_algorithms(on: bool) -> Result<bool> {
    Ok(cxx::set_deterministic_algorithms(on)?)
}

/// Whether this CPU does bfloat16 arithmetic in hardware: x86-64's AVX512-BF16 instructions (which
/// every processor with AMX has too). Without them libtorch computes bfloat16 products with float32
/// instructions and conversions, and bfloat16 runs slower than float32 on the CPU
/// (docs/precision.md has a measurement). Other architectures are not checked and answer `true`.
pub fn cpu_has_bf16_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

/// bfloat16's matrix-product speed over float32's on this CPU, at the current thread count:
/// `(256 × 512) · (512 × 512)` products, the best of five rounds of eight in each dtype, after a
/// warm-up (about a tenth of a second in all). Above 1, bfloat16 is the faster.
pub fn cpu_bf16_matmul_speedup() -> Result<f64> {
    let time = |kind: Kind| -> Result<f64> {
        let (a, b) = (Tensor::f_randn([256, 512], (kind, Device::Cpu))?, Tensor::f_randn([512, 512], (kind, Device::Cpu))?);
        let _ = a.f_matmul(&b)?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = std::time::Instant::now();
            for _ in 0..8 {
                let _ = a.f_matmul(&b)?;
            }
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let (f32_time, bf16_time) = (time(Kind::Float)?, time(Kind::BFloat16)?);
    Ok(f32_time / bf16_time.max(f64::MIN_POSITIVE))
}

/// The dtype attention keeps its statistics in for inputs of `kind`: float32 for bfloat16 and
/// float16, the inputs' own otherwise.
pub fn statistics_kind(kind: Kind) -> Kind {
    match kind {
        Kind::BFloat16 | Kind::Half => Kind::Float,
        other => other,
    }
}

/// `t` in [`statistics_kind`] of its dtype (itself, not a copy, when that is its dtype).
pub fn widen(t: &Tensor) -> Tensor {
    let kind = statistics_kind(t.kind());
    if kind == t.kind() {
        t.shallow_clone()
    } else {
        t.to_kind(kind)
    }
}

/// The dtype autocast computes in on `device` on this thread, `None` when it is off.
pub fn autocast_kind(device: Device) -> Result<Option<Kind>> {
    Ok(cxx::autocast_state(device.is_cuda())?.enabled().map(|dtype| match dtype {
        cxx::AutocastDtype::BFloat16 => Kind::BFloat16,
        cxx::AutocastDtype::Float16 => Kind::Half,
    }))
}

/// Runs `f` with autocast off on `device`'s type (when it was on, it is switched back on after,
/// whatever `f` returns): for code that sets its dtypes itself, as attention does.
pub fn outside_autocast<T>(device: Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if cxx::autocast_state(device.is_cuda())?.enabled().is_none() {
        return f();
    }
    with_autocast_off(device, f)
}

/// Runs `f` with autocast, known to be on for `device`'s type, switched off, and on again after.
pub(crate) fn with_autocast_off<T>(device: Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let cuda = device.is_cuda();
    cxx::autocast_set_enabled(cuda, false)?;
    let out = f();
    cxx::autocast_set_enabled(cuda, true)?;
    out
}
