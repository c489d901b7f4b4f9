//! `probattn translate`'s flags, its presets and its datasets.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use probattn::repulsive::RepulsiveConfig;
use probattn_models::lstm::LstmConfig;
use probattn_models::transformer::TransformerConfig;
use serde::{Deserialize, Serialize};

use crate::common::CommonArgs;
use crate::ranks::DistArgs;

/// Model presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// fairseq `transformer_iwslt_de_en` (the repulsive-attention paper's model): 6+6 layers,
    /// E = 512, FFN 1024, 4 heads, dropout 0.3; 4,096 tokens per batch, lr 5e-4, 4,000 warm-up
    /// updates, BPE 10,000.
    Iwslt,
    /// A CPU-sized model for Multi30k: 3+3 layers, E = 256, FFN 512, 4 heads, dropout 0.3; lr 1e-3
    /// with 400 warm-up updates, BPE 8,000. One Multi30k epoch is about 130 updates of 4,096
    /// tokens, so fairseq's 4,000 warm-up updates would be 30 epochs; 400 is three, and a smaller
    /// model tolerates a larger rate. A first choice, not yet compared on validation BLEU per
    /// CPU-hour with others.
    Small,
    /// `--quick`: 2+2 layers, E = 128, FFN 256, 4 heads (an LSTM of 1+1 layers, E = 64, 64 units
    /// each way, decoder 128, with --arch lstm); a smoke test, not a result.
    Tiny,
    /// The attentional LSTM of Deng et al. 2018 as their code (harvardnlp/var-attn, `va.sh`)
    /// trains it on IWSLT14: embeddings 512, 2-layer bidirectional encoder of 512 units each way,
    /// 2-layer decoder of 768, dropout 0.3, parameters uniform in ±0.1; Adam (β2 0.999) at 3e-4,
    /// gradient norm clipped at 5, the rate halved every epoch from the second (or from the first
    /// worse validation loss), no label smoothing or weight decay; batches of 6 sentences (here
    /// 300 tokens, source and target, about 6 IWSLT14 pairs), BPE 14,000. `--arch lstm`.
    Deng2018,
    /// [`Self::Deng2018`] scaled to Multi30k (a sixth of IWSLT14's pairs) and to a CPU: every width
    /// halved (embeddings 256, 256 units each way, decoder 384), depth, dropout and optimizer
    /// kept; batches of 2,048 tokens (about 75 pairs: an LSTM decoder steps one token at a time,
    /// and 6-pair batches leave a CPU idle between small operations, 665 against 1,239 target
    /// tokens/s on one thread), so the rate is Deng et al.'s 3e-4 scaled by the square root of the
    /// batch ratio (√12 ≈ 3.5): 1e-3; BPE 8,000 as the Transformer's. Deng et al. start halving
    /// the rate at the second IWSLT14 epoch, some 27,000 updates in: past a 13-epoch budget here
    /// (some 400 updates an epoch), so only a worse validation loss starts it. `--arch lstm` on
    /// Multi30k.
    Deng2018Small,
}

/// `--arch`: the translation model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// fairseq's post-norm Transformer (the repulsive-attention paper's Table 2).
    Transformer,
    /// The attentional LSTM encoder-decoder of Deng et al. 2018 (the BAM paper's Table 4).
    Lstm,
}

/// What a preset sets besides the model's sizes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Recipe {
    pub lr: f64,
    /// Warm-up updates of the inverse-sqrt schedule; `None`: OpenNMT's decay instead.
    pub warmup: Option<u64>,
    pub bpe: usize,
    pub max_tokens: usize,
    pub beta2: f64,
    pub weight_decay: f64,
    pub label_smoothing: f64,
    /// 0: no clipping.
    pub max_grad_norm: f64,
    /// OpenNMT's `-start_decay_at` (with `warmup` `None`).
    pub start_decay_at: Option<usize>,
}

impl Preset {
    /// The architecture a preset is for (tiny serves both).
    pub(super) fn arch(self) -> Option<Arch> {
        match self {
            Self::Iwslt | Self::Small => Some(Arch::Transformer),
            Self::Deng2018 | Self::Deng2018Small => Some(Arch::Lstm),
            Self::Tiny => None,
        }
    }

