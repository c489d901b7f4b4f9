//! `probattn vqa`: the DNAS paper's multi-view VQA fusion (Ding et al. 2020, Sec. 6.1, Table 1,
//! Fig. 1 and 3, Appendix B) and the BAM paper's VQA uncertainty measures (Fan et al. 2020,
//! Sec. 4.2), on Sort-of-CLEVR (our seeded generator) and easy-VQA, and on VQA-v2 for users who
//! have its files and detector features ([`v2`]). Facts and recipe: docs/formulas.md §1, §2
//! and §4.
//!
//! Pipeline: python/probattn_tools/data/vqa.py writes images, questions and detector labels;
//! python/probattn_tools/data/vqa_detectors.py trains three CNN backbones on those labels (training images only) and saves
//! them as TorchScript; here they are loaded with libtorch, run once over every image, and their
//! region features cached; then [`probattn_models::vqa::VqaModel`] (fusion + Pythia-lite head) is
//! trained per seed with Adam and early stopping on validation accuracy, and the kept weights
//! answer the test questions. Reports: accuracy per question type, the mass every secondary box
//! receives (Fig. 1), HNAS's `u` during training (Fig. 3), and for stochastic fusions Monte Carlo
//! prediction with PAvPU and calibration error, clean and with noisy features.

mod args;
pub mod data;
mod features;
mod inputs;
mod report;
mod train;
pub mod uncertainty;
pub mod v2;

pub use args::{Dataset, VqaArgs};
pub use report::{table, ExplainedAway};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use probattn::normalize::BamConfig;
use probattn::precision::Precision;
use probattn::{NormalizerConfig, Variant};
use probattn_models::vqa::VqaConfig;
use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

use crate::harness::{seeds, MetricsLog};
use crate::plot::{line_chart, Series};
use crate::provenance::{run_dir, write_json, write_results, Provenance};
use crate::ranks::Ranks;
use crate::report::mean_std;
use args::{default_data_dir, detector_dir};
use data::{DetectorSpec, Meta, Views, VqaData};
use inputs::{add_noise, load_data};
use report::{explained_away, log_mass_points};
use train::{official_test, score, train_run, Trace};
use uncertainty::{McReport, McSettings};

/// The fusions `--fusion all` trains, in Table 1's order, then HNAS and BAM.
pub const ALL_FUSIONS: [&str; 5] = ["none", "softmax", "dnas", "hnas", "bam-wc"];

/// Everything that defines one configuration's runs (config.json, results.json).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VqaRunConfig {
    pub dataset: String,
    pub model: VqaConfig,
    pub detectors: Vec<DetectorSpec>,
    pub lr: f64,
    /// `--lr-decay` (1: constant; configs from before the flag had none).
    #[serde(default = "no_decay")]
    pub lr_decay: f64,
    #[serde(default = "default_lr_patience")]
    pub lr_patience: usize,
    pub batch: i64,
    pub max_epochs: usize,
    pub patience: usize,
    /// The KL term's weight (BAM with a prior).
    pub kl_weight: f64,
    pub noisy_view: Option<usize>,
    pub noise_std: Option<f64>,
    pub eval_noise: f64,
    pub mc_samples: usize,
    /// `--image-noise`.
    #[serde(default)]
    pub image_noise: Option<f64>,
    /// Where the BAM settings come from.
    pub preset: String,
    /// The precision of training and evaluation (absent from configs written before it: float32).
    #[serde(default)]
    pub precision: Precision,
}

fn no_decay() -> f64 {
    1.0
}

fn default_lr_patience() -> usize {
    2
}

/// BAM's settings for VQA: the BAM authors' ALBERT script (k = 10, KL weight 1, prior hidden 10;
/// docs/formulas.md §2); their VQA values are not published. Not tuned here yet.
fn bam_preset(variant: Variant) -> (String, BamConfig, f64) {
    match variant {
        Variant::Bam(_) => {
            ("BAM authors' ALBERT script defaults (k 10, KL weight 1); not tuned".into(), BamConfig { k: 10.0, ..Default::default() }, 1.0)
        }
        _ => ("none".into(), BamConfig::default(), 0.0),
    }
}

