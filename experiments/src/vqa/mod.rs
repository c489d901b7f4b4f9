//! `probattn vqa`: the DNAS paper's multi-view VQA fusion (Ding et al. 2020, Sec. 6.1, Table 1,
//! Fig. 1 and 3, Appendix B) and the BAM paper's VQA uncertainty measures (Fan et al. 2020,
//! Sec. 4.2), on Sort-of-CLEVR (our seeded generator) and easy-VQA, and on VQA-v2 for users who
//! have its files and detector features ([`v2`]). Facts and recipe: docs/formulas.md §1, §2
//! and §4.
//!
//! Pipeline: python/vqa_data.py writes images, questions and detector labels; python/
//! vqa_detectors.py trains three CNN backbones on those labels (training images only) and saves
//! them as TorchScript; here they are loaded with libtorch, run once over every image, and their
//! region features cached; then [`probattn_models::vqa::VqaModel`] (fusion + Pythia-lite head) is
//! trained per seed with Adam and early stopping on validation accuracy, and the kept weights
//! answer the test questions. Reports: accuracy per question type, the mass every secondary box
//! receives (Fig. 1), HNAS's `u` during training (Fig. 3), and for stochastic fusions Monte Carlo
//! prediction with PAvPU and calibration error, clean and with noisy features.

pub mod data;
pub mod uncertainty;
pub mod v2;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::{Args, ValueEnum};
use probattn::diagnostics::{received_mass, EXPLAINED_AWAY_EPS};
use probattn::normalize::BamConfig;
use probattn::{Mode, NormalizerConfig, Variant};
use probattn_models::vqa::{VqaConfig, VqaModel};
use serde::{Deserialize, Serialize};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::common::CommonArgs;
use crate::harness::{seeds, BestWeights, MetricsLog};
use crate::plot::{line_chart, Series};
use crate::provenance::{run_dir, run_python, write_json, write_results, Provenance};
use crate::report::{markdown_table, mean_std, progress_bar};
use data::{cached_features, detectors_in, DetectorSpec, Questions, Views, VqaData};
use uncertainty::{McReport, McSettings};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dataset {
    /// Sort-of-CLEVR from our seeded generator (python/vqa_data.py sort-of-clevr).
    SortOfClevr,
    /// easy-VQA from PyPI (python/vqa_data.py easy-vqa installs it).
    EasyVqa,
    /// VQA-v2's official files in --data and one --features folder of .npz files per detector.
    #[value(name = "vqa-v2")]
    VqaV2,
}

impl Dataset {
    pub fn name(self) -> &'static str {
        match self {
            Self::SortOfClevr => "sort-of-clevr",
            Self::EasyVqa => "easy-vqa",
            Self::VqaV2 => "vqa-v2",
        }
    }
}

/// The fusions `--fusion all` trains, in Table 1's order, then HNAS and BAM.
pub const ALL_FUSIONS: [&str; 5] = ["none", "softmax", "dnas", "hnas", "bam-wc"];

