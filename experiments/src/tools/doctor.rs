//! `probattn doctor`: what this binary links and sees (tch, libtorch, the processor, threads, CUDA,
//! cuDNN).

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
    /// The processor as the OS names it, and the bfloat16 instructions it has, which decide
    /// bfloat16's speed on the CPU (`docs/precision.md`); `None` where `/proc/cpuinfo` names no
    /// model (absent, or an architecture whose cpuinfo has no `model name` line).
    pub cpu: Option<String>,
    pub threads: i32,
    pub cuda_available: bool,
    pub cuda_device_count: i64,
    pub cudnn_available: bool,
    pub cudnn_version: Option<i64>,
    pub device: String,
    /// The c10d backends this build has, for `torchrun` (docs/distributed.md).
    pub distributed_backends: Vec<probattn::distributed::Backend>,
    /// bfloat16's matrix-product speed over float32's on this CPU (`probattn::precision::
    /// cpu_bf16_matmul_speedup`; above 1, bfloat16 is faster): what `--precision bf16` gains here.
    /// Measured by `doctor` only; `None` in other records.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_bf16_matmul_speedup: Option<f64>,
    /// The fused CUDA route's embedded kernels by architecture, and whether this GPU has a match.
    pub fused_cuda: probattn::fused_cuda::Availability,
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
            cpu: std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|info| cpu_description(&info)),
            threads: tch::get_num_threads(),
            cuda_available,
            cuda_device_count: if cuda_available { Cuda::device_count() } else { 0 },
            cudnn_available,
            cudnn_version: cudnn_available.then(tch::utils::version_cudnn),
            device: probattn::device::device_name(device),
            distributed_backends: probattn::distributed::Backend::available(),
            cpu_bf16_matmul_speedup: None,
            fused_cuda: probattn::fused_cuda::availability(cuda_available),
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
        println!("cpu       {}", self.cpu.as_deref().unwrap_or("unknown (no model name in /proc/cpuinfo)"));
        println!("threads   {} (intra-op)", self.threads);
        if let Some(speedup) = self.cpu_bf16_matmul_speedup {
            let verdict = if speedup < 1.0 { "bf16 is the slower choice on this CPU" } else { "bf16 is the faster choice for products" };
            println!("bf16      matrix products at {speedup:.2}× float32's speed ({verdict}; docs/precision.md)");
        }
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
        let fused = &self.fused_cuda;
        let embedded: Vec<String> = fused.embedded.iter().map(|(arch, n)| format!("{arch} ({n} kernels)")).collect();
        match &fused.missing {
            Some(why) => println!("fused     no kernels embedded: {why}"),
            None => {
                println!("fused     {} (Triton {}; docs/kernels.md)", embedded.join(", "), fused.triton);
                println!("          dtypes and head dimensions: {}", sets_by_dtype(&fused.sets).join("; "));
            }
        }
        match (fused.gpu, &fused.why_not) {
            (Some(arch), None) => println!(
                "          this GPU (sm_{arch}) has a match: the fused CUDA route runs here ({})",
                if fused.auto { "auto takes it" } else { "when forced: --attention-backend fused" }
            ),
            (_, Some(why)) => println!("          not usable here: {why}"),
            (None, None) => {}
        }
        if let (Some(bytes), false) = (fused.gpu_shared_optin, fused.too_large_here.is_empty()) {
            println!(
                "          this GPU allows {bytes} bytes of shared memory a block, too few for the {} kernels: \
                 those calls run on the tiles",
                fused.too_large_here.join(", ")
            );
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
    let mut report = Report::gather(*device.as_ref().unwrap_or(&tch::Device::Cpu));
    report.cpu_bf16_matmul_speedup = probattn::precision::cpu_bf16_matmul_speedup().ok();
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

/// The embedded sets (`"bfloat16 d 64"`, ...) as one entry per dtype, `"bfloat16 d 64, 128, 256"`,
/// in the sets' order; float32's marked as taking TF32 products (the route's float32 cubins do).
fn sets_by_dtype(sets: &[String]) -> Vec<String> {
    let mut by_dtype: Vec<(&str, Vec<&str>)> = Vec::new();
    for (dtype, head_dim) in sets.iter().filter_map(|s| s.split_once(" d ")) {
        match by_dtype.iter_mut().find(|(d, _)| *d == dtype) {
            Some((_, dims)) => dims.push(head_dim),
            None => by_dtype.push((dtype, vec![head_dim])),
        }
    }
    by_dtype
        .into_iter()
        .map(|(dtype, dims)| format!("{dtype}{} d {}", if dtype == "float32" { " (TF32)" } else { "" }, dims.join(", ")))
        .collect()
}

/// "<model name>; bfloat16 instructions: <flags>" from the text of `/proc/cpuinfo` (x86-64's
/// `avx512_bf16` and `amx_bf16`, "none" when it has neither).
fn cpu_description(cpuinfo: &str) -> Option<String> {
    let field = |name: &str| {
        cpuinfo.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_string())
        })
    };
    let model = field("model name")?;
    let flags = field("flags").unwrap_or_default();
    let bf16: Vec<&str> = flags.split_whitespace().filter(|f| matches!(*f, "avx512_bf16" | "amx_bf16")).collect();
    Some(format!("{model}; bfloat16 instructions: {}", if bf16.is_empty() { "none".to_string() } else { bf16.join(" ") }))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_processor_is_named_with_its_bfloat16_instructions() {
        let info = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n";
        assert_eq!(cpu_description(info).unwrap(), "Intel(R) Xeon(R) Processor; bfloat16 instructions: avx512_bf16 amx_bf16");
        let old = "model name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz\nflags\t\t: fpu avx512f avx512_vnni\n";
        assert_eq!(cpu_description(old).unwrap(), "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz; bfloat16 instructions: none");
        assert_eq!(cpu_description("processor\t: 0\n"), None, "no model name, nothing to record");
    }

    #[test]
    fn the_embedded_sets_are_listed_once_per_dtype() {
        let sets: Vec<String> =
            ["bfloat16 d 64", "bfloat16 d 256", "float16 d 64", "float32 d 64", "float32 d 128"].map(String::from).into();
        assert_eq!(sets_by_dtype(&sets), ["bfloat16 d 64, 256", "float16 d 64", "float32 (TF32) d 64, 128"]);
        assert!(sets_by_dtype(&[]).is_empty());
    }
}