/// One run's outcome.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub seed: u64,
    pub val_acc: f64,
    pub test_acc: f64,
    /// Test accuracy per question type.
    pub test_acc_by_type: BTreeMap<String, f64>,
    /// Test accuracy over the relational and the non-relational types (Sort-of-CLEVR).
    pub test_acc_relational: Option<f64>,
    pub test_acc_nonrelational: Option<f64>,
    pub best_epoch: usize,
    pub epochs: usize,
    pub train_seconds: f64,
    /// Wall time per epoch, validation included.
    pub epoch_seconds: f64,
    /// Time per epoch in the update loop alone (batches, forward, backward, Adam): what
    /// python/probattn_tools/baselines/vqa.py times, for the speed ratio.
    pub update_seconds: f64,
    /// HNAS: the final `u` of each secondary view.
    pub hnas_u: Option<Vec<f64>>,
    /// The fusion weights on the test images (attention fusions).
    pub explained_away: Option<ExplainedAway>,
    /// Monte Carlo prediction, PAvPU and calibration (every attention fusion).
    pub uncertainty: Option<McReport>,
    /// VQA-v2: the official evaluation of `test_results-seed<N>.json` on val2014 (0-100); the
    /// run's `test_acc` and `test_acc_by_type` (answer types) are taken from it.
    #[serde(default)]
    pub official: Option<crate::vqa_eval::Accuracy>,
}

/// The loaded data and features.
struct Prepared {
    data: VqaData,
    views: Views,
    /// `--image-noise`: its standard deviation and the features of the noised images.
    noisy_image: Option<(f64, Views)>,
}

/// The results of one fusion over seeds (results.json).
#[derive(Debug, Serialize)]
pub struct VqaResults {
    pub dataset: String,
    pub fusion: String,
    pub config: VqaRunConfig,
    pub runs: Vec<RunResult>,
    pub test_acc_mean: f64,
    pub test_acc_std: f64,
    pub test_acc_by_type_mean: BTreeMap<String, f64>,
    pub test_acc_relational_mean: Option<f64>,
    pub test_acc_relational_std: Option<f64>,
    pub test_acc_nonrelational_mean: Option<f64>,
    pub test_acc_nonrelational_std: Option<f64>,
    pub val_acc_mean: f64,
    pub epoch_seconds_mean: f64,
    /// Where the features came from.
    pub features: String,
    /// World size, backend and restarts of a run under torchrun; absent for one process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distributed: Option<crate::ranks::DistInfo>,
    pub provenance: Provenance,
}

/// One fusion's configuration, checked: built before the run folder exists, so that a bad flag is
/// named and nothing is written.
fn run_config(p: &Prepared, args: &VqaArgs, fusion: Option<Variant>, detectors: &[DetectorSpec]) -> Result<VqaRunConfig> {
    let (preset, mut bam, mut kl_weight) = bam_preset(fusion.unwrap_or_default());
    let mut preset = preset;
    if let Some(k) = args.k {
        bam.k = k;
        preset += " with --k";
    }
    if let (Some(w), Some(Variant::Bam(_))) = (args.kl_weight, fusion) {
        kl_weight = w;
        preset += " with --kl-weight";
    }
    let meta = &p.data.meta;
    let model = VqaConfig {
        view_regions: p.views.shapes().iter().map(|s| s.0).collect(),
        feature_dim: p.views.shapes()[0].1,
        fusion,
        key_dim: p.views.shapes()[0].1,
        attention_dropout: args.attention_dropout.unwrap_or(if args.memory.memory_efficient { 0.0 } else { 0.1 }),
        normalizer: NormalizerConfig { hybrid_init_u: 0.5, bam },
        vocab: meta.vocab.len() as i64,
        word_dim: 64,
        question_encoder: args.question_encoder.parse()?,
        question_dim: 128,
        hidden: args.hidden,
        reasoning_layers: args.reasoning_layers,
        reasoning_prenorm: args.reasoning_prenorm,
        reasoning_heads: 4,
        relational_heads: args.relational_heads,
        relational_dim: args.relational_dim,
        primary_skip: args.primary_skip && fusion.is_some(),
        primary_beside: args.primary_beside && fusion.is_some(),
        glimpses: args.glimpses,
        dropout: 0.1,
        answers: meta.answers.len() as i64,
        tile: args.memory.tile(),
    };
    let cfg = VqaRunConfig {
        dataset: meta.dataset.clone(),
        model,
        detectors: detectors.to_vec(),
        lr: args.lr,
        lr_decay: args.lr_decay,
        lr_patience: args.lr_patience,
        batch: args.batch,
        max_epochs: args.max_epochs,
        patience: args.patience,
        kl_weight,
        noisy_view: args.noisy_view,
        noise_std: args.noise_std,
        eval_noise: args.eval_noise,
        mc_samples: args.mc_samples,
        image_noise: args.image_noise,
        preset,
        precision: args.precision.precision,
    };
    cfg.model.validate()?;
    Ok(cfg)
}

