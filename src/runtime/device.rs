//! Device selection (`auto`, `cpu`, `cuda`, `cuda:N`) and thread count, with errors that say why a
//! device cannot be used instead of failing later inside libtorch.

use std::fmt;
use std::str::FromStr;

use tch::{Cuda, Device};

use crate::{Error, Result};

/// A device as the user names it. `Auto` is CUDA device 0 when CUDA is usable, else the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Device(format!("unknown device '{s}' (expected auto, cpu, cuda or cuda:N)"));
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Self::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => write!(f, "auto"),
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// The tch device, or an error when CUDA was asked for and is not usable.
    pub fn resolve(self) -> Result<Device> {
        match self {
            Self::Auto => Ok(Device::cuda_if_available()),
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(n) => {
                if !Cuda::is_available() {
                    return Err(Error::Device(format!(
                        "{self} was requested but libtorch reports no usable CUDA device \
                         (`probattn doctor` shows what libtorch sees)"
                    )));
                }
                let count = Cuda::device_count() as usize;
                if n >= count {
                    return Err(Error::Device(format!(
                        "{self} was requested but only {count} CUDA device(s) exist (cuda:0..cuda:{})",
                        count - 1
                    )));
                }
                Ok(Device::Cuda(n))
            }
        }
    }
}

/// Sets libtorch's intra-op thread count; `0` is refused (libtorch would ignore it silently).
pub fn set_threads(n: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::Config("the thread count must be at least 1".into()));
    }
    tch::set_num_threads(i32::try_from(n).map_err(|_| Error::Config(format!("{n} threads is too many")))?);
    Ok(())
}

/// Drops every later libtorch warning whose message starts with `prefix` on the calling thread
/// (c10 keeps its warning handler per thread, so a thread that runs the ops behind the warning
/// calls this itself); every other warning still prints. For warnings that say nothing to our users, such as
/// "Sparse CSR tensor support is in beta" on every GAT run (a libtorch notice about an API we
/// use as documented).
pub fn silence_libtorch_warning(prefix: &str) -> Result<()> {
    Ok(crate::cxx::silence_warning(prefix)?)
}

/// A short human name of a device: `cpu`, `cuda:0`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_documented_form() {
        assert_eq!("auto".parse::<DeviceSpec>().unwrap(), DeviceSpec::Auto);
        assert_eq!("CPU".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let err = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(err.contains("unknown device"), "{bad}: {err}");
        }
    }

    #[test]
    fn zero_threads_is_refused() {
        assert!(set_threads(0).is_err());
    }
}