/// Flags of `probattn vqa`.
#[derive(Args, Debug, Clone)]
pub struct VqaArgs {
    /// Dataset: sort-of-clevr, easy-vqa or vqa-v2.
    #[arg(long, value_enum, default_value = "sort-of-clevr")]
    pub dataset: Dataset,
    /// Data folder written by python/vqa_data.py (default: data/vqa/<dataset>, or
    /// data/vqa/<dataset>-quick with --quick); generated there when absent. VQA-v2: the folder of
    /// the official question and annotation files (train2014 and val2014).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// VQA-v2: a folder of region features, one `<image_id>.npz` (or COCO_<split>_<id>.npz) with
    /// an `x (boxes, dim)` array per image; once per detector, the primary first.
    #[arg(long = "features")]
    pub features: Vec<PathBuf>,
    /// VQA-v2: the answer vocabulary, the most frequent normalised training answers.
    #[arg(long, default_value_t = 3129)]
    pub answers: usize,
    /// VQA-v2: the share of train2014's images held out for validation (early stopping); val2014
    /// is the test split.
    #[arg(long, default_value_t = 0.05)]
    pub val_fraction: f64,
    /// VQA-v2: hold the features in memory up to this many GB, else read them from disk batch by
    /// batch.
    #[arg(long, default_value_t = 8.0)]
    pub feature_memory_gb: f64,
    /// Folder of detectors written by python/vqa_detectors.py (default: <data>/detectors);
    /// trained there when absent.
    #[arg(long)]
    pub detectors: Option<PathBuf>,
    /// Training epochs of the detectors `probattn vqa` trains itself (default: 8 on
    /// Sort-of-CLEVR, 40 on easy-VQA, whose 3,600 training images give 8 epochs only 450 updates;
    /// 2 with --quick). They go to <data>/detectors-e<N>[-boxes<K>].
    #[arg(long)]
    pub detector_epochs: Option<usize>,
    /// Object detectors: each view returns its K most object-like label-grid cells instead of
    /// every region (python/vqa_detectors.py --boxes; 0: every region). Sort-of-CLEVR places 6
    /// objects per image.
    #[arg(long, default_value_t = 0)]
    pub detector_boxes: usize,
    /// A TorchScript detector, `(B, 3, H, W)` floats in [0, 1] to `(B, regions, dim)`; give it
    /// once per view, the primary first (overrides --detectors).
    #[arg(long = "detector")]
    pub detector: Vec<PathBuf>,
    /// Fusion: none (concatenated views), softmax (UNAS), dnas, hnas, sinkhorn-N, bam-*, or all
    /// (none, softmax, dnas, hnas, bam-wc).
    #[arg(long, default_value = "dnas")]
    pub fusion: String,
    /// Number of runs, with seeds seed-start, seed-start + 1, ...
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    pub seed_start: u64,
    /// Output folder (default: runs/vqa/<UTC stamp>-<dataset>-<fusion>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Stop after this many epochs.
    #[arg(long, default_value_t = 30)]
    pub max_epochs: usize,
    /// Early stopping: epochs without a better validation accuracy.
    #[arg(long, default_value_t = 4)]
    pub patience: usize,
    /// Questions per batch.
    #[arg(long, default_value_t = 64)]
    pub batch: i64,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Multiply the learning rate by this after every --lr-patience epochs without a better
    /// validation accuracy (1: a constant rate). At a constant 5e-4 the per-type validation
    /// accuracy of the object-box runs swings by about a point from epoch to epoch
    /// (results/vqa/sort-of-clevr-objects-e24).
    #[arg(long, default_value_t = 1.0)]
    pub lr_decay: f64,
    /// Epochs without a better validation accuracy before each --lr-decay step.
    #[arg(long, default_value_t = 2)]
    pub lr_patience: usize,
    /// Transformer layers over the fused boxes in the head (0: top-down glimpses alone). Default
    /// 0: on validation, one layer had not started to learn after 4,500 updates where none had
    /// (results/vqa/sort-of-clevr-L0/README.md); relational questions need more than glimpses.
    #[arg(long, default_value_t = 0)]
    pub reasoning_layers: usize,
    /// Pre-norm reasoning layers with their stack's output added to the boxes it started from
    /// (one post-norm layer stalled the head in validation; this one learned:
    /// results/vqa/sort-of-clevr-L0/diagnostics).
    #[arg(long)]
    pub reasoning_prenorm: bool,
    /// Heads of the relational layer before the glimpses (0: none): every box gains, per head, a
    /// softmax summary of the other boxes under a learned metric (closest / furthest) and a count.
    /// It learned Sort-of-CLEVR's closest / furthest on a list of objects, not on our 5×5 grid
    /// (3 points lower there): meant for object-level boxes (results/vqa/sort-of-clevr-relational)
    #[arg(long, default_value_t = 0)]
    pub relational_heads: i64,
    /// Size of each relational head's learned metric
    #[arg(long, default_value_t = 8)]
    pub relational_dim: i64,
    /// Question encoder: gru or lstm (word embeddings through the RNN, its state at the last
    /// word), or bow (the words' mean embedding through a linear map and tanh). On Sort-of-CLEVR's
    /// objects the GRU state left closest questions at 0.66-0.72 where bow reached 0.93
    /// (results/vqa/sort-of-clevr-L0/diagnostics).
    #[arg(long, default_value = "gru", value_parser = ["gru", "lstm", "bow"])]
    pub question_encoder: String,
    /// The head also reads each primary box unfused (`z_i = W y_i + W_P x^P_i`), for attention
    /// fusions (the no-attention baseline reads every view's boxes unfused already; with
    /// `--fusion all` it runs without). The fusion overlays three detectors' features in one
    /// space, and on Sort-of-CLEVR's 7×7 object boxes the attention fusions answered position
    /// questions 1-2 points below the no-attention baseline
    /// (results/vqa/sort-of-clevr-objects-e24/label-grid-7).
    #[arg(long, conflicts_with = "primary_beside")]
    pub primary_skip: bool,
    /// The glimpses read each primary box unfused beside the head's box, after the relational
    /// layer (`[z_i, W_P x^P_i]`), for attention fusions: the position reaches the answer as with
    /// --primary-skip, while what the relational layer compares stays as without it.
    #[arg(long)]
    pub primary_beside: bool,
    /// Memory-efficient fusion (probattn::tiled, every fusion variant): no (N_P, N_s) weights are
    /// formed; the explained-away figure reads the received mass the tiled path returns. The
    /// fusion's attention dropout (0.1 in Appendix B's recipe) becomes 0, as the tiled path has
    /// none; config.json records it.
    #[arg(long)]
    pub memory_efficient: bool,
    /// Primary boxes per tile with --memory-efficient.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(i64).range(1..))]
    pub tile: i64,
    /// Top-down attention glimpses.
    #[arg(long, default_value_t = 2)]
    pub glimpses: i64,
    /// Width of the head.
    #[arg(long, default_value_t = 128)]
    pub hidden: i64,
    /// Make view K (0 = primary) unreliable: Gaussian noise of --noise-std added to its
    /// features in every split.
    #[arg(long, requires = "noise_std")]
    pub noisy_view: Option<usize>,
    /// Standard deviation of --noisy-view's noise.
    #[arg(long, requires = "noisy_view")]
    pub noise_std: Option<f64>,
    /// The BAM paper's noisy test: `scale · N(0, 1)`, one draw broadcast over the batch, added to
    /// every view's test features for the noisy half of the uncertainty report.
    #[arg(long, default_value_t = 1.0)]
    pub eval_noise: f64,
    /// Monte Carlo samples for the uncertainty report of stochastic fusions (BAM: 20);
    /// deterministic fusions take two (they agree, so PAvPU is their accuracy).
    #[arg(long, default_value_t = 20)]
    pub mc_samples: usize,
    /// Also measure the uncertainty report on test images with Gaussian pixel noise of this
    /// standard deviation (pixels in [0, 1], clipped), run through the detectors again.
    #[arg(long)]
    pub image_noise: Option<f64>,
    /// Override the BAM Weibull shape k.
    #[arg(long)]
    pub k: Option<f64>,
    /// Override the BAM KL weight.
    #[arg(long)]
    pub kl_weight: Option<f64>,
    /// Score a TorchScript VQA model (python/baselines/vqa.py --export-torchscript: forward(view0,
    /// view1, view2, tokens) -> logits) on the validation and test questions, instead of training.
    #[arg(long)]
    pub eval_torchscript: Option<PathBuf>,
    /// A smoke test (30 s on 2 idle cores): 1,000 training images, detectors trained 2 epochs,
    /// one seed, at most 4 epochs; every results field is written, but the model is still near
    /// chance (it starts to learn after about 3,000 updates; this is 1,250).
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

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
    /// python/baselines/vqa.py times, for the speed ratio.
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

/// Fig. 1's statistics: the mass `Σ_i π_ij` each secondary box receives, over the test images.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExplainedAway {
    /// Boxes counted (test images x secondary boxes of every view).
    pub boxes: usize,
    /// The share with mass below 1e-8 (the paper's ε-explained-away).
    pub share_below_1e8: f64,
    /// The share with `log mass < -20` (the reading of Fig. 1's cut).
    pub share_log_below_minus20: f64,
    /// The smallest mass times the number of keys (DNAS guarantees >= 1: Theorem 2).
    pub min_mass_times_keys: f64,
    /// The histogram of `log mass` (natural log): bin edges and counts.
    pub log_mass_edges: Vec<f64>,
    pub log_mass_counts: Vec<u64>,
}