/// Trains and tests every seed of one fusion in `dir`; writes its results.json. Under several
/// ranks, every rank trains; rank 0 alone tests beyond the accuracy, and writes.
fn run_fusion(
    p: &Prepared,
    args: &VqaArgs,
    cfg: VqaRunConfig,
    features: &str,
    dir: &Path,
    device: Device,
    ranks: &Ranks,
) -> Result<Option<VqaResults>> {
    let (fusion, meta) = (cfg.model.fusion, &p.data.meta);
    let mut metrics = None;
    if ranks.is_main() {
        write_json(&dir.join("config.json"), &cfg)?;
        metrics = Some(MetricsLog::create(&dir.join("metrics.jsonl"))?);
    }
    let mut runs = vec![];
    let mut traces = vec![];
    for seed in seeds(args.seed_start, args.seeds) {
        let mut trace = Trace::default();
        let (mut run, model) = train_run(p, &cfg, seed, device, metrics.as_mut(), &mut trace, ranks)?;
        if !ranks.is_main() {
            continue;
        }
        if p.data.meta.dataset == Dataset::VqaV2.name() {
            let official = official_test(&model, p, &dir.join(format!("test_results-seed{seed}.json")), device)?;
            run.test_acc = official.overall / 100.0;
            run.test_acc_by_type = official.per_answer_type.iter().map(|(t, a)| (t.clone(), a / 100.0)).collect();
            run.official = Some(official);
        }
        run.explained_away = explained_away(&model, p)?;
        if let Some(variant) = fusion {
            let samples = McSettings::samples_for(variant.is_stochastic(), cfg.mc_samples);
            let settings = McSettings { samples, eval_noise: cfg.eval_noise, seed };
            run.uncertainty = Some(uncertainty::report(&model, p, &settings, device)?);
        }
        traces.push((seed, trace));
        print_run(&meta.dataset, &cfg.model.fusion_name(), seed, &run);
        runs.push(run);
    }
    if !ranks.is_main() {
        return Ok(None);
    }
    fusion_plots(dir, &cfg, meta, args.seeds, &traces, &runs)?;
    let stats = |f: &dyn Fn(&RunResult) -> Option<f64>| {
        let v: Vec<f64> = runs.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| mean_std(&v))
    };
    let (test_acc_mean, test_acc_std) = mean_std(&runs.iter().map(|r| r.test_acc).collect::<Vec<_>>());
    let rel = stats(&|r| r.test_acc_relational);
    let nonrel = stats(&|r| r.test_acc_nonrelational);
    let test_acc_by_type_mean =
        meta.types.iter().map(|t| (t.clone(), mean_std(&runs.iter().map(|r| r.test_acc_by_type[t]).collect::<Vec<_>>()).0)).collect();
    let results = VqaResults {
        dataset: meta.dataset.clone(),
        fusion: cfg.model.fusion_name(),
        val_acc_mean: mean_std(&runs.iter().map(|r| r.val_acc).collect::<Vec<_>>()).0,
        epoch_seconds_mean: mean_std(&runs.iter().map(|r| r.epoch_seconds).collect::<Vec<_>>()).0,
        config: cfg,
        runs,
        test_acc_mean,
        test_acc_std,
        test_acc_by_type_mean,
        test_acc_relational_mean: rel.map(|s| s.0),
        test_acc_relational_std: rel.map(|s| s.1),
        test_acc_nonrelational_mean: nonrel.map(|s| s.0),
        test_acc_nonrelational_std: nonrel.map(|s| s.1),
        features: features.to_string(),
        distributed: ranks.info(),
        provenance: Provenance::gather(device),
    };
    write_results(&dir.join("results.json"), &results)?;
    Ok(Some(results))
}

