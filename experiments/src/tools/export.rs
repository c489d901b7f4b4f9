//! `probattn export`: a trained probattn model's weights as a PyTorch state dict.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

/// Flags of `probattn export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A `probattn translate` checkpoint (seed-N/checkpoint_best.safetensors, or _last, _average).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The safetensors state dict to write (atomically), under python/probattn_tools/baselines/translate.py's
    /// names, for its `--load-state-dict` (load_state_dict(strict=True)).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &ExportArgs) -> Result<()> {
    let n = crate::translate::export_checkpoint(&args.checkpoint, &args.out)?;
    println!("{}: {n} tensors under the PyTorch baseline's names", args.out.display());
    Ok(())
}