const LOG_MASS_BINS: (f64, f64, usize) = (-60.0, 5.0, 65);

fn histogram(values: &[f64]) -> (Vec<f64>, Vec<u64>) {
    let (lo, hi, n) = LOG_MASS_BINS;
    let width = (hi - lo) / n as f64;
    let mut counts = vec![0u64; n];
    for &v in values {
        let b = ((v.clamp(lo, hi - 1e-9) - lo) / width) as usize;
        counts[b.min(n - 1)] += 1;
    }
    ((0..=n).map(|i| lo + width * i as f64).collect(), counts)
}

/// Fig. 1's curve: `(bin centre, share of boxes)` over one or more runs' histograms (same bins).
fn log_mass_points(reports: &[&ExplainedAway]) -> Vec<(f64, f64)> {
    let Some(first) = reports.first() else { return vec![] };
    let total: f64 = reports.iter().map(|e| e.boxes as f64).sum::<f64>().max(1.0);
    (0..first.log_mass_counts.len())
        .map(|i| {
            (
                0.5 * (first.log_mass_edges[i] + first.log_mass_edges[i + 1]),
                reports.iter().map(|e| e.log_mass_counts[i] as f64).sum::<f64>() / total,
            )
        })
        .collect()
}

/// The loaded data and features.
struct Prepared {
    data: VqaData,
    views: Views,
    /// `--image-noise`: its standard deviation and the features of the noised images.
    noisy_image: Option<(f64, Views)>,
}

/// A batch of one split, on the device.
struct Batch {
    views: Vec<Tensor>,
    tokens: Tensor,
    answer: Tensor,
    /// VQA-v2's soft scores `(B, answers)`.
    target: Option<Tensor>,
    kind: Tensor,
}

/// The question rows of a split in order, `size` at a time (evaluation batches).
fn chunks(q: &Questions, size: i64) -> impl Iterator<Item = Tensor> + '_ {
    (0..q.len())
        .step_by(size as usize)
        .map(move |start| Tensor::arange_start(start, (start + size).min(q.len()), (Kind::Int64, Device::Cpu)))
}

fn batch_of(views: &Views, q: &Questions, idx: &Tensor, device: Device) -> Result<Batch> {
    let images = q.image.index_select(0, idx);
    Ok(Batch {
        views: views.gather(&images)?,
        tokens: q.tokens.index_select(0, idx).to_device(device),
        answer: q.answer.index_select(0, idx).to_device(device),
        target: q.target.as_ref().map(|t| t.index_select(0, idx).to_device(device)),
        kind: q.kind.index_select(0, idx),
    })
}

/// The accuracy of each prediction `(B,)`: 1 or 0 against the one answer, or VQA-v2's soft score
/// of the predicted answer (its official accuracy when the answer is in the vocabulary).
fn accuracy_of(b: &Batch, predicted: &Tensor) -> Result<Vec<f64>> {
    let acc = match &b.target {
        Some(t) => t.gather(1, &predicted.unsqueeze(1), false).squeeze_dim(1).to_kind(Kind::Double),
        None => predicted.eq_tensor(&b.answer).to_kind(Kind::Double),
    };
    Ok(Vec::<f64>::try_from(acc.to_device(Device::Cpu))?)
}

