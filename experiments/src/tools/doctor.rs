//! `probattn doctor`: what this binary links and sees (tch, libtorch, threads, CUDA, cuDNN).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use tch::Cuda;

use crate::common::CommonArgs;

/// Flags of `probattn doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Exit with an error unless CUDA is usable.
    #[arg(long)]
    pub require_cuda: bool,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// What `probattn doctor` reports.
#[derive(Debug, Serialize)]
pub struct Report {
    pub probattn_version: String,
    pub tch_version: String,
    /// The libtorch version found beside the loaded library, and its folder.
    pub libtorch_version: Option<String>,
    pub libtorch_dir: Option<PathBuf>,
    /// Whether `libtorch_cuda.so` is loaded into this process.
    pub libtorch_cuda_loaded: bool,
    pub threads: i32,
    pub cuda_available: bool,
    pub cuda_device_count: i64,
    pub cudnn_available: bool,
    pub cudnn_version: Option<i64>,
    pub device: String,
    /// The c10d backends this build has, for `torchrun` (docs/distributed.md).
    pub distributed_backends: Vec<probattn::distributed::Backend>,
}

impl Report {
    pub fn gather(device: tch::Device) -> Self {
        let libs = loaded_libraries();
        let libtorch_dir = libs.iter().find(|p| file_name_starts(p, "libtorch_cpu.")).and_then(|p| p.parent().map(PathBuf::from));
        let cuda_available = Cuda::is_available();
        let cudnn_available = cuda_available && Cuda::cudnn_is_available();
        Self {
            probattn_version: env!("CARGO_PKG_VERSION").into(),
            tch_version: env!("PROBATTN_TCH_VERSION").into(),
            libtorch_version: libtorch_dir.as_deref().and_then(libtorch_version),
            libtorch_dir,
            libtorch_cuda_loaded: libs.iter().any(|p| file_name_starts(p, "libtorch_cuda.")),
            threads: tch::get_num_threads(),
            cuda_available,
            cuda_device_count: if cuda_available { Cuda::device_count() } else { 0 },
            cudnn_available,
            cudnn_version: cudnn_available.then(tch::utils::version_cudnn),
            device: probattn::device::device_name(device),
            distributed_backends: probattn::distributed::Backend::available(),
        }
    }

    pub fn print(&self) {
        let yes = |b: bool| if b { "yes" } else { "no" };
        println!("probattn  {}", self.probattn_version);
        println!("tch       {}", self.tch_version);
        match (&self.libtorch_version, &self.libtorch_dir) {
            (Some(v), Some(d)) => println!("libtorch  {v} ({})", d.display()),
            (None, Some(d)) => println!("libtorch  version unknown ({})", d.display()),
            _ => println!("libtorch  not found among the loaded libraries"),
        }
        println!("threads   {} (intra-op)", self.threads);
        println!(
            "CUDA      {}, {} device(s); libtorch_cuda loaded: {}",
            yes(self.cuda_available),
            self.cuda_device_count,
            yes(self.libtorch_cuda_loaded)
        );
        match self.cudnn_version {
            Some(v) => println!("cuDNN     yes (version {v})"),
            None => println!("cuDNN     no"),
        }
        println!("device    {} (from --device)", self.device);
        let backends: Vec<&str> = self.distributed_backends.iter().map(|b| b.name()).collect();
        println!(
            "c10d      {} (distributed training under torchrun)",
            if backends.is_empty() { "none".into() } else { backends.join(", ") }
        );
    }

    /// Why CUDA is not usable, when it is not.
    pub fn cuda_problem(&self) -> Option<String> {
        if self.cuda_available {
            return None;
        }
        Some(if self.libtorch_cuda_loaded {
            "libtorch_cuda is loaded but no CUDA device is usable (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)".into()
        } else {
            "this process has no CUDA-enabled libtorch loaded (libtorch_cuda.so is absent: a CPU-only libtorch, or a binary linked without --no-as-needed)".into()
        })
    }
}

pub fn run(args: &DoctorArgs) -> Result<()> {
    // The device is resolved after the report so `doctor --device cuda` still reports.
    if let Some(n) = args.common.threads {
        probattn::device::set_threads(n.into())?;
    }
    let device = args.common.device.resolve();
    let report = Report::gather(*device.as_ref().unwrap_or(&tch::Device::Cpu));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print();
    }
    if args.require_cuda {
        if let Some(problem) = report.cuda_problem() {
            bail!("CUDA is required (--require-cuda) but not usable: {problem}");
        }
    }
    device?;
    Ok(())
}

fn file_name_starts(p: &std::path::Path, prefix: &str) -> bool {
    p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(prefix))
}

/// The shared libraries mapped into this process (Linux; empty elsewhere).
fn loaded_libraries() -> Vec<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut libs: Vec<PathBuf> =
        maps.lines().filter_map(|l| l.split_whitespace().nth(5)).filter(|p| p.contains(".so")).map(PathBuf::from).collect();
    libs.sort();
    libs.dedup();
    libs
}

/// The version of the libtorch in `lib_dir`: a PyTorch wheel's `torch/version.py`, or a libtorch
/// archive's `build-version`.
fn libtorch_version(lib_dir: &std::path::Path) -> Option<String> {
    let root = lib_dir.parent()?;
    if let Ok(text) = std::fs::read_to_string(root.join("version.py")) {
        let line = text.lines().find(|l| l.starts_with("__version__"))?;
        return Some(line.split(['\'', '"']).nth(1)?.to_string());
    }
    std::fs::read_to_string(root.join("build-version")).ok().map(|v| v.trim().to_string())
}
