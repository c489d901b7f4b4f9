//! Arguments every subcommand shares, and the set-up they drive.

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use probattn::precision::{Autocast, Precision};
use probattn::{Backend, DeviceSpec};
use tch::Device;

/// The data folder the user sets: `$PROBATTN_DATA`, else `data/` (where the download scripts put
/// the datasets). Each dataset lives in a subfolder of it (`planetoid/`, `multi30k/`, ...).
pub fn data_root() -> std::path::PathBuf {
    std::env::var_os("PROBATTN_DATA").filter(|v| !v.is_empty()).map_or_else(|| "data".into(), std::path::PathBuf::from)
}

/// Flags shared by every subcommand.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Device to run on: auto (CUDA when available, else CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceSpec,
    /// Intra-op threads for libtorch (default: libtorch's choice, usually one per core).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// What the C allocator does with freed memory: retain keeps it for reuse (large attention
    /// tensors then cost no page faults; the process holds its peak memory), system leaves
    /// glibc's default of unmapping large blocks. Child processes (bench's PyTorch side) get the
    /// same setting.
    #[arg(long, value_enum, default_value_t = Allocator::Retain)]
    pub allocator: Allocator,
    /// How attention runs, in every layer of the command: auto (the library's choice: with
    /// --memory-efficient the variant's plan, through the embedded Triton kernels on CUDA and
    /// libtorch's fused CPU kernel on the CPU where they apply; without it, softmax's fused kernel
    /// when no weights are asked for; else eager), eager (the
    /// weights formed), tiles (each variant's plan tile by tile; --tile queries a tile) or fused
    /// (one kernel that never forms the weights: softmax's own, else the variant's plan through
    /// libtorch's fused CPU kernel on the CPU and the embedded Triton kernels on CUDA;
    /// docs/kernels.md). A forced backend that cannot serve a call (weights asked for, a mask the fused
    /// kernel does not take) stops the command with an error that says why. Recorded in
    /// results.json and bench.json with the routes that served the calls.
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    pub attention_backend: Backend,
}

/// `--memory-efficient [--tile N]`: one definition for attend, bench, translate and vqa.
#[derive(Args, Debug, Clone, Copy)]
pub struct MemoryEfficientArgs {
    /// The memory-efficient path (probattn::tiled, every variant): the (S_q, S_k) weights are never formed, so nothing that size is kept for the
    /// backward pass, and the mass each key receives is returned instead. attend writes it;
    /// bench times these rows beside the eager ones; translate takes it in every attention
    /// module, vqa in the fusion. Needs attention dropout 0 (vqa sets it).
    #[arg(long)]
    pub memory_efficient: bool,
    /// Queries per tile with --memory-efficient (vqa: primary boxes).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(i64).range(1..))]
    pub tile: i64,
}

impl MemoryEfficientArgs {
    /// The tile when the memory-efficient path is asked for.
    pub fn tile(&self) -> Option<i64> {
        self.memory_efficient.then_some(self.tile)
    }
}

/// `--precision f32|tf32|bf16`: one definition for translate, vqa, gat, bench and attend.
#[derive(Args, Debug, Clone, Copy)]
pub struct PrecisionArgs {
    /// f32: everything in float32. tf32: float32, with CUDA's matrix products (cuBLAS's and the
    /// fused CUDA route's) in TF32, as torch.backends.cuda.matmul.allow_tf32 = True; the same as
    /// f32 on the CPU. bf16: bfloat16 autocast, as torch.autocast(device, torch.bfloat16): matrix
    /// products and attention in bfloat16, while the weights, the optimizer state, the losses,
    /// attention's statistics (log-sum-exps, weights, BAM's noise and KL) and the SVGD kernel stay
    /// float32; checkpoints are float32 in all three (docs/precision.md).
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    pub precision: Precision,
}

impl PrecisionArgs {
    /// Starts a command's run in this precision on `device`. Says on stderr when the precision is
    /// expected to run slower than float32 there (bfloat16 on a CPU without bfloat16 instructions)
    /// or is float32 there (tf32 on the CPU); the run goes on. For tf32, switches TF32 on until
    /// the returned guard drops: for the whole command, backward passes included, as a PyTorch
    /// script's `torch.backends.cuda.matmul.allow_tf32 = True`. (bf16's autocast regions cover
    /// forward passes only, as `torch.autocast`'s do; the commands enter them themselves.)
    pub fn begin(&self, device: Device) -> Result<Autocast> {
        if self.precision == Precision::Tf32 && !device.is_cuda() {
            eprintln!("warning: tf32 on the CPU runs as f32: libtorch's TF32 switch reaches CUDA's matrix products only");
        }
        if let Some(why) = self.precision.slower_than_f32(device) {
            eprintln!("warning: {why}");
        }
        let whole = if self.precision == Precision::Tf32 { Precision::Tf32 } else { Precision::F32 };
        Ok(whole.enter(device)?)
    }
}

fn parse_backend(s: &str) -> std::result::Result<Backend, String> {
    s.parse().map_err(|e: probattn::Error| e.to_string())
}

fn parse_precision(s: &str) -> std::result::Result<Precision, String> {
    s.parse().map_err(|e: probattn::Error| e.to_string())
}

/// `--allocator`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Allocator {
    Retain,
    System,
}

fn parse_device(s: &str) -> std::result::Result<DeviceSpec, String> {
    s.parse().map_err(|e: probattn::Error| e.to_string())
}

impl CommonArgs {
    /// Applies the allocator setting and the thread count, and resolves the device.
    pub fn setup(&self) -> Result<Device> {
        probattn::backend::set_default(self.attention_backend);
        if self.allocator == Allocator::Retain {
            probattn::allocator::retain_freed_memory();
        }
        if let Some(n) = self.threads {
            probattn::device::set_threads(n.into())?;
        }
        self.device.resolve().context("--device")
    }
}