/// Accuracy and (summed accuracy, questions) per question type over a split, eval mode.
fn evaluate(model: &VqaModel, p: &Prepared, split: &str, device: Device) -> Result<(f64, Vec<(f64, u64)>)> {
    score(p, split, device, &|views, tokens| Ok(model.forward(views, tokens, Mode::EVAL)?.logits))
}

/// Accuracy and (summed accuracy, questions) per question type of `predict` (views, tokens ->
/// logits `(B, answers)`) over a split, under `no_grad`.
fn score(
    p: &Prepared,
    split: &str,
    device: Device,
    predict: &dyn Fn(&[Tensor], &Tensor) -> Result<Tensor>,
) -> Result<(f64, Vec<(f64, u64)>)> {
    score_and_predict(p, split, device, predict).map(|(acc, per_type, _)| (acc, per_type))
}

/// [`score`], and every predicted answer id in question order.
/// Accuracy, per question type (accuracy, count), and the predicted answers.
type Scored = (f64, Vec<(f64, u64)>, Vec<i64>);

fn score_and_predict(p: &Prepared, split: &str, device: Device, predict: &dyn Fn(&[Tensor], &Tensor) -> Result<Tensor>) -> Result<Scored> {
    let q = &p.data.splits[split];
    let types = p.data.meta.types.len();
    let answers = p.data.meta.answers.len() as i64;
    let mut per_type = vec![(0f64, 0u64); types];
    let mut predicted = Vec::with_capacity(q.len() as usize);
    tch::no_grad(|| -> Result<()> {
        for idx in chunks(q, 1024) {
            let b = batch_of(&p.views, q, &idx, device)?;
            let logits = predict(&b.views, &b.tokens)?;
            ensure!(
                logits.size() == [idx.size()[0], answers],
                "the model returned logits of shape {:?} for {} questions; expected ({}, {answers}) (one score per answer of meta.json)",
                logits.size(),
                idx.size()[0],
                idx.size()[0]
            );
            let best = logits.argmax(-1, false);
            let acc = accuracy_of(&b, &best)?;
            predicted.extend(Vec::<i64>::try_from(best.to_device(Device::Cpu))?);
            let kind = Vec::<i64>::try_from(&b.kind)?;
            for (a, k) in acc.into_iter().zip(kind) {
                per_type[k as usize].0 += a;
                per_type[k as usize].1 += 1;
            }
        }
        Ok(())
    })?;
    let (hit, total) = per_type.iter().fold((0.0, 0), |a, t| (a.0 + t.0, a.1 + t.1));
    Ok((hit / total.max(1) as f64, per_type, predicted))
}

/// Fig. 1: the received mass of every secondary box on the test images, per view summed over
/// the primary's boxes (eval mode: deterministic weights).
fn explained_away(model: &VqaModel, p: &Prepared) -> Result<Option<ExplainedAway>> {
    if model.config().fusion.is_none() {
        return Ok(None);
    }
    let q = &p.data.splits["test"];
    let images = q.image.unique_dim(0, true, false, false).0; // the test images, once each
    let (mut logs, mut min_scaled) = (vec![], f64::INFINITY);
    tch::no_grad(|| -> Result<()> {
        for start in (0..images.size()[0]).step_by(256) {
            let rows = images.narrow(0, start, 256.min(images.size()[0] - start));
            let fused = model.fusion.forward(&p.views.gather(&rows)?, Mode::EVAL)?;
            // (B, 1, N_s) per view, in float64 (the log of a float32 underflow is -inf); from the
            // weights, or from the memory-efficient fusion's received mass.
            let masses: Vec<Tensor> = if fused.weights.is_empty() {
                fused.received_mass.iter().map(|m| m.to_kind(Kind::Double)).collect()
            } else {
                fused.weights.iter().map(|w| received_mass(&w.to_kind(Kind::Double))).collect()
            };
            for mass in &masses {
                let mass = mass.squeeze_dim(1);
                let keys = mass.size()[1] as f64;
                min_scaled = min_scaled.min(f64::try_from(mass.min())? * keys);
                logs.extend(Vec::<f64>::try_from(mass.log().clamp_min(-745.0).flatten(0, -1).to_device(Device::Cpu))?);
            }
        }
        Ok(())
    })?;
    let n = logs.len().max(1) as f64;
    let (edges, counts) = histogram(&logs);
    let report = ExplainedAway {
        boxes: logs.len(),
        share_below_1e8: logs.iter().filter(|&&l| l < EXPLAINED_AWAY_EPS.ln()).count() as f64 / n,
        share_log_below_minus20: logs.iter().filter(|&&l| l < -20.0).count() as f64 / n,
        min_mass_times_keys: min_scaled,
        log_mass_edges: edges,
        log_mass_counts: counts,
    };
    Ok(Some(report))
}

