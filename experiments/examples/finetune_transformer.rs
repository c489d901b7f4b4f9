//! Fine-tune a PyTorch `nn.Transformer` (exported as TorchScript) in probattn with DNAS (or any
//! normalizer) in the encoder and repulsive heads, then write its weights back under
//! nn.Transformer's names. See `probattn_experiments::finetune`.
//!
//!     python -m probattn_tools.export.torchscript transformer --embed-dim 64 --heads 4 --layers 2 --ffn 128 --out tr.pt
//!     cargo run --release -p probattn-experiments --example finetune_transformer -- \
//!         --torchscript tr.pt --heads 4 --variant dnas --repulsive svgd --out tuned.safetensors

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use probattn::repulsive::{Method, RepulsiveConfig};
use probattn::Variant;
use probattn_experiments::finetune::{finetune, FinetuneConfig};

#[derive(Parser, Debug)]
#[command(about = "Fine-tune an nn.Transformer TorchScript export in probattn (DNAS encoder, repulsive heads)")]
struct Args {
    /// The nn.Transformer, scripted and saved (python/probattn_tools/export/torchscript.py transformer ...).
    #[arg(long)]
    torchscript: PathBuf,
    /// Attention heads (not recorded in the weights).
    #[arg(long)]
    heads: i64,
    /// The encoder's normalizer: softmax, dnas, hnas, sinkhorn-N, bam-*.
    #[arg(long, default_value = "dnas")]
    variant: Variant,
    /// Repulsive heads: none, svgd or spos (alpha 0.01, step size 0.01: the paper's values).
    #[arg(long, default_value = "svgd")]
    repulsive: String,
    /// Adam updates.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Sequences per batch and their length, of the synthetic task (reverse the sequence).
    #[arg(long, default_value_t = 32)]
    batch: i64,
    #[arg(long, default_value_t = 10)]
    len: i64,
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// Where to write the fine-tuned weights (safetensors, nn.Transformer's names).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let repulsive = match a.repulsive.as_str() {
        "none" => None,
        "svgd" => Some(RepulsiveConfig { method: Method::Svgd, ..Default::default() }),
        "spos" => Some(RepulsiveConfig { method: Method::Spos, ..Default::default() }),
        other => anyhow::bail!("--repulsive {other}: none, svgd or spos"),
    };
    let cfg = FinetuneConfig {
        heads: a.heads,
        variant: a.variant,
        repulsive,
        steps: a.steps,
        lr: a.lr,
        batch: a.batch,
        len: a.len,
        seed: a.seed,
    };
    let r = finetune(&a.torchscript, &cfg, &a.out, tch::Device::cuda_if_available())?;
    println!("import: {}", r.import.replace('\n', "; "));
    println!(
        "held-out MSE: {:.4} before, {:.4} after {} steps; {} particle sets moved by the hook",
        r.loss_before, r.loss_after, a.steps, r.particle_sets
    );
    println!("weights: {}", a.out.display());
    Ok(())
}