/// One fusion's plots: HNAS's u during training (Fig. 3), validation accuracy per question type,
/// and the received mass of the secondary boxes (Fig. 1).
fn fusion_plots(dir: &Path, cfg: &VqaRunConfig, meta: &Meta, seeds: u64, traces: &[(u64, Trace)], runs: &[RunResult]) -> Result<()> {
    let series: Vec<Series> = traces
        .iter()
        .filter(|(_, t)| !t.gates.is_empty())
        .flat_map(|(seed, t)| {
            (0..t.gates[0].1.len()).map(move |view| Series {
                name: format!("seed {seed}, view {}", view + 1),
                points: t.gates.iter().map(|(s, u)| (*s, u[view])).collect(),
            })
        })
        .collect();
    if !series.is_empty() {
        line_chart(&dir.join("hnas_u.svg"), "HNAS mixing weight u during training (Fig. 3)", "update", "u", &series)?;
    }
    // One curve per question type (and seed): a type learned late (Sort-of-CLEVR's closest) shows here.
    let series: Vec<Series> = traces
        .iter()
        .flat_map(|(seed, t)| {
            meta.types.iter().enumerate().map(move |(k, ty)| Series {
                name: if seeds == 1 { ty.clone() } else { format!("seed {seed}, {ty}") },
                points: t.val_by_type.iter().map(|(e, acc)| (*e, acc[k])).collect(),
            })
        })
        .collect();
    line_chart(
        &dir.join("val_acc.svg"),
        &format!("validation accuracy per question type, {}", cfg.model.fusion_name()),
        "epoch",
        "accuracy",
        &series,
    )?;
    let series: Vec<Series> = runs
        .iter()
        .filter_map(|r| r.explained_away.as_ref().map(|e| Series { name: format!("seed {}", r.seed), points: log_mass_points(&[e]) }))
        .collect();
    if !series.is_empty() {
        line_chart(
            &dir.join("log_mass.svg"),
            &format!("log Σ_i π_ij per secondary box, {} (Fig. 1)", cfg.model.fusion_name()),
            "log received mass",
            "share of boxes",
            &series,
        )?;
    }
    Ok(())
}

/// `--eval-torchscript`: the module's accuracy per split and question type (eval_torchscript.json).
fn eval_torchscript(p: &Prepared, path: &Path, args: &VqaArgs, device: Device) -> Result<()> {
    let module = probattn::interop::TorchScript::load(path, device)?;
    let predict = |views: &[Tensor], tokens: &Tensor| -> Result<Tensor> {
        let mut inputs: Vec<tch::IValue> = views.iter().map(|v| tch::IValue::Tensor(v.shallow_clone())).collect();
        inputs.push(tch::IValue::Tensor(tokens.shallow_clone()));
        let out = module.forward_tensors(&inputs)?;
        let [(_, logits)] = <[_; 1]>::try_from(out)
            .map_err(|o: Vec<_>| anyhow::anyhow!("{} returned {} tensors; expected the logits alone", path.display(), o.len()))?;
        Ok(logits)
    };
    let start = Instant::now();
    let (val_acc, _) = score(p, "val", device, &predict)?;
    let (test_acc, per_type) = score(p, "test", device, &predict)?;
    let seconds = start.elapsed().as_secs_f64();
    let by_type: BTreeMap<String, f64> =
        p.data.meta.types.iter().zip(&per_type).map(|(t, (h, n))| (t.clone(), *h / (*n).max(1) as f64)).collect();
    let dir = run_dir(args.out.as_deref(), "vqa", &format!("{}-torchscript", args.dataset.name()))?;
    let report = serde_json::json!({"torchscript": path, "val_acc": val_acc, "test_acc": test_acc, "test_acc_by_type": by_type, "seconds": seconds, "provenance": Provenance::gather(device)});
    write_results(&dir.join("eval_torchscript.json"), &report)?;
    println!(
        "{}: val acc {val_acc:.4}, test acc {test_acc:.4} ({}), {seconds:.1} s",
        path.display(),
        by_type.iter().map(|(t, a)| format!("{t} {a:.4}")).collect::<Vec<_>>().join(", ")
    );
    println!("results in {}", dir.display());
    Ok(())
}

