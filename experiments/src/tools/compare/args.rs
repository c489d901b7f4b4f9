//! `probattn compare`'s flags.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use probattn::Variant;

use crate::common::CommonArgs;

/// `--native`: which probattn model to pair with the TorchScript module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum NativeModel {
    /// `MultiHeadAttention`, for `torch.nn.MultiheadAttention` (and python/probattn_tools/reference/mha.py's).
    Mha,
    /// The encoder-decoder `Transformer` (with final norms), for `torch.nn.Transformer`.
    Transformer,
    /// The translation model `Seq2Seq`, for python/probattn_tools/baselines/translate.py exported with
    /// `--export-torchscript` (token ids in, logits out).
    Translation,
    /// `Gat` (two layers over an edge list), for python/probattn_tools/baselines/gat.py's model scripted
    /// (dense features `x`, edges `dst`, `src` in; class logits out).
    Gat,
}

/// `--batch-first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BatchFirst {
    /// Found on the first call: the layout under which the native model agrees.
    Auto,
    True,
    False,
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DType {
    /// The inputs' dtype (float32 for random inputs); the module is cast to it.
    Inputs,
    Float32,
    Float64,
}

/// Flags of `probattn compare`.
#[derive(Args, Debug)]
pub struct CompareArgs {
    /// The TorchScript module (saved with torch.jit.script(m).save(PATH) or torch.jit.trace).
    /// Loading it runs the code it carries: load only archives from a source you trust.
    #[arg(long, required_unless_present = "pt2", conflicts_with = "pt2")]
    pub torchscript: Option<PathBuf>,
    /// Or an AOTInductor package (.pt2: torch._inductor.aoti_compile_and_package of a
    /// torch.export program; python/probattn_tools/export/pt2.py), run forward only, at its exported shapes.
    /// It holds a compiled shared library that runs inside this process when the package is
    /// loaded: load only packages from a source you trust.
    #[arg(long)]
    pub pt2: Option<PathBuf>,
    /// The native model that receives the module's weights by name.
    #[arg(long, value_enum)]
    pub native: NativeModel,
    /// Attention heads (mha: not recorded in the weights).
    #[arg(long)]
    pub heads: Option<i64>,
    /// Normalizer of the native model: softmax for torch.nn.MultiheadAttention; dnas, hnas,
    /// sinkhorn-N for python/probattn_tools/reference/mha.py modules of that variant.
    #[arg(long, visible_alias = "attention", default_value = "softmax", value_parser = crate::variants::parse_variant)]
    pub variant: Variant,
    /// safetensors file with the forward arguments by name, in the module's layout (mha: query,
    /// key, value, optional key_padding_mask); without it, random inputs from --seed.
    #[arg(long)]
    pub inputs: Option<PathBuf>,
    /// Seed of the random inputs (without --inputs) and of the backward pass's output gradient.
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
    /// Random inputs: batch size N (gat: a graph of 10·N nodes).
    #[arg(long, default_value_t = 2)]
    pub batch: i64,
    /// Random inputs: query length L.
    #[arg(long, default_value_t = 5)]
    pub tgt_len: i64,
    /// Random inputs: key length S.
    #[arg(long, default_value_t = 7)]
    pub src_len: i64,
    /// The module's input layout: auto (found on the first call), true (N, L, E) or false (L, N, E).
    #[arg(long, value_enum, default_value_t = BatchFirst::Auto)]
    pub batch_first: BatchFirst,
    /// The dtype both sides run in.
    #[arg(long, value_enum, default_value_t = DType::Inputs)]
    pub dtype: DType,
    /// Also compare the gradients of sum(output · G), G drawn from --seed, with respect to the
    /// inputs and every parameter.
    #[arg(long)]
    pub backward: bool,
    /// Timed calls per side (the median is reported), after three warm-up calls; the two sides
    /// alternate call by call.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Translation: the longest sequence the positions cover (the run's max_positions).
    #[arg(long, default_value_t = 1024)]
    pub max_positions: i64,
    /// Translation: also decode this file's sentences greedily with both models and count the
    /// translations that are identical token for token (needs --tokenizer).
    #[arg(long)]
    pub greedy_file: Option<PathBuf>,
    /// Translation: the run's tokenizer.json, for --greedy-file.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// With --greedy-file: only the first N sentences.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Copy the weights that fit and report the rest, instead of refusing a module whose
    /// parameters do not all match the native model's.
    #[arg(long)]
    pub allow_partial: bool,
    /// Print the result as JSON: {"outputs": [{"name", "max_abs_diff", "max_rel_diff"}],
    /// "torchscript_ms", "native_ms", ...}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

impl CompareArgs {
    /// The file given as `--torchscript` or `--pt2`.
    pub(super) fn module_path(&self) -> &std::path::Path {
        self.torchscript.as_deref().or(self.pt2.as_deref()).unwrap_or(std::path::Path::new("(none)"))
    }
}