/// What one run records for its plots: HNAS's `u` every 50 updates (`(update, u per view)`) and the
/// validation accuracy per question type after every epoch (`(epoch, accuracy per type)`, the types
/// in `meta.json`'s order).
/// One epoch's line of metrics.jsonl (fields in the order the file has always had them).
#[derive(Debug, Serialize)]
struct EpochMetrics {
    epoch: usize,
    /// HNAS's `u` per secondary view.
    hnas_u: Option<Vec<f64>>,
    /// The mean KL term of the epoch's updates (0 without one).
    kl: f64,
    lr: f64,
    /// Since the seed's training began.
    seconds: f64,
    seed: u64,
    train_loss: f64,
    val_acc: f64,
    val_acc_by_type: BTreeMap<String, f64>,
}

#[derive(Default)]
struct Trace {
    gates: Vec<(f64, Vec<f64>)>,
    val_by_type: Vec<(f64, Vec<f64>)>,
}

/// Trains one model from `seed`; appends per-epoch metrics to `metrics` and to `trace`.
fn train_run(
    p: &Prepared,
    cfg: &VqaRunConfig,
    seed: u64,
    device: Device,
    metrics: &mut MetricsLog,
    trace: &mut Trace,
) -> Result<(RunResult, VqaModel)> {
    tch::manual_seed(seed as i64);
    let vs = nn::VarStore::new(device);
    let model = VqaModel::new(&vs.root(), cfg.model.clone())?;
    let mut opt = nn::Adam::default().build(&vs, cfg.lr)?;
    let mut lr = cfg.lr;
    let mut kept = BestWeights::new(&vs);
    let train = &p.data.splits["train"];
    let steps_per_epoch = (train.len() + cfg.batch - 1) / cfg.batch;
    let (mut best, mut best_epoch, mut waited, mut epochs) = (-1.0f64, 0usize, 0usize, 0usize);
    let mut update_seconds = 0.0;
    let start = Instant::now();
    for epoch in 0..cfg.max_epochs {
        epochs = epoch + 1;
        tch::manual_seed((seed * 1_000 + epoch as u64) as i64);
        let order = Tensor::randperm(train.len(), (Kind::Int64, Device::Cpu));
        let bar = progress_bar(steps_per_epoch as u64, format!("{} seed {seed} epoch {epoch}", cfg.model.fusion_name()))?;
        // Summed on the device (float64) and read every 50 updates: no CPU sync per update.
        let (loss_sum, kl_sum) = (Tensor::zeros([], (Kind::Double, device)), Tensor::zeros([], (Kind::Double, device)));
        let loop_start = Instant::now();
        for step in 0..steps_per_epoch {
            let idx = order.narrow(0, step * cfg.batch, cfg.batch.min(train.len() - step * cfg.batch));
            let b = batch_of(&p.views, train, &idx, device)?;
            let out = model.forward(&b.views, &b.tokens, Mode::TRAIN)?;
            let mut loss = match &b.target {
                // Pythia's soft-score loss: binary cross-entropy per answer, times the answers.
                Some(t) => out.logits.binary_cross_entropy_with_logits::<Tensor>(t, None, None, tch::Reduction::Mean) * t.size()[1] as f64,
                None => out.logits.cross_entropy_for_logits(&b.answer),
            };
            if let Some(kl) = &out.kl {
                if cfg.kl_weight != 0.0 {
                    loss = loss + kl * cfg.kl_weight;
                }
                let _ = kl_sum.shallow_clone().g_add_(&kl.detach().to_kind(Kind::Double));
            }
            opt.backward_step(&loss);
            let _ = loss_sum.shallow_clone().g_add_(&loss.detach().to_kind(Kind::Double));
            if step % 50 == 0 {
                if let Some(u) = model.fusion.gates() {
                    let step_global = (epoch as i64 * steps_per_epoch + step) as f64;
                    trace.gates.push((step_global, Vec::<f64>::try_from(u.to_kind(Kind::Double).to_device(Device::Cpu))?));
                }
                bar.set_message(format!("loss {:.3}", f64::try_from(&loss_sum)? / (step + 1) as f64));
            }
            bar.inc(1);
        }
        update_seconds += loop_start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        let train_loss = f64::try_from(&loss_sum)? / steps_per_epoch as f64;
        let kl_mean = f64::try_from(&kl_sum)? / steps_per_epoch as f64;
        ensure!(train_loss.is_finite(), "training loss became {train_loss} in epoch {epoch} (seed {seed})");
        let (val_acc, val_per_type) = evaluate(&model, p, "val", device)?;
        // Per type too: a plateau on one question type (Sort-of-CLEVR's closest) hides in the mean.
        let val_by_type: Vec<f64> = val_per_type.iter().map(|(h, n)| *h / (*n).max(1) as f64).collect();
        let val_acc_by_type: BTreeMap<String, f64> = p.data.meta.types.iter().cloned().zip(val_by_type.iter().copied()).collect();
        let hnas_u = model.fusion.gates().map(|u| Vec::<f64>::try_from(u.to_kind(Kind::Double).to_device(Device::Cpu))).transpose()?;
        let seconds = start.elapsed().as_secs_f64();
        metrics.write(&EpochMetrics { epoch, hnas_u, kl: kl_mean, lr, seconds, seed, train_loss, val_acc, val_acc_by_type })?;
        trace.val_by_type.push((epoch as f64, val_by_type));
        println!(
            "{} seed {seed} epoch {epoch:3}: train loss {train_loss:.4}, val acc {val_acc:.4}, {:.0} s",
            cfg.model.fusion_name(),
            start.elapsed().as_secs_f64()
        );
        if val_acc > best {
            best = val_acc;
            best_epoch = epoch;
            waited = 0;
            kept.keep();
        } else {
            waited += 1;
            if waited >= cfg.patience {
                break;
            }
            if cfg.lr_decay != 1.0 && waited % cfg.lr_patience == 0 {
                lr *= cfg.lr_decay;
                opt.set_lr(lr);
            }
        }
    }
    let train_seconds = start.elapsed().as_secs_f64();
    kept.restore();
    let (test_acc, per_type) = evaluate(&model, p, "test", device)?;
    let types = &p.data.meta.types;
    let test_acc_by_type = types.iter().zip(&per_type).map(|(t, (h, n))| (t.clone(), *h / (*n).max(1) as f64)).collect();
    let relational_types = p.data.relational();
    // Relational / non-relational only where the data defines relational types (Sort-of-CLEVR).
    let has_relational = relational_types.iter().any(|&r| r);
    let group = |relational: bool| {
        let (h, n) =
            per_type.iter().zip(&relational_types).filter(|(_, &r)| r == relational).fold((0.0, 0), |a, ((h, n), _)| (a.0 + h, a.1 + n));
        (has_relational && n > 0).then(|| h / n as f64)
    };
    let hnas_u = model.fusion.gates().map(|u| Vec::<f64>::try_from(u.to_kind(Kind::Double).to_device(Device::Cpu))).transpose()?;
    let result = RunResult {
        seed,
        val_acc: best,
        test_acc,
        test_acc_by_type,
        test_acc_relational: group(true),
        test_acc_nonrelational: group(false),
        best_epoch,
        epochs,
        train_seconds,
        epoch_seconds: train_seconds / epochs.max(1) as f64,
        update_seconds: update_seconds / epochs.max(1) as f64,
        hnas_u,
        explained_away: None,
        uncertainty: None,
        official: None,
    };
    Ok((result, model))
}