pub fn run(args: &VqaArgs) -> Result<()> {
    let device = args.common.setup()?;
    let _precision = args.precision.begin(device)?;
    let (ranks, device) = Ranks::join(&args.dist, device)?;
    let quick;
    let args = if args.quick {
        quick = VqaArgs { seeds: 1, max_epochs: args.max_epochs.min(4), mc_samples: args.mc_samples.min(5), ..args.clone() };
        &quick
    } else {
        args
    };
    check_args(args)?;
    let fusions: Vec<Option<Variant>> = if args.fusion == "all" { ALL_FUSIONS.to_vec() } else { vec![args.fusion.as_str()] }
        .into_iter()
        .map(|f| if f == "none" { Ok(None) } else { f.parse::<Variant>().map(Some).context("--fusion") })
        .collect::<Result<_>>()?;
    let data_dir = args.data.clone().unwrap_or_else(|| default_data_dir(args.dataset, args.quick));
    let start = Instant::now();
    // The manifest of the detectors probattn trained or found (their files' sha256 and validation
    // metrics), copied beside results.json: retraining them on another machine can give other
    // detectors, and the features' cache key does not say which ones a run used.
    let manifest =
        (args.dataset != Dataset::VqaV2 && args.detector.is_empty()).then(|| detector_dir(args, &data_dir).1.join("detectors.json"));
    // Rank 0 first: whatever the data needs made (detectors, feature caches) is made once.
    if !ranks.is_main() {
        ranks.barrier()?;
    }
    let (data, mut views, detectors, features_note) = load_data(args, &data_dir, device, start)?;
    if ranks.is_main() {
        ranks.barrier()?;
    }
    let noisy_image = add_noise(args, &data, &mut views, &detectors, device)?;
    print_data(&data, &views, &detectors, device);
    let prepared = Prepared { data, views, noisy_image };
    if let Some(path) = &args.eval_torchscript {
        anyhow::ensure!(ranks.world_size() == 1, "--eval-torchscript runs in one process, not under torchrun");
        return eval_torchscript(&prepared, path, args, device);
    }
    let configs = fusions.into_iter().map(|f| run_config(&prepared, args, f, &detectors)).collect::<Result<Vec<_>>>()?;
    if !ranks.is_main() {
        // Training alongside rank 0, which writes everything.
        for cfg in configs {
            run_fusion(&prepared, args, cfg, &features_note, Path::new(""), device, &ranks)?;
        }
        return Ok(());
    }
    let dir = run_dir(args.out.as_deref(), "vqa", &format!("{}-{}", args.dataset.name(), args.fusion))?;
    if let Some(path) = manifest {
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        probattn::io::write_bytes_atomic(&dir.join("detectors.json"), &bytes)?;
    }
    let mut all = vec![];
    for cfg in configs {
        let sub = if args.fusion == "all" { dir.join(cfg.model.fusion_name()) } else { dir.clone() };
        std::fs::create_dir_all(&sub)?;
        all.extend(run_fusion(&prepared, args, cfg, &features_note, &sub, device, &ranks)?);
    }
    let table = table(&all);
    println!("\n{} ({} seed(s) from {}):\n{table}", args.dataset.name(), args.seeds, args.seed_start);
    probattn::io::write_bytes_atomic(&dir.join("summary.md"), table.as_bytes())?;
    if all.len() > 1 {
        log_mass_chart(&all, &dir.join("log_mass.svg"))?;
    }
    println!("results in {}", dir.display());
    Ok(())
}

