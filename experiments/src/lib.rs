//! The `probattn` command line: each subcommand's arguments and logic live in a module, the
//! reproductions of the papers' experiments under `reproductions/`, the metrics with their
//! commands under `metrics/` and the other commands under `tools/`, with what they share at the
//! top (`seq2seq`, `common`, `harness`, `report`, `plot`, `provenance`, `ranks`); the binary
//! (`src/main.rs`) only parses and dispatches.

// `x = x + y` stays: on tch tensors `x += y` is an in-place `add_`, which would overwrite a value
// autograd saved for the backward pass.
#![allow(clippy::assign_op_pattern)]
// The `///` lines on the argument structs are clap's `--help` text, written for a terminal
// (`<UTC stamp>`, `'{"layers":[0]}'`), not markdown: rustdoc would read them as HTML tags and links.
#![allow(rustdoc::invalid_html_tags, rustdoc::broken_intra_doc_links)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

// Top-down: the commands (`tools`, `reproductions`) on what they share (`seq2seq`, translation's
// data and decoding; `metrics`), on the helpers of every command (`common`, `harness`, `plot`,
// `provenance`, `ranks`, `report`). `tools`, `reproductions` and `metrics` are folders of the
// source: each command's module has one path, at the crate root.
pub mod common;
pub mod harness;
mod metrics;
pub mod plot;
pub mod provenance;
pub mod ranks;
pub mod report;
mod reproductions;
pub mod seq2seq;
mod tools;

pub use metrics::{bleu, vqa_eval};
pub use reproductions::{gat, translate, vqa};
pub use tools::{attend, bench, compare, curves, doctor, export, finetune, variants};

use clap::{Parser, Subcommand};

/// probattn: probabilistic attention on libtorch (DNAS, HNAS, Sinkhorn, Bayesian and repulsive
/// attention) and the papers' reproductions.
#[derive(Parser, Debug)]
#[command(name = "probattn", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Report tch and libtorch versions, threads, CUDA and cuDNN.
    Doctor(doctor::DoctorArgs),
    /// Apply one attention variant to q, k, v read from a safetensors file.
    Attend(attend::AttendArgs),
    /// GAT node classification on Cora, Citeseer or Pubmed with any attention variant.
    Gat(gat::GatArgs),
    /// Time every normalizer and the SVGD hook against PyTorch, in one invocation.
    Bench(bench::BenchArgs),
    /// Corpus BLEU of a system output against references, as sacreBLEU computes it.
    Bleu(bleu::BleuArgs),
    /// Transformer translation (Multi30k, IWSLT14) with any attention variant and repulsive heads.
    Translate(Box<translate::TranslateArgs>),
    /// A TorchScript module or .pt2 package against the native probattn model with its weights: differences and time.
    Compare(compare::CompareArgs),
    /// A trained translate checkpoint's weights as a PyTorch state dict (the baseline's names).
    Export(export::ExportArgs),
    /// Multi-view VQA fusion (UNAS, DNAS, HNAS, BAM) on Sort-of-CLEVR or easy-VQA, with reports.
    Vqa(Box<vqa::VqaArgs>),
    /// The official VQA accuracy of a results file (overall, per answer type, per question type).
    VqaEval(vqa_eval::VqaEvalArgs),
    /// The attention variants: what each is, its family, properties and settings (--json for scripts).
    Variants(variants::VariantsArgs),
    /// Training curves of several runs on one chart (a metrics.jsonl column against the epoch), as SVG.
    Plot(curves::PlotArgs),
}

pub fn run(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Doctor(args) => doctor::run(args),
        Command::Attend(args) => attend::run(args),
        Command::Gat(args) => gat::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Bleu(args) => bleu::run(args),
        Command::Translate(args) => translate::run(args),
        Command::Compare(args) => compare::run(args),
        Command::Export(args) => export::run(args),
        Command::Vqa(args) => vqa::run(args),
        Command::VqaEval(args) => vqa_eval::run(args),
        Command::Variants(args) => variants::run(args),
        Command::Plot(args) => curves::run(args),
    }
}
