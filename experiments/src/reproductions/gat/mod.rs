//! `probattn gat`: GAT node classification on the Planetoid citation graphs (Cora, Citeseer,
//! Pubmed) with any attention variant, reproducing Velickovic et al. 2018 and the BAM paper's
//! Table 1. Recipe: docs/formulas.md §2.
//!
//! Data: the canonical `ind.<name>.*` files, verified and converted by python/probattn_tools/data/planetoid.py
//! (Python pickles; read there with a restricted unpickler) into tensors. Training is full-batch
//! with Adam and L2 on all weights; early stopping as the original: the patience counter resets
//! when validation accuracy ≥ its best or validation loss ≤ its best, the checkpoint is kept when
//! both hold; the test accuracy is that checkpoint's, in eval mode.

mod data;
mod presets;
mod train;

pub use data::{default_data_dir, load_graph, Graph};
pub use presets::{bam_preset, default_prior_scope, GatRunConfig};
pub use train::{train_run, RunResult};

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use clap::{Args, ValueEnum};
use probattn::normalize::PriorScope;
use probattn::Variant;
use serde::{Deserialize, Serialize};
use tch::Device;

use crate::common::CommonArgs;
use crate::harness::{seeds, MetricsLog};
use crate::provenance::{run_dir, write_json, write_results, Provenance};
pub use crate::report::mean_std;
use crate::report::spinner;
use presets::parse_prior_scope;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dataset {
    Cora,
    Citeseer,
    Pubmed,
}

impl Dataset {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cora => "cora",
            Self::Citeseer => "citeseer",
            Self::Pubmed => "pubmed",
        }
    }
}