/// One line per trained seed: its test and validation accuracy, and its time.
fn print_run(dataset: &str, fusion: &str, seed: u64, run: &RunResult) {
    println!(
        "{dataset} {fusion:8} seed {seed:3}: test acc {:.4} (relational {}, non-relational {}), val acc {:.4} (epoch {} of {}), {:.1} s/epoch",
        run.test_acc,
        run.test_acc_relational.map_or("-".into(), |a| format!("{a:.4}")),
        run.test_acc_nonrelational.map_or("-".into(), |a| format!("{a:.4}")),
        run.val_acc,
        run.best_epoch,
        run.epochs,
        run.epoch_seconds
    );
}

/// One line on the data: images, answers, questions per split, the views and the device.
fn print_data(data: &VqaData, views: &Views, detectors: &[DetectorSpec], device: Device) {
    let split = |s: &str| data.splits[s].len();
    println!(
        "{}: {} images, {} answers, train/val/test questions {}/{}/{}; views {}; device {}, {} threads",
        data.meta.dataset,
        data.image_count,
        data.meta.answers.len(),
        split("train"),
        split("val"),
        split("test"),
        detectors.iter().zip(views.shapes()).map(|(d, s)| format!("{} [{}, {}]", d.name, s.0, s.1)).collect::<Vec<_>>().join(", "),
        probattn::device::device_name(device),
        tch::get_num_threads()
    );
}

/// The fusions' received mass per secondary box on the test images, one curve each, as the BAM
/// paper's Fig. 1 draws it.
fn log_mass_chart(all: &[VqaResults], path: &Path) -> Result<()> {
    let series: Vec<Series> = all
        .iter()
        .filter_map(|r| {
            let reports: Vec<&ExplainedAway> = r.runs.iter().filter_map(|x| x.explained_away.as_ref()).collect();
            (!reports.is_empty()).then(|| Series { name: r.fusion.clone(), points: log_mass_points(&reports) })
        })
        .collect();
    line_chart(path, "log Σ_i π_ij per secondary box on the test images (Fig. 1)", "log received mass", "share of boxes", &series)
}

/// Refuses flags that cannot work together, or values out of range, by name.
fn check_args(args: &VqaArgs) -> Result<()> {
    ensure!(args.seeds >= 1, "--seeds must be at least 1");
    ensure!(args.max_epochs >= 1 && args.patience >= 1, "--max-epochs and --patience must be at least 1");
    ensure!(args.batch >= 1, "--batch must be at least 1");
    if let Some(p) = args.attention_dropout {
        ensure!((0.0..1.0).contains(&p), "--attention-dropout must lie in [0, 1), got {p}");
        ensure!(
            p == 0.0 || !args.memory.memory_efficient,
            "--memory-efficient has no attention dropout (the weights are never formed): --attention-dropout must be 0 with it, got {p}"
        );
    }
    ensure!(args.detector_epochs != Some(0), "--detector-epochs must be at least 1");
    ensure!(
        (args.detectors.is_none() && args.detector.is_empty()) || (args.detector_epochs.is_none() && args.detector_boxes == 0),
        "--detector-epochs and --detector-boxes set how probattn trains its own detectors; they do not apply to --detectors / --detector"
    );
    ensure!(args.lr > 0.0 && args.lr.is_finite(), "--lr must be positive");
    ensure!(args.lr_decay > 0.0 && args.lr_decay <= 1.0, "--lr-decay must be in (0, 1], got {}", args.lr_decay);
    ensure!(args.lr_patience >= 1, "--lr-patience must be at least 1");
    ensure!(args.mc_samples >= 2, "--mc-samples must be at least 2 (PAvPU's t-test compares samples)");
    ensure!(
        args.relational_heads >= 0 && args.relational_dim >= 1,
        "--relational-heads must be 0 or more and --relational-dim at least 1, got {} and {}",
        args.relational_heads,
        args.relational_dim
    );
    if let Some(s) = args.noise_std {
        ensure!(s >= 0.0 && s.is_finite(), "--noise-std must be a non-negative number, got {s}");
    }
    Ok(())
}