    pub(super) fn lstm(self) -> LstmConfig {
        match self {
            Self::Deng2018 => LstmConfig::deng2018(),
            Self::Tiny => LstmConfig {
                embed_dim: 64,
                encoder_layers: 1,
                encoder_hidden: 64,
                decoder_layers: 1,
                decoder_hidden: 128,
                ..LstmConfig::deng2018()
            },
            _ => LstmConfig::deng2018_small(),
        }
    }

    pub(super) fn transformer(self) -> TransformerConfig {
        let (layers, e, ffn) = match self {
            Self::Iwslt => (6, 512, 1024),
            Self::Tiny => (2, 128, 256),
            _ => (3, 256, 512),
        };
        TransformerConfig {
            encoder_layers: layers,
            decoder_layers: layers,
            embed_dim: e,
            heads: 4,
            ffn_dim: ffn,
            dropout: 0.3,
            ..TransformerConfig::iwslt()
        }
    }

    /// The recipe of the preset for `arch`.
    pub(super) fn recipe(self, arch: Arch) -> Recipe {
        let fairseq = |lr, warmup, bpe| Recipe {
            lr,
            warmup: Some(warmup),
            bpe,
            max_tokens: 4096,
            beta2: 0.98,
            weight_decay: 1e-4,
            label_smoothing: 0.1,
            max_grad_norm: 0.0,
            start_decay_at: None,
        };
        let opennmt = |bpe, max_tokens, start_decay_at| Recipe {
            lr: 3e-4,
            warmup: None,
            bpe,
            max_tokens,
            beta2: 0.999,
            weight_decay: 0.0,
            label_smoothing: 0.0,
            max_grad_norm: 5.0,
            start_decay_at,
        };
        match (self, arch) {
            (Self::Iwslt, _) => fairseq(5e-4, 4000, 10_000),
            (Self::Small, _) => fairseq(1e-3, 400, 8000),
            (Self::Tiny, Arch::Transformer) => fairseq(2e-3, 100, 2000),
            (Self::Tiny, Arch::Lstm) => Recipe { lr: 2e-3, ..opennmt(2000, 2000, None) },
            (Self::Deng2018, _) => opennmt(14_000, 300, Some(2)),
            (Self::Deng2018Small, _) => Recipe { lr: 1e-3, ..opennmt(8000, 2048, None) },
        }
    }
}

/// `--dataset`: which corpus, and so the default data folder and preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dataset {
    /// Multi30k task 1 (train 29,000, val 1,014, test_2016_flickr 1,000): default folder
    /// multi30k/ under the data folder ($PROBATTN_DATA, else data/); default preset small
    /// (deng2018-small with --arch lstm).
    Multi30k,
    /// IWSLT14 in fairseq's prepare-iwslt14.sh layout: default folder iwslt14/ under the data
    /// folder (give the tokenized text before its BPE step, since we learn our own); default
    /// preset iwslt (deng2018 with --arch lstm).
    Iwslt14,
}

impl Dataset {
    fn name(self) -> &'static str {
        match self {
            Self::Multi30k => "multi30k",
            Self::Iwslt14 => "iwslt14",
        }
    }

    fn default_dir(self) -> PathBuf {
        match self {
            Self::Multi30k => crate::common::data_root().join("multi30k"),
            Self::Iwslt14 => crate::common::data_root().join("iwslt14"),
        }
    }

    fn default_preset(self, arch: Arch) -> Preset {
        match (self, arch) {
            (Self::Multi30k, Arch::Transformer) => Preset::Small,
            (Self::Iwslt14, Arch::Transformer) => Preset::Iwslt,
            (Self::Multi30k, Arch::Lstm) => Preset::Deng2018Small,
            (Self::Iwslt14, Arch::Lstm) => Preset::Deng2018,
        }
    }
}

/// `--repulsive`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Repulsive {
    None,
    Svgd,
    Spos,
}