/// VQA-v2: answers the test split (val2014) with `model`, writes them in the official results
/// format (`[{"question_id", "answer"}]`) to `path`, and scores that file with the official
/// evaluation against the val2014 files.
fn official_test(model: &VqaModel, p: &Prepared, path: &Path, device: Device) -> Result<crate::vqa_eval::Accuracy> {
    let (_, _, predicted) = score_and_predict(p, "test", device, &|views, tokens| Ok(model.forward(views, tokens, Mode::EVAL)?.logits))?;
    let ids = Vec::<i64>::try_from(p.data.splits["test"].question_id.as_ref().context("VQA-v2 questions without ids")?)?;
    let answers = &p.data.meta.answers;
    let results: Vec<serde_json::Value> =
        ids.iter().zip(&predicted).map(|(&q, &a)| serde_json::json!({"question_id": q, "answer": answers[a as usize]})).collect();
    write_json(path, &results)?;
    let (questions, annotations) = v2::official_files(&p.data.dir, "val2014");
    crate::vqa_eval::evaluate(&questions, &annotations, path)
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
        attention_dropout: if args.memory_efficient { 0.0 } else { 0.1 },
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
        tile: args.memory_efficient.then_some(args.tile),
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
    };
    cfg.model.validate()?;
    Ok(cfg)
}

fn run_fusion(p: &Prepared, args: &VqaArgs, cfg: VqaRunConfig, features: &str, dir: &Path, device: Device) -> Result<VqaResults> {
    let (fusion, meta) = (cfg.model.fusion, &p.data.meta);
    write_json(&dir.join("config.json"), &cfg)?;
    let mut metrics = MetricsLog::create(&dir.join("metrics.jsonl"))?;
    let mut runs = vec![];
    let mut traces = vec![];
    for seed in seeds(args.seed_start, args.seeds) {
        let mut trace = Trace::default();
        let (mut run, model) = train_run(p, &cfg, seed, device, &mut metrics, &mut trace)?;
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
        println!(
            "{} {:8} seed {seed:3}: test acc {:.4} (relational {}, non-relational {}), val acc {:.4} (epoch {} of {}), {:.1} s/epoch",
            meta.dataset,
            cfg.model.fusion_name(),
            run.test_acc,
            run.test_acc_relational.map_or("-".into(), |a| format!("{a:.4}")),
            run.test_acc_nonrelational.map_or("-".into(), |a| format!("{a:.4}")),
            run.val_acc,
            run.best_epoch,
            run.epochs,
            run.epoch_seconds
        );
        runs.push(run);
    }
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
                name: if args.seeds == 1 { ty.clone() } else { format!("seed {seed}, {ty}") },
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
        provenance: Provenance::gather(device),
    };
    write_results(&dir.join("results.json"), &results)?;
    Ok(results)
}

