//! `probattn vqa`'s flags, its datasets and where their files go.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::common::CommonArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dataset {
    /// Sort-of-CLEVR from our seeded generator (python/probattn_tools/data/vqa.py sort-of-clevr).
    SortOfClevr,
    /// easy-VQA from PyPI (python/probattn_tools/data/vqa.py easy-vqa installs it).
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

/// Flags of `probattn vqa`.
#[derive(Args, Debug, Clone)]
pub struct VqaArgs {
    /// Dataset: sort-of-clevr, easy-vqa or vqa-v2.
    #[arg(long, value_enum, default_value = "sort-of-clevr")]
    pub dataset: Dataset,
    /// Data folder written by python/probattn_tools/data/vqa.py (default: data/vqa/<dataset>, or
    /// data/vqa/<dataset>-quick with --quick); generated there when absent. VQA-v2: the folder of
    /// the official question and annotation files (train2014 and val2014).
    #[arg(long, visible_alias = "data-dir")]
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
    /// Folder of detectors written by python/probattn_tools/data/vqa_detectors.py (default: <data>/detectors);
    /// trained there when absent.
    #[arg(long)]
    pub detectors: Option<PathBuf>,
    /// Training epochs of the detectors `probattn vqa` trains itself (default: 8 on
    /// Sort-of-CLEVR, 40 on easy-VQA, whose 3,600 training images give 8 epochs only 450 updates;
    /// 2 with --quick). They go to <data>/detectors-e<N>[-boxes<K>].
    #[arg(long)]
    pub detector_epochs: Option<usize>,
    /// Object detectors: each view returns its K most object-like label-grid cells instead of
    /// every region (python/probattn_tools/data/vqa_detectors.py --boxes; 0: every region). Sort-of-CLEVR places 6
    /// objects per image.
    #[arg(long, default_value_t = 0)]
    pub detector_boxes: usize,
    /// A TorchScript detector, `(B, 3, H, W)` floats in [0, 1] to `(B, regions, dim)`; give it
    /// once per view, the primary first (overrides --detectors).
    #[arg(long = "detector")]
    pub detector: Vec<PathBuf>,
    /// Fusion: none (concatenated views), softmax (UNAS), dnas, hnas, sinkhorn-N, bam-*, or all
    /// (none, softmax, dnas, hnas, bam-wc).
    #[arg(long, visible_alias = "attention", default_value = "dnas")]
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
    #[command(flatten)]
    pub memory: crate::common::MemoryEfficientArgs,
    #[command(flatten)]
    pub precision: crate::common::PrecisionArgs,
    /// Dropout on the fusion weights in training (default 0.1, Appendix B's recipe; 0 with
    /// --memory-efficient, which refuses any other value). 0 on the eager path gives the model the
    /// memory-efficient path trains, for comparing the two.
    #[arg(long)]
    pub attention_dropout: Option<f64>,
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
    /// Score a TorchScript VQA model (python/probattn_tools/baselines/vqa.py --export-torchscript: forward(view0,
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
    #[command(flatten)]
    pub dist: crate::ranks::DistArgs,
}

/// The default data folder of a dataset.
pub(super) fn default_data_dir(dataset: Dataset, quick: bool) -> PathBuf {
    PathBuf::from("data/vqa").join(if quick { format!("{}-quick", dataset.name()) } else { dataset.name().to_string() })
}

/// The epochs probattn trains its detectors for, and their folder: `--detectors`, else
/// `<data>/detectors-e<epochs>[-boxes<K>]`.
pub(super) fn detector_dir(args: &VqaArgs, data_dir: &Path) -> (usize, PathBuf) {
    let epochs = match (args.quick, args.detector_epochs) {
        (_, Some(e)) => e,
        (true, None) => 2,
        (false, None) if args.dataset == Dataset::EasyVqa => 40,
        (false, None) => 8,
    };
    let boxes = if args.detector_boxes > 0 { format!("-boxes{}", args.detector_boxes) } else { String::new() };
    (epochs, args.detectors.clone().unwrap_or_else(|| data_dir.join(format!("detectors-e{epochs}{boxes}"))))
}