/// Flags of `probattn translate`.
#[derive(Args, Debug)]
pub struct TranslateArgs {
    /// Corpus: multi30k (default folder $PROBATTN_DATA/multi30k, data/multi30k when unset; preset
    /// small, or deng2018-small for the LSTM) or iwslt14 (default folder $PROBATTN_DATA/iwslt14;
    /// preset iwslt, or deng2018).
    #[arg(long, value_enum)]
    pub dataset: Option<Dataset>,
    /// Corpus folder with train|valid|test.{SRC,TGT} (Multi30k's val.* stand in for valid.*),
    /// instead of the dataset's default folder.
    #[arg(long, visible_alias = "data")]
    pub data_dir: Option<PathBuf>,
    /// Source language (file suffix).
    #[arg(long, default_value = "de")]
    pub src: String,
    /// Target language (file suffix).
    #[arg(long, default_value = "en")]
    pub tgt: String,
    /// The model: transformer (fairseq's) or lstm (the attentional LSTM of Deng et al. 2018, the
    /// BAM paper's translation model).
    #[arg(long, value_enum, default_value_t = Arch::Transformer)]
    pub arch: Arch,
    /// Model and recipe preset. Transformer: small (Multi30k on CPU), iwslt (fairseq
    /// transformer_iwslt_de_en); LSTM: deng2018 (Deng et al.'s IWSLT14 model), deng2018-small (it,
    /// scaled to Multi30k); tiny for either (default: the dataset's for the --arch; tiny with
    /// --quick).
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Attention of the encoder self-attention and the cross-attention (or all: softmax, softmax
    /// with SVGD heads, dnas, hnas and bam-wc, one table): softmax, dnas, hnas,
    /// sinkhorn-N, bam-wc, bam-wf, bam-lc, bam-lf, bam-nokl. DNAS, HNAS and Sinkhorn act in the
    /// encoder only (over target positions they would leak later tokens); decoder
    /// self-attention stays softmax. The LSTM's one attention (decoder over encoder) takes
    /// softmax, the BAM variants and dnas, made causal: each source position normalized over the
    /// decoder steps so far (`all` with --arch lstm: softmax, dnas and bam-wc).
    #[arg(long, default_value = "softmax")]
    pub attention: String,
    /// The decoder's causal self-attention: softmax, or a BAM variant (around softmax).
    #[arg(long, default_value = "softmax")]
    pub decoder_self_attention: String,
    /// Repulsive heads on the Q, K and V in-projections of every attention module: none, svgd or spos.
    #[arg(long, value_enum, default_value_t = Repulsive::None)]
    pub repulsive: Repulsive,
    /// Weight alpha of the repulsive term (the paper's translation value, Appendix B.2.3).
    #[arg(long, default_value_t = RepulsiveConfig::default().alpha)]
    pub repulsive_alpha: f64,
    /// SVGD / SPOS step size (the paper's translation value, Appendix B.2.3; before 2026-11-24
    /// our default was 0.01, which the paper does not give for translation).
    #[arg(long, default_value_t = RepulsiveConfig::default().stepsize)]
    pub repulsive_stepsize: f64,
    /// Which particle sets the hook moves, as JSON, for the paper's ablations, e.g.
    /// '{"layers":[0]}' (first layer only) or '{"kinds":["encoder-self"],"projections":["q"]}'.
    #[arg(long)]
    pub selection: Option<String>,
    #[command(flatten)]
    pub memory: crate::common::MemoryEfficientArgs,
    #[command(flatten)]
    pub precision: crate::common::PrecisionArgs,
    /// BAM Weibull shape k (bam-w*; default 10, the authors' ALBERT script's).
    #[arg(long)]
    pub k: Option<f64>,
    /// BAM Lognormal sigma (bam-l*).
    #[arg(long, default_value_t = 1.0)]
    pub sigma: f64,
    /// Weight of BAM's KL term in the per-token loss.
    #[arg(long, default_value_t = 1.0)]
    pub kl_weight: f64,
    /// Anneal the KL weight linearly from 0 to --kl-weight over this many updates (0: the full
    /// weight from the first update).
    #[arg(long, default_value_t = 0)]
    pub kl_anneal_updates: u64,
    /// Runs with seeds seed-start, seed-start + 1, ...
    #[arg(long, default_value_t = 1)]
    pub seeds: u64,
    #[arg(long, default_value_t = 1)]
    pub seed_start: u64,
    /// Target-plus-source token budget of a batch (fairseq --max-tokens; default: the preset's,
    /// 4,096 for the Transformer presets, 2,048 for deng2018-small, 300 for deng2018).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Peak learning rate (default: the preset's).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Warm-up updates of the inverse-sqrt schedule (default: the preset's; the LSTM presets
    /// decay the rate as OpenNMT-py does instead, and refuse it).
    #[arg(long)]
    pub warmup_updates: Option<u64>,
    /// Learning rate at update 0.
    #[arg(long, default_value_t = 1e-7)]
    pub warmup_init_lr: f64,
    /// Decoupled weight decay (default: the preset's, 1e-4 for the Transformer, 0 for the LSTM).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Label smoothing epsilon (default: the preset's, 0.1 for the Transformer as fairseq's
    /// recipe, 0 for the LSTM as Deng et al.'s).
    #[arg(long)]
    pub label_smoothing: Option<f64>,
    /// Clip the gradients' joint L2 norm at this value (default: the preset's, none for the
    /// Transformer, 5 for the LSTM as OpenNMT-py's; 0: none).
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Joint BPE vocabulary size (default: the preset's).
    #[arg(long)]
    pub bpe_vocab: Option<usize>,
    /// Stop after this many epochs.
    #[arg(long, default_value_t = 100)]
    pub max_epochs: usize,
    /// Stop after this many updates (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub max_updates: u64,
    /// Early stopping: epochs without a better validation BLEU.
    #[arg(long, default_value_t = 10)]
    pub patience: usize,
    /// Beam size for validation and test (1 = greedy).
    #[arg(long, default_value_t = 5)]
    pub beam: usize,
    /// Length penalty of beam search.
    #[arg(long, default_value_t = 1.0)]
    pub lenpen: f64,
    /// Maximum output length a·|src| + b: a.
    #[arg(long, default_value_t = 1.2)]
    pub max_len_a: f64,
    /// Maximum output length a·|src| + b: b.
    #[arg(long, default_value_t = 10)]
    pub max_len_b: usize,
    /// Sentences per decoding batch.
    #[arg(long, default_value_t = 64)]
    pub decode_batch: usize,
    /// Average the weights of the last N epochs' checkpoints for the test (0: the best checkpoint).
    #[arg(long, default_value_t = 0)]
    pub average_last: usize,
    /// 300 updates of the tiny preset (2,000-token batches; --max-updates and --max-epochs still
    /// apply) on the first 3,000 training pairs, validation on 100 pairs, then decode and score the
    /// whole test set: a smoke test of every step (a few minutes on 2 cores), not a result.
    #[arg(long)]
    pub quick: bool,
    /// Use only the first N training pairs.
    #[arg(long)]
    pub limit_train: Option<usize>,
    /// Use only the first N validation pairs.
    #[arg(long)]
    pub limit_valid: Option<usize>,
    /// Use only the first N test pairs.
    #[arg(long)]
    pub limit_test: Option<usize>,
    /// Output folder (default: runs/translate/<UTC stamp>-<attention>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the killed run in this folder from its last checkpoints (same flags).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Translate --input with --checkpoint instead of training.
    #[arg(long)]
    pub decode: bool,
    /// With --decode: a checkpoint_*.safetensors of a run (the run's tokenizer.json is read beside
    /// it or one folder up).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// With --decode: source sentences, one per line.
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// With --decode: where to write the translations (default: standard output).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// With --decode: also decode greedily with and without the key/value cache and report
    /// sentences per second of each (and whether their outputs agree) as JSON on stderr.
    #[arg(long)]
    pub decode_bench: bool,
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub dist: DistArgs,
}

impl TranslateArgs {
    pub(super) fn data_dir(&self) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(|| self.dataset.unwrap_or(Dataset::Multi30k).default_dir())
    }

    /// results.json's `dataset`: the --dataset named, else the --data-dir folder's name.
    pub(super) fn dataset_name(&self) -> String {
        match (self.dataset, &self.data_dir) {
            (Some(d), _) => d.name().into(),
            (None, Some(dir)) => dir.file_name().map_or("corpus".into(), |n| n.to_string_lossy().into()),
            (None, None) => Dataset::Multi30k.name().into(),
        }
    }

    pub(super) fn preset(&self) -> Preset {
        if self.quick {
            Preset::Tiny
        } else {
            self.preset.unwrap_or_else(|| self.dataset.unwrap_or(Dataset::Multi30k).default_preset(self.arch))
        }
    }
}