/// The markdown table of several fusions' results.
pub fn table(results: &[VqaResults]) -> String {
    let pct = |m: Option<f64>, s: Option<f64>| m.map_or("-".into(), |m| format!("{:.2} ± {:.2}", 100.0 * m, 100.0 * s.unwrap_or(0.0)));
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let ea = r.runs.iter().filter_map(|x| x.explained_away.as_ref()).map(|e| e.share_below_1e8).collect::<Vec<_>>();
            let min_mass =
                r.runs.iter().filter_map(|x| x.explained_away.as_ref()).map(|e| e.min_mass_times_keys).fold(f64::INFINITY, f64::min);
            let pavpu =
                r.runs.iter().filter_map(|x| x.uncertainty.as_ref()).map(|u| (u.clean.pavpu_05, u.noisy.pavpu_05)).collect::<Vec<_>>();
            vec![
                r.fusion.clone(),
                pct(Some(r.test_acc_mean), Some(r.test_acc_std)),
                pct(r.test_acc_relational_mean, r.test_acc_relational_std),
                pct(r.test_acc_nonrelational_mean, r.test_acc_nonrelational_std),
                format!("{:.2}", 100.0 * r.val_acc_mean),
                if ea.is_empty() { "-".into() } else { format!("{:.1}", 100.0 * mean_std(&ea).0) },
                if min_mass.is_finite() { format!("{min_mass:.3}") } else { "-".into() },
                if pavpu.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "{:.2} / {:.2}",
                        100.0 * mean_std(&pavpu.iter().map(|p| p.0).collect::<Vec<_>>()).0,
                        100.0 * mean_std(&pavpu.iter().map(|p| p.1).collect::<Vec<_>>()).0
                    )
                },
                r.runs.len().to_string(),
                format!("{:.1}", r.epoch_seconds_mean),
            ]
        })
        .collect();
    markdown_table(
        &[
            "fusion",
            "test acc (%)",
            "relational (%)",
            "non-relational (%)",
            "val acc (%)",
            "ε-explained-away boxes (%)",
            "min mass × keys",
            "PAvPU clean / noisy (%)",
            "seeds",
            "s/epoch",
        ],
        &rows,
    )
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

/// The default data folder of a dataset.
fn default_data_dir(dataset: Dataset, quick: bool) -> PathBuf {
    PathBuf::from("data/vqa").join(if quick { format!("{}-quick", dataset.name()) } else { dataset.name().to_string() })
}

/// The epochs probattn trains its detectors for, and their folder: `--detectors`, else
/// `<data>/detectors-e<epochs>[-boxes<K>]`.
fn detector_dir(args: &VqaArgs, data_dir: &Path) -> (usize, PathBuf) {
    let epochs = match (args.quick, args.detector_epochs) {
        (_, Some(e)) => e,
        (true, None) => 2,
        (false, None) if args.dataset == Dataset::EasyVqa => 40,
        (false, None) => 8,
    };
    let boxes = if args.detector_boxes > 0 { format!("-boxes{}", args.detector_boxes) } else { String::new() };
    (epochs, args.detectors.clone().unwrap_or_else(|| data_dir.join(format!("detectors-e{epochs}{boxes}"))))
}

/// Makes sure the data and detectors exist (generating them with the project's Python when
/// absent) and returns the detectors, primary first.
fn prepare_inputs(args: &VqaArgs, data_dir: &Path, threads: i32) -> Result<Vec<DetectorSpec>> {
    if !data_dir.join("meta.json").exists() {
        let out = data_dir.to_string_lossy().to_string();
        eprintln!("{}: no data yet; writing it with python/vqa_data.py", data_dir.display());
        let mut py: Vec<&str> = vec![args.dataset.name(), "--out", &out];
        if args.quick && args.dataset == Dataset::SortOfClevr {
            py.extend(["--train", "1000", "--val", "200", "--test", "200"]);
        }
        run_python("vqa_data.py", &py).context("generating the VQA data")?;
    }
    if !args.detector.is_empty() {
        ensure!(args.detector.len() >= 2, "--detector must be given at least twice (a primary and a secondary view), got once");
        return Ok(args.detector.iter().enumerate().map(|(i, p)| DetectorSpec { name: format!("view{i}"), path: p.clone() }).collect());
    }
    let (epochs, dir) = detector_dir(args, data_dir);
    if !dir.join("detectors.json").exists() {
        if args.detectors.is_some() {
            bail!(
                "{} has no detectors.json (write detectors with `python python/vqa_detectors.py --data {} --out {}`)",
                dir.display(),
                data_dir.display(),
                dir.display()
            );
        }
        eprintln!("{}: no detectors yet; training them with python/vqa_detectors.py (minutes)", dir.display());
        let (d, o, t) = (data_dir.to_string_lossy().to_string(), dir.to_string_lossy().to_string(), threads.to_string());
        let (e, b) = (epochs.to_string(), args.detector_boxes.to_string());
        run_python("vqa_detectors.py", &["--data", &d, "--out", &o, "--epochs", &e, "--boxes", &b, "--threads", &t])
            .context("training the detectors")?;
    }
    detectors_in(&dir, data_dir)
}

