//! Memory statistics: bytes held by tensors now, and the most since a reset, per device.
//!
//! - **CUDA**: the caching allocator's device statistics, the numbers behind PyTorch's
//!   `torch.cuda.memory_allocated()` / `max_memory_allocated()` (and `memory_reserved()`).
//! - **CPU**: libtorch keeps no byte counts for CPU tensors, so [`track`] installs a counting
//!   allocator in c10's CPU slot (the default allocator's own `alloc_cpu` / `free_cpu`, with the
//!   size of each block counted on allocation and on free). It counts the bytes of tensor
//!   storages allocated after it was installed; memory outside tensors (oneDNN's scratch space,
//!   glibc's caches, the program itself) is not counted. `probattn bench` loads the same counter
//!   into PyTorch's process ([`python_counter_library`]), so both sides are measured alike.
//!
//! ```
//! use probattn::memory;
//! use tch::{Device, Kind, Tensor};
//!
//! let device = Device::Cpu;
//! memory::track(device)?;
//! let (sum, peak) = memory::peak_during(device, || Tensor::ones([1024, 1024], (Kind::Float, device)).sum(Kind::Float))?;
//! assert!(peak >= 4 * 1024 * 1024); // the 4 MiB of ones, freed before the end
//! # Ok::<(), probattn::Error>(())
//! ```

use std::path::PathBuf;

use serde::Serialize;
use tch::Device;

use crate::{cxx, Error, Result};

/// Bytes held by tensors on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    /// Bytes allocated to live tensors now.
    pub current_bytes: i64,
    /// The most `current_bytes` has been since the last [`reset_peak`] (or since tracking began).
    pub peak_bytes: i64,
    /// CUDA: bytes the caching allocator holds from the driver (`None` on the CPU).
    pub reserved_bytes: Option<i64>,
    /// CUDA: the most `reserved_bytes` has been since the last reset.
    pub reserved_peak_bytes: Option<i64>,
}

/// Starts counting on `device`. On the CPU this installs the counting allocator (once, for the
/// rest of the process; tensors allocated before are not counted); CUDA's allocator always counts.
pub fn track(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(cxx::cpu_memory_track()?),
        Device::Cuda(i) => Ok(cxx::cuda_memory_stats(i as i64).map(drop)?),
        other => Err(Error::Device(format!("memory statistics are kept for the CPU and CUDA, not {other:?}"))),
    }
}

/// The statistics of `device` now.
pub fn stats(device: Device) -> Result<MemoryStats> {
    match device {
        Device::Cpu => {
            let (current_bytes, peak_bytes, tracking) = cxx::cpu_memory_stats()?;
            if !tracking {
                return Err(Error::Device(
                    "CPU memory is counted only after probattn::memory::track(Device::Cpu) (and while no other allocator has replaced it)"
                        .into(),
                ));
            }
            Ok(MemoryStats { current_bytes, peak_bytes, reserved_bytes: None, reserved_peak_bytes: None })
        }
        Device::Cuda(i) => {
            let [current_bytes, peak_bytes, reserved, reserved_peak] = cxx::cuda_memory_stats(i as i64)?;
            Ok(MemoryStats { current_bytes, peak_bytes, reserved_bytes: Some(reserved), reserved_peak_bytes: Some(reserved_peak) })
        }
        other => Err(Error::Device(format!("memory statistics are kept for the CPU and CUDA, not {other:?}"))),
    }
}

/// Sets the peak to the current value: the next [`stats`] peak is the most since now.
pub fn reset_peak(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(cxx::cpu_memory_reset_peak()?),
        Device::Cuda(i) => Ok(cxx::cuda_memory_reset_peak(i as i64)?),
        other => Err(Error::Device(format!("memory statistics are kept for the CPU and CUDA, not {other:?}"))),
    }
}

/// Runs `f` and returns its value and the most bytes it held above what was held before it
/// (peak during `f` minus the bytes allocated when it started). CUDA is synchronized first.
pub fn peak_during<T>(device: Device, f: impl FnOnce() -> T) -> Result<(T, i64)> {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    reset_peak(device)?;
    let before = stats(device)?.current_bytes;
    let value = f();
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    Ok((value, stats(device)?.peak_bytes - before))
}

/// The counting CPU allocator as a shared library, for another process that links the same
/// libtorch (PyTorch: `ctypes.CDLL(path).pa_cpu_memory_track()`): `PROBATTN_MEMORY_LIB` if set,
/// else the one built with this binary.
pub fn python_counter_library() -> PathBuf {
    std::env::var_os("PROBATTN_MEMORY_LIB").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(crate::cxx::MEMORY_LIB))
}