/// Flags of `probattn gat`.
#[derive(Args, Debug)]
pub struct GatArgs {
    /// Dataset: cora, citeseer or pubmed.
    #[arg(long, value_enum)]
    pub dataset: Dataset,
    /// Attention variant (softmax, dnas, hnas, sinkhorn-N, bam-nokl, bam-lf, bam-lc, bam-wf, bam-wc), or all.
    #[arg(long, default_value = "softmax")]
    pub attention: String,
    /// Number of runs, with seeds seed-start, seed-start + 1, ...
    #[arg(long, default_value_t = 10)]
    pub seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    pub seed_start: u64,
    /// Folder with the ind.<dataset>.* files (default: $PROBATTN_DATA/planetoid, data/planetoid
    /// when PROBATTN_DATA is unset; `python -m probattn_tools.data.planetoid download` fetches them).
    #[arg(long, visible_alias = "data")]
    pub data_dir: Option<PathBuf>,
    /// Read ind.<dataset>.* files whose checksums are not the canonical ones: a graph of your own
    /// in Planetoid's file format (`python -m probattn_tools.data.planetoid synth` writes a small one).
    /// results.json records `data_verified: false`.
    #[arg(long)]
    pub unverified: bool,
    /// Output folder (default: runs/gat/<UTC stamp>-<dataset>-<attention>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Stop after this many epochs even without early stopping.
    #[arg(long, default_value_t = 100_000)]
    pub max_epochs: usize,
    /// Early-stopping patience in epochs.
    #[arg(long, default_value_t = 100)]
    pub patience: usize,
    /// Override the preset's BAM Weibull shape k.
    #[arg(long)]
    pub k: Option<f64>,
    /// Override the preset's BAM Lognormal sigma.
    #[arg(long)]
    pub sigma: Option<f64>,
    /// Override the preset's BAM KL weight (the sigmoid schedule's ceiling).
    #[arg(long)]
    pub kl_weight: Option<f64>,
    /// Override the preset's BAM prior beta (Gamma rate; bam-wc, bam-wf).
    #[arg(long)]
    pub prior_beta: Option<f64>,
    /// The contextual prior's scope (bam-wc, bam-lc), and with it the preset chosen for that
    /// scope: `neighbourhood` (a softmax per node over the nodes it attends, the paper's reading)
    /// or `all-nodes` (one softmax over every node, the authors' GAT code). Default: the one
    /// validation preferred for the dataset and variant (bam-wc: Cora all-nodes, Citeseer
    /// neighbourhood; bam-lc: neighbourhood).
    #[arg(long, value_parser = parse_prior_scope)]
    pub prior_scope: Option<PriorScope>,
    #[command(flatten)]
    pub precision: crate::common::PrecisionArgs,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// The results of one configuration over seeds (results.json).
#[derive(Debug, Serialize)]
pub struct GatResults {
    pub dataset: Dataset,
    /// Whether the files' checksums were the canonical ones (false under --unverified).
    pub data_verified: bool,
    pub attention: String,
    pub config: GatRunConfig,
    pub runs: Vec<RunResult>,
    pub test_acc_mean: f64,
    pub test_acc_std: f64,
    pub val_acc_mean: f64,
    pub epoch_ms_mean: f64,
    pub provenance: Provenance,
}

fn run_variant(graph: &Graph, args: &GatArgs, variant: Variant, dir: &Path, device: Device) -> Result<GatResults> {
    let mut cfg = GatRunConfig::preset(args.dataset, variant, args.prior_scope);
    cfg.apply_overrides(args);
    write_json(&dir.join("config.json"), &cfg)?;
    let mut metrics = MetricsLog::create(&dir.join("metrics.jsonl"))?;
    let mut runs = vec![];
    for seed in seeds(args.seed_start, args.seeds) {
        let bar = spinner(format!("{} {variant} seed {seed}:", args.dataset.name()))?;
        let run = train_run(graph, &cfg, seed, device, &bar, &mut metrics)?;
        bar.finish_and_clear();
        println!(
            "{} {:10} seed {seed:3}: test acc {:.4}, val acc {:.4} (epoch {} of {}), {:.1} s, {:.1} ms/epoch",
            args.dataset.name(),
            variant.to_string(),
            run.test_acc,
            run.val_acc,
            run.best_epoch,
            run.epochs,
            run.train_seconds,
            run.epoch_ms
        );
        runs.push(run);
    }
    let tests: Vec<f64> = runs.iter().map(|r| r.test_acc).collect();
    let (test_acc_mean, test_acc_std) = mean_std(&tests);
    let results = GatResults {
        dataset: args.dataset,
        data_verified: !args.unverified,
        attention: variant.to_string(),
        val_acc_mean: mean_std(&runs.iter().map(|r| r.val_acc).collect::<Vec<_>>()).0,
        epoch_ms_mean: mean_std(&runs.iter().map(|r| r.epoch_ms).collect::<Vec<_>>()).0,
        config: cfg,
        runs,
        test_acc_mean,
        test_acc_std,
        provenance: Provenance::gather(device),
    };
    write_results(&dir.join("results.json"), &results)?;
    Ok(results)
}

/// The markdown table of several configurations' results.
pub fn table(results: &[GatResults]) -> String {
    let mut t = String::from(
        "| attention | test acc (mean ± std, %) | val acc (%) | runs | epochs (mean) | ms/epoch |\n|---|---|---|---|---|---|\n",
    );
    for r in results {
        let epochs = r.runs.iter().map(|x| x.epochs as f64).sum::<f64>() / r.runs.len() as f64;
        t += &format!(
            "| {} | {:.2} ± {:.2} | {:.2} | {} | {:.0} | {:.1} |\n",
            r.attention,
            100.0 * r.test_acc_mean,
            100.0 * r.test_acc_std,
            100.0 * r.val_acc_mean,
            r.runs.len(),
            epochs,
            r.epoch_ms_mean
        );
    }
    t
}

pub fn run(args: &GatArgs) -> Result<()> {
    let device = args.common.setup()?;
    let _precision = args.precision.begin(device)?;
    ensure!(args.seeds >= 1, "--seeds must be at least 1");
    ensure!(args.max_epochs >= 1 && args.patience >= 1, "--max-epochs and --patience must be at least 1");
    let variants: Vec<Variant> = if args.attention == "all" {
        // Every variant of the registry, in its order (the papers' tables').
        probattn::normalize::registry::examples().iter().map(|v| v.parse()).collect::<probattn::Result<_>>()?
    } else {
        vec![args.attention.parse().context("--attention")?]
    };
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let graph = load_graph(args.dataset, &data_dir, !args.unverified, device)?;
    println!(
        "{}: {} nodes, {} features, {} classes, {} edges with self-loops; train/val/test {}/{}/{}; device {}, {} threads",
        args.dataset.name(),
        graph.nodes(),
        graph.features.features(),
        graph.classes,
        graph.support.edges().map_or(0, |e| e.len()),
        graph.train.size()[0],
        graph.val.size()[0],
        graph.test.size()[0],
        probattn::device::device_name(device),
        tch::get_num_threads()
    );
    let dir = run_dir(args.out.as_deref(), "gat", &format!("{}-{}", args.dataset.name(), args.attention))?;
    let mut all = vec![];
    for variant in variants {
        let sub = if args.attention == "all" { dir.join(variant.to_string()) } else { dir.clone() };
        std::fs::create_dir_all(&sub)?;
        all.push(run_variant(&graph, args, variant, &sub, device)?);
    }
    let table = table(&all);
    let plural = if args.seeds == 1 { "" } else { "s" };
    println!("\n{} ({} seed{plural} from {}):\n{table}", args.dataset.name(), args.seeds, args.seed_start);
    if args.attention == "all" {
        probattn::io::write_bytes_atomic(&dir.join("summary.md"), table.as_bytes())?;
    }
    println!("results in {}", dir.display());
    Ok(())
}