pub fn run(args: &VqaArgs) -> Result<()> {
    let device = args.common.setup()?;
    let quick;
    let args = if args.quick {
        quick = VqaArgs { seeds: 1, max_epochs: args.max_epochs.min(4), mc_samples: args.mc_samples.min(5), ..args.clone() };
        &quick
    } else {
        args
    };
    ensure!(args.seeds >= 1, "--seeds must be at least 1");
    ensure!(args.max_epochs >= 1 && args.patience >= 1, "--max-epochs and --patience must be at least 1");
    ensure!(args.batch >= 1, "--batch must be at least 1");
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
    let (data, mut views, detectors, features_note) = if args.dataset == Dataset::VqaV2 {
        ensure!(
            args.data.is_some(),
            "--dataset vqa-v2 needs --data DIR holding the official question and annotation files (train2014, val2014)"
        );
        ensure!(!args.quick, "--quick runs on the generated datasets (sort-of-clevr, easy-vqa), not vqa-v2");
        ensure!(
            args.detector.is_empty(),
            "--detector runs TorchScript detectors on images; VQA-v2 takes precomputed features (--features)"
        );
        let opts = v2::V2Options {
            features: &args.features,
            answers: args.answers,
            val_fraction: args.val_fraction,
            feature_memory_gb: args.feature_memory_gb,
        };
        let (data, views) = v2::load(&data_dir, &opts, device)?;
        let detectors: Vec<DetectorSpec> =
            args.features.iter().enumerate().map(|(i, f)| DetectorSpec { name: format!("view{i}"), path: f.clone() }).collect();
        let note =
            format!("precomputed .npz features: {}", args.features.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "));
        (data, views, detectors, note)
    } else {
        ensure!(args.features.is_empty(), "--features goes with --dataset vqa-v2");
        let detectors = prepare_inputs(args, &data_dir, tch::get_num_threads())?;
        let data = VqaData::load(&data_dir)?;
        ensure!(
            data.meta.dataset == args.dataset.name(),
            "{} holds {} data, not {} (--dataset)",
            data_dir.display(),
            data.meta.dataset,
            args.dataset.name()
        );
        let (features, cache, hit) = cached_features(&data, &detectors, device)?;
        eprintln!("features: {} ({}, {:.1} s)", cache.display(), if hit { "cached" } else { "extracted" }, start.elapsed().as_secs_f64());
        let note =
            format!("{} ({})", cache.display(), detectors.iter().map(|d| d.path.display().to_string()).collect::<Vec<_>>().join(", "));
        (data, Views::Memory(features.views), detectors, note)
    };
    let noisy_image = match args.image_noise {
        None => None,
        Some(std) => {
            ensure!(std > 0.0 && std.is_finite(), "--image-noise must be a positive number, got {std}");
            let images = data.images.as_ref().context("--image-noise needs images to run the detectors on (not --dataset vqa-v2)")?;
            tch::manual_seed(1_000_033);
            let noised = (images.to_kind(Kind::Float) / 255.0 + images.to_kind(Kind::Float).randn_like() * std).clamp(0.0, 1.0);
            let noised = (noised * 255.0).round().to_kind(Kind::Uint8);
            let features = data::extract(&noised, &detectors, device, 256)?;
            Some((std, Views::Memory(features.views.into_iter().map(|v| v.to_device(device)).collect())))
        }
    };
    if let (Some(k), Some(std)) = (args.noisy_view, args.noise_std) {
        let Views::Memory(v) = &mut views else {
            bail!("--noisy-view needs the features in memory (raise --feature-memory-gb)");
        };
        ensure!(k < v.len(), "--noisy-view {k}: there are only {} views (0 = primary)", v.len());
        tch::manual_seed(1_000_003);
        v[k] = &v[k] + v[k].randn_like() * std;
    }
    if let Views::Memory(v) = &mut views {
        for t in v.iter_mut() {
            *t = t.to_device(device);
        }
    }
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
    let prepared = Prepared { data, views, noisy_image };
    if let Some(path) = &args.eval_torchscript {
        return eval_torchscript(&prepared, path, args, device);
    }
    let configs = fusions.into_iter().map(|f| run_config(&prepared, args, f, &detectors)).collect::<Result<Vec<_>>>()?;
    let dir = run_dir(args.out.as_deref(), "vqa", &format!("{}-{}", args.dataset.name(), args.fusion))?;
    if let Some(path) = manifest {
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        probattn::io::write_bytes_atomic(&dir.join("detectors.json"), &bytes)?;
    }
    let mut all = vec![];
    for cfg in configs {
        let sub = if args.fusion == "all" { dir.join(cfg.model.fusion_name()) } else { dir.clone() };
        std::fs::create_dir_all(&sub)?;
        all.push(run_fusion(&prepared, args, cfg, &features_note, &sub, device)?);
    }
    let table = table(&all);
    println!("\n{} ({} seed(s) from {}):\n{table}", args.dataset.name(), args.seeds, args.seed_start);
    probattn::io::write_bytes_atomic(&dir.join("summary.md"), table.as_bytes())?;
    if all.len() > 1 {
        let series: Vec<Series> = all
            .iter()
            .filter_map(|r| {
                let reports: Vec<&ExplainedAway> = r.runs.iter().filter_map(|x| x.explained_away.as_ref()).collect();
                (!reports.is_empty()).then(|| Series { name: r.fusion.clone(), points: log_mass_points(&reports) })
            })
            .collect();
        line_chart(
            &dir.join("log_mass.svg"),
            "log Σ_i π_ij per secondary box on the test images (Fig. 1)",
            "log received mass",
            "share of boxes",
            &series,
        )?;
    }
    println!("results in {}", dir.display());
    Ok(())
}
