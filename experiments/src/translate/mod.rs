//! `probattn translate`: a Transformer translation model trained as fairseq trains it, with any
//! attention variant in the encoder self-attention and the cross-attention, and repulsive (SVGD /
//! SPOS) heads; the repulsive-attention paper's Table 2 (An et al. 2020) on Multi30k, and on
//! IWSLT14 for users who have it. Recipe: docs/formulas.md §3 and §4.
//!
//! Training: label-smoothed cross-entropy (ε = 0.1, padding excluded) summed over the batch's
//! target tokens and divided by their number (fairseq's gradient normalization); fairseq's Adam
//! (β = 0.9, 0.98) with decoupled weight decay; the inverse-square-root schedule; batches by token
//! count in a seeded order. After every epoch: validation loss, validation BLEU (beam search,
//! sacreBLEU's default), the checkpoint written atomically (model, optimizer, schedule step, epoch,
//! patience, best score, config, tokenizer beside it); the best checkpoint is chosen by validation
//! BLEU; early stopping after `--patience` epochs without a better one. At the end the best
//! checkpoint (or the average of the last N epochs' weights) translates the test set.
//!
//! Reproducibility: every epoch reseeds libtorch (dropout, BAM noise) and the batch order from
//! (seed, epoch), so a run resumed from its last checkpoint (`--resume`) continues exactly as the
//! uninterrupted run would have.

pub mod data;
pub mod decode;
pub mod optim;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::{Args, ValueEnum};
use probattn::normalize::BamConfig;
use probattn::repulsive::{Method, RepulsiveConfig, RepulsiveHook, Selection};
use probattn::{NormalizerConfig, Variant};
use probattn_models::transformer::TransformerConfig;
use probattn_models::translation::{baseline_name, Seq2Seq, Seq2SeqConfig};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};
use tokenizers::Tokenizer;

use crate::bleu::{corpus_bleu, BleuConfig};
use crate::common::CommonArgs;
use crate::provenance::{run_dir, write_json, write_results, Provenance};
use crate::report::{mean_std, progress_bar};
use data::{batch_tensors, epoch_order, token_batches, Corpus, Encoded, PAD};
use decode::DecodeConfig;
use optim::{Adam, AdamConfig, InverseSqrt};

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
    /// `--quick`: 2+2 layers, E = 128, FFN 256, 4 heads; a smoke test, not a result.
    Tiny,
}

impl Preset {
    fn transformer(self) -> TransformerConfig {
        let (layers, e, ffn) = match self {
            Self::Iwslt => (6, 512, 1024),
            Self::Small => (3, 256, 512),
            Self::Tiny => (2, 128, 256),
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

    /// (lr, warm-up updates, BPE vocabulary).
    fn recipe(self) -> (f64, u64, usize) {
        match self {
            Self::Iwslt => (5e-4, 4000, 10_000),
            Self::Small => (1e-3, 400, 8000),
            Self::Tiny => (2e-3, 100, 2000),
        }
    }
}

/// `--dataset`: which corpus, and so the default data folder and preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dataset {
    /// Multi30k task 1 (train 29,000, val 1,014, test_2016_flickr 1,000): default folder
    /// ../shared/data/multi30k when it exists, else data/multi30k; default preset small.
    Multi30k,
    /// IWSLT14 in fairseq's prepare-iwslt14.sh layout: default folder data/iwslt14 (give the
    /// tokenized text before its BPE step, since we learn our own); default preset iwslt.
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
            Self::Multi30k => {
                let shared = Path::new("../shared/data/multi30k");
                if shared.is_dir() {
                    shared.into()
                } else {
                    "data/multi30k".into()
                }
            }
            Self::Iwslt14 => "data/iwslt14".into(),
        }
    }

    fn default_preset(self) -> Preset {
        match self {
            Self::Multi30k => Preset::Small,
            Self::Iwslt14 => Preset::Iwslt,
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
    /// Corpus: multi30k (default folder ../shared/data/multi30k when it exists, else
    /// data/multi30k; preset small) or iwslt14 (default folder data/iwslt14; preset iwslt).
    #[arg(long, value_enum)]
    pub dataset: Option<Dataset>,
    /// Corpus folder with train|valid|test.{SRC,TGT} (Multi30k's val.* stand in for valid.*),
    /// instead of the dataset's default folder.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Source language (file suffix).
    #[arg(long, default_value = "de")]
    pub src: String,
    /// Target language (file suffix).
    #[arg(long, default_value = "en")]
    pub tgt: String,
    /// Model and recipe preset: small (Multi30k on CPU), iwslt (fairseq transformer_iwslt_de_en) or
    /// tiny (default: the dataset's; tiny with --quick).
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Attention of the encoder self-attention and the cross-attention (or all: softmax, softmax
    /// with SVGD heads, dnas, hnas and bam-wc, one table): softmax, dnas, hnas,
    /// sinkhorn-N, bam-wc, bam-wf, bam-lc, bam-lf, bam-nokl. DNAS, HNAS and Sinkhorn act in the
    /// encoder only (over target positions they would leak later tokens); decoder
    /// self-attention stays softmax.
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
    /// Memory-efficient attention in every attention module (every variant; probattn::tiled):
    /// no (S, S) weights are kept for the backward pass. Needs attention dropout 0 (the presets'),
    /// and refuses the variants without a tiled path.
    #[arg(long)]
    pub memory_efficient: bool,
    /// Queries per tile with --memory-efficient.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(i64).range(1..))]
    pub tile: i64,
    /// BAM Weibull shape k (bam-w*; the authors' ALBERT script's 10).
    #[arg(long, default_value_t = 10.0)]
    pub k: f64,
    /// BAM Lognormal sigma (bam-l*).
    #[arg(long, default_value_t = 1.0)]
    pub sigma: f64,
    /// Weight of BAM's KL term in the per-token loss.
    #[arg(long, default_value_t = 1.0)]
    pub kl_weight: f64,
    /// Runs with seeds seed-start, seed-start + 1, ...
    #[arg(long, default_value_t = 1)]
    pub seeds: u64,
    #[arg(long, default_value_t = 1)]
    pub seed_start: u64,
    /// Target-plus-source token budget of a batch (fairseq --max-tokens).
    #[arg(long, default_value_t = 4096)]
    pub max_tokens: usize,
    /// Peak learning rate (default: the preset's).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Warm-up updates of the inverse-sqrt schedule (default: the preset's).
    #[arg(long)]
    pub warmup_updates: Option<u64>,
    /// Learning rate at update 0.
    #[arg(long, default_value_t = 1e-7)]
    pub warmup_init_lr: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 1e-4)]
    pub weight_decay: f64,
    /// Label smoothing epsilon.
    #[arg(long, default_value_t = 0.1)]
    pub label_smoothing: f64,
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
    /// 300 updates of the tiny preset (2,000-token batches) on the first 3,000 training pairs,
    /// validation on 100 pairs, then decode and score the whole test set: a smoke test of every
    /// step (a few minutes on 2 cores), not a result.
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
}

/// Everything that defines a run (config.json; a resumed run must match it).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TranslateConfig {
    pub data_dir: String,
    pub src: String,
    pub tgt: String,
    pub preset: Preset,
    pub model: Seq2SeqConfig,
    pub repulsive: Repulsive,
    pub repulsive_config: RepulsiveConfig,
    pub selection: Selection,
    pub kl_weight: f64,
    pub adam: AdamConfig,
    pub schedule: InverseSqrt,
    pub label_smoothing: f64,
    pub max_tokens: usize,
    pub bpe_vocab: usize,
    pub max_epochs: usize,
    pub max_updates: u64,
    pub patience: usize,
    pub decode: DecodeConfig,
    pub average_last: usize,
    /// The first N pairs of each split used (`None`: all).
    pub limit_train: Option<usize>,
    pub limit_valid: Option<usize>,
    pub limit_test: Option<usize>,
}

/// One epoch's metrics (metrics.jsonl).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EpochMetrics {
    pub seed: u64,
    pub epoch: usize,
    pub updates: u64,
    pub lr: f64,
    pub train_loss: f64,
    pub train_nll: f64,
    pub kl: Option<f64>,
    pub valid_loss: f64,
    pub valid_nll: f64,
    pub valid_bleu: f64,
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// HNAS's mean u per encoder layer (self-attention), when the attention is hnas.
    pub hnas_u: Option<Vec<f64>>,
}

/// What the checkpoint carries besides tensors (stored in it as a JSON byte tensor, so the file
/// is one atomic unit).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TrainState {
    config: TranslateConfig,
    seed: u64,
    /// Epochs completed.
    epoch: usize,
    updates: u64,
    best_bleu: f64,
    best_epoch: usize,
    waited: usize,
    train_seconds: f64,
    train_tokens: u64,
    history: Vec<EpochMetrics>,
}

/// One seed's outcome (results.json `runs`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub seed: u64,
    /// sacreBLEU (13a, cased, detokenized) of the test set.
    pub test_bleu: f64,
    /// Tokenized (13a), lowercased BLEU of the test set: the papers' kind.
    pub test_bleu_tok: f64,
    pub valid_bleu: f64,
    pub best_epoch: usize,
    pub epochs: usize,
    pub updates: u64,
    pub train_seconds: f64,
    /// Target tokens per second of training (forward, backward, hook and update).
    pub tokens_per_second: f64,
    pub test_sentences_per_second: f64,
    pub test_signature: String,
    pub test_signature_tok: String,
    /// The paper's head diversity "Dist" of each encoder layer's self-attention on the test set:
    /// the mean L2 distance between two heads' outputs, over head pairs and source tokens.
    pub head_diversity: Vec<f64>,
    /// Per encoder layer, the share of (sentence, head, source token) whose received attention
    /// mass Σ_i π_ij is below 1e-8 (ε-explained away, Ding et al. 2020).
    pub explained_away: Vec<f64>,
}

/// results.json.
#[derive(Debug, Serialize)]
pub struct TranslateResults {
    pub dataset: String,
    pub attention: String,
    pub repulsive: Repulsive,
    pub config: TranslateConfig,
    pub runs: Vec<RunResult>,
    pub test_bleu_mean: f64,
    pub test_bleu_std: f64,
    pub test_bleu_tok_mean: f64,
    pub test_bleu_tok_std: f64,
    pub valid_bleu_mean: f64,
    pub tokens_per_second_mean: f64,
    pub provenance: Provenance,
}

impl TranslateArgs {
    fn data_dir(&self) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(|| self.dataset.unwrap_or(Dataset::Multi30k).default_dir())
    }

    /// results.json's `dataset`: the --dataset named, else the --data-dir folder's name.
    fn dataset_name(&self) -> String {
        match (self.dataset, &self.data_dir) {
            (Some(d), _) => d.name().into(),
            (None, Some(dir)) => dir.file_name().map_or("corpus".into(), |n| n.to_string_lossy().into()),
            (None, None) => Dataset::Multi30k.name().into(),
        }
    }

    fn preset(&self) -> Preset {
        if self.quick {
            Preset::Tiny
        } else {
            self.preset.unwrap_or_else(|| self.dataset.unwrap_or(Dataset::Multi30k).default_preset())
        }
    }
}

impl TranslateConfig {
    fn from_args(args: &TranslateArgs, vocab: i64, variant: Variant, repulsive: Repulsive) -> Result<Self> {
        let preset = args.preset();
        let mut transformer = preset.transformer();
        transformer.variant = variant;
        transformer.decoder_self_variant = args.decoder_self_attention.parse().context("--decoder-self-attention")?;
        transformer.normalizer =
            NormalizerConfig { bam: BamConfig { k: args.k, sigma: args.sigma, ..BamConfig::default() }, ..Default::default() };
        transformer.tile = args.memory_efficient.then_some(args.tile);
        let (lr, warmup, bpe) = preset.recipe();
        let selection: Selection = match &args.selection {
            Some(s) => serde_json::from_str(s)
                .with_context(|| format!("--selection {s:?} is not a selection (JSON with kinds, layers, projections)"))?,
            None => Selection::default(),
        };
        let method = if repulsive == Repulsive::Spos { Method::Spos } else { Method::Svgd };
        let repulsive_config =
            RepulsiveConfig { method, alpha: args.repulsive_alpha, stepsize: args.repulsive_stepsize, ..Default::default() };
        repulsive_config.validate()?;
        ensure!(args.label_smoothing >= 0.0 && args.label_smoothing < 1.0, "--label-smoothing must lie in [0, 1)");
        ensure!(args.max_tokens >= 16, "--max-tokens must be at least 16");
        ensure!(args.beam >= 1, "--beam must be at least 1");
        Ok(Self {
            data_dir: args.data_dir().to_string_lossy().into(),
            src: args.src.clone(),
            tgt: args.tgt.clone(),
            preset,
            model: Seq2SeqConfig { transformer, vocab, pad: PAD, share_all_embeddings: true, max_positions: 1024 },
            repulsive,
            repulsive_config,
            selection,
            kl_weight: args.kl_weight,
            adam: AdamConfig { beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: args.weight_decay },
            schedule: InverseSqrt {
                lr: args.lr.unwrap_or(lr),
                warmup_updates: args.warmup_updates.unwrap_or(warmup),
                warmup_init_lr: args.warmup_init_lr,
            },
            label_smoothing: args.label_smoothing,
            max_tokens: if args.quick { 2000 } else { args.max_tokens },
            bpe_vocab: args.bpe_vocab.unwrap_or(bpe),
            max_epochs: if args.quick { 100 } else { args.max_epochs },
            max_updates: if args.quick { 300 } else { args.max_updates },
            patience: args.patience,
            decode: DecodeConfig { beam: args.beam, lenpen: args.lenpen, max_len_a: args.max_len_a, max_len_b: args.max_len_b },
            average_last: args.average_last,
            limit_train: args.limit_train.or(args.quick.then_some(3000)),
            limit_valid: args.limit_valid.or(args.quick.then_some(100)),
            limit_test: args.limit_test,
        })
    }
}

/// Label-smoothed cross-entropy, fairseq 0.6: `Σ_t (1−ε)·nll_t + ε/V · Σ_v −log p_t(v)` over
/// non-padding targets; returns (loss sum, nll sum).
pub fn label_smoothed_loss(logits: &Tensor, target: &Tensor, eps: f64) -> (Tensor, Tensor) {
    let lprobs = logits.log_softmax(-1, Kind::Float); // (B, T, V)
    let v = lprobs.size()[2] as f64;
    let keep = target.ne(PAD).to_kind(Kind::Float); // (B, T)
    let nll = -lprobs.gather(-1, &target.unsqueeze(-1), false).squeeze_dim(-1) * &keep;
    let smooth = -lprobs.sum_dim_intlist(&[-1i64][..], false, Kind::Float) * &keep;
    let nll = nll.sum(Kind::Float);
    ((&nll * (1.0 - eps)) + smooth.sum(Kind::Float) * (eps / v), nll)
}

/// Writes the training checkpoint: parameters, Adam's moments, and the state as JSON bytes.
fn save_checkpoint(path: &Path, vs: &nn::VarStore, adam: &Adam, state: &TrainState) -> Result<()> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.extend(adam.state_tensors());
    let json = serde_json::to_vec(state)?;
    named.push(("train_state.json".into(), Tensor::from_slice(&json)));
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    probattn::io::write_safetensors_atomic(path, &refs).with_context(|| format!("writing checkpoint {}", path.display()))
}

/// Reads a checkpoint's tensors and its training state, with errors that name the file.
fn read_checkpoint(path: &Path) -> Result<(HashMap<String, Tensor>, TrainState)> {
    let tensors = probattn::io::read_safetensors(path).with_context(|| format!("reading checkpoint {}", path.display()))?;
    let state = tensors
        .get("train_state.json")
        .with_context(|| format!("{} is not a probattn translate checkpoint (no train_state.json)", path.display()))?;
    let bytes: Vec<u8> = Vec::try_from(state).with_context(|| format!("{}: train_state.json", path.display()))?;
    let state: TrainState =
        serde_json::from_slice(&bytes).with_context(|| format!("{}: its train_state.json does not parse", path.display()))?;
    Ok((tensors, state))
}

/// Copies the model parameters of a checkpoint into `vs`, checking names and shapes.
fn load_params(vs: &nn::VarStore, tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    for (name, mut t) in vs.variables() {
        let saved =
            tensors.get(&name).with_context(|| format!("{} lacks parameter {name}: a checkpoint of another model", path.display()))?;
        ensure!(saved.size() == t.size(), "{}: {name} has shape {:?}, the model {:?}", path.display(), saved.size(), t.size());
        tch::no_grad(|| t.copy_(saved));
    }
    Ok(())
}

/// The data of a run, BPE-encoded.
struct Prepared {
    corpus: Corpus,
    tokenizer: Tokenizer,
    train: Encoded,
    valid: Encoded,
    test: Encoded,
}

/// The corpus with the --limit-* flags applied; a missing folder's error says how to get it.
fn load_corpus(data_dir: &Path, args: &TranslateArgs) -> Result<Corpus> {
    let hint = match (args.dataset.unwrap_or(Dataset::Multi30k), &args.data_dir) {
        (_, Some(_)) => String::new(),
        (Dataset::Multi30k, None) => format!(" (`python python/multi30k.py download --dir {}` fetches Multi30k)", data_dir.display()),
        (Dataset::Iwslt14, None) => {
            format!(" (run fairseq's examples/translation/prepare-iwslt14.sh and give its iwslt14.tokenized.de-en/tmp folder with --data-dir, or copy it to {})", data_dir.display())
        }
    };
    let mut corpus = Corpus::load(data_dir, &args.src, &args.tgt).map_err(|e| anyhow::anyhow!("{e:#}{hint}"))?;
    let limits = [args.limit_train.or(args.quick.then_some(3000)), args.limit_valid.or(args.quick.then_some(100)), args.limit_test];
    for (split, limit) in [&mut corpus.train, &mut corpus.valid, &mut corpus.test].into_iter().zip(limits) {
        if let Some(n) = limit {
            ensure!(n >= 1, "--limit-{} must be at least 1", split.name);
            split.src.truncate(n);
            split.tgt.truncate(n);
        }
    }
    Ok(corpus)
}

fn prepare(corpus: Corpus, args: &TranslateArgs, dir: &Path, resume: bool) -> Result<Prepared> {
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if resume {
        data::load_tokenizer(&tok_path)?
    } else {
        let vocab = args.bpe_vocab.unwrap_or(args.preset().recipe().2);
        let t = data::learn_bpe(&corpus.train, vocab, dir)?;
        let json = t.to_string(true).map_err(|e| anyhow::anyhow!("serializing the tokenizer: {e}"))?;
        probattn::io::write_bytes_atomic(&tok_path, json.as_bytes())?;
        t
    };
    let train = Encoded::new(&tokenizer, &corpus.train)?;
    let valid = Encoded::new(&tokenizer, &corpus.valid)?;
    let test = Encoded::new(&tokenizer, &corpus.test)?;
    Ok(Prepared { corpus, tokenizer, train, valid, test })
}

/// Updates between two readings of the training loss on the CPU (progress bar, NaN check).
const SYNC_EVERY: usize = 10;

/// Sentences per decoding batch during training (validation and test).
const DECODE_BATCH: usize = 64;

/// Translates `data`'s sources and scores them against `refs` (sacreBLEU's default and the
/// tokenized, lowercased kind); returns (hypotheses, BLEU, BLEU tok-lc, sentences/s).
fn translate_and_score(
    model: &Seq2Seq,
    tokenizer: &Tokenizer,
    data: &Encoded,
    refs: &[String],
    cfg: &DecodeConfig,
    device: Device,
    label: &str,
) -> Result<(Vec<String>, crate::bleu::BleuScore, crate::bleu::BleuScore, f64)> {
    let bar = progress_bar(data.len() as u64, format!("{label} decoding"))?;
    let start = Instant::now();
    let ids = decode::translate(model, &data.src, cfg, DECODE_BATCH, device, |n| bar.inc(n as u64))?;
    let seconds = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let hyps: Vec<String> = ids.iter().map(|h| data::decode(tokenizer, h)).collect::<Result<_>>()?;
    let bleu = corpus_bleu(&hyps, refs, &BleuConfig::default())?;
    let tok = corpus_bleu(&hyps, refs, &BleuConfig::tokenized_lowercase())?;
    Ok((hyps, bleu, tok, data.len() as f64 / seconds.max(1e-9)))
}

/// Validation loss (label-smoothed and nll, per target token) in eval mode.
fn valid_loss(model: &Seq2Seq, data: &Encoded, cfg: &TranslateConfig, device: Device) -> Result<(f64, f64)> {
    let (batches, _) = token_batches(data, cfg.max_tokens, usize::MAX);
    let (mut loss, mut nll, mut tokens) = (0.0, 0.0, 0usize);
    tch::no_grad(|| -> Result<()> {
        for b in &batches {
            let t = batch_tensors(data, b, device);
            let (logits, _) = model.forward_t(&t.src, &t.prev, false)?;
            let (l, n) = label_smoothed_loss(&logits, &t.target, cfg.label_smoothing);
            loss += f64::try_from(l)?;
            nll += f64::try_from(n)?;
            tokens += t.ntokens;
        }
        Ok(())
    })?;
    Ok((loss / tokens.max(1) as f64, nll / tokens.max(1) as f64))
}

/// HNAS's mean `u` per encoder layer.
fn hnas_gates(model: &Seq2Seq) -> Option<Vec<f64>> {
    model.stack.encoder.iter().map(|l| l.self_attn.hybrid_u().and_then(|u| f64::try_from(u.mean(Kind::Double)).ok())).collect()
}

/// Trains one seed in `dir` (resuming from its checkpoint when there is one); returns its result.
fn train_seed(p: &Prepared, cfg: &TranslateConfig, seed: u64, dir: &Path, device: Device, resume: bool) -> Result<RunResult> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    tch::manual_seed(seed as i64);
    let mut vs = nn::VarStore::new(device);
    let model = Seq2Seq::new(&vs.root(), cfg.model.clone())?;
    let mut adam = Adam::new(&vs, cfg.adam);
    let hook = match cfg.repulsive {
        Repulsive::None => None,
        _ => {
            let mut h = RepulsiveHook::new(cfg.repulsive_config.clone(), cfg.selection.clone())?;
            model.stack.register_repulsive(&mut h);
            Some(h)
        }
    };
    let last = dir.join("checkpoint_last.safetensors");
    let mut state = TrainState {
        config: cfg.clone(),
        seed,
        epoch: 0,
        updates: 0,
        best_bleu: f64::NEG_INFINITY,
        best_epoch: 0,
        waited: 0,
        train_seconds: 0.0,
        train_tokens: 0,
        history: vec![],
    };
    if resume {
        // A kill during an atomic write leaves only its temporary file behind: remove it.
        for entry in std::fs::read_dir(dir)?.flatten() {
            if entry.file_name().to_string_lossy().contains(".tmp-") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    if resume && last.exists() {
        let (tensors, saved) = read_checkpoint(&last)?;
        if saved.config != *cfg {
            let (a, b) = (serde_json::to_value(&saved.config)?, serde_json::to_value(cfg)?);
            let differ: Vec<String> =
                a.as_object().into_iter().flatten().filter(|(k, v)| b.get(k.as_str()) != Some(v)).map(|(k, _)| k.clone()).collect();
            bail!(
                "{} was written with another configuration (differs in: {}); resume with the flags of the original run",
                last.display(),
                differ.join(", ")
            );
        }
        ensure!(saved.seed == seed, "{} belongs to seed {}, not {seed}", last.display(), saved.seed);
        load_params(&vs, &tensors, &last)?;
        adam.load_state(&tensors, saved.updates).with_context(|| last.display().to_string())?;
        eprintln!("resuming seed {seed} after epoch {} ({} updates)", saved.epoch, saved.updates);
        // metrics.jsonl gets an epoch's line just before checkpoint_last is saved: a kill between
        // the two leaves a line the checkpoint does not know, which the resumed epoch would write
        // again. The checkpoint's history is the record: rewrite the file from it.
        let lines: String = saved.history.iter().map(|m| serde_json::to_string(m).map(|l| l + "\n")).collect::<serde_json::Result<_>>()?;
        probattn::io::write_bytes_atomic(&dir.join("metrics.jsonl"), lines.as_bytes())?;
        state = saved;
    } else {
        // A fresh start: drop any metrics of an earlier attempt in this folder.
        let _ = std::fs::remove_file(dir.join("metrics.jsonl"));
    }
    let (batches, dropped) = token_batches(&p.train, cfg.max_tokens, cfg.model.max_positions as usize);
    if dropped > 0 && state.epoch == 0 {
        eprintln!("left out {dropped} training pairs longer than {} tokens", cfg.model.max_positions);
    }
    let mut metrics = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("metrics.jsonl"))?;
    let done_by_updates = |u: u64| cfg.max_updates > 0 && u >= cfg.max_updates;
    while state.epoch < cfg.max_epochs && state.waited < cfg.patience && !done_by_updates(state.updates) {
        let epoch = state.epoch;
        // Dropout, BAM noise and the batch order depend on (seed, epoch) only.
        tch::manual_seed((seed as i64).wrapping_mul(1_000_003).wrapping_add(epoch as i64 + 1));
        let order = epoch_order(&batches, seed, epoch);
        let bar = progress_bar(order.len() as u64, format!("seed {seed} epoch {}", epoch + 1))?;
        let start = Instant::now();
        // [loss, nll, KL] summed over the epoch's updates.
        let (mut sums, mut tokens, mut steps) = ([0.0f64; 3], 0usize, 0usize);
        let mut has_kl = false;
        // Per-update (loss, nll, KL) stay on the device and reach the CPU together every
        // SYNC_EVERY updates and at the end of the epoch: one synchronization instead of three per
        // update. They are added in update order, so the sums are the same.
        let mut pending: Vec<Tensor> = vec![];
        let flush = |pending: &mut Vec<Tensor>, first_update: u64, sums: &mut [f64; 3]| -> Result<()> {
            if pending.is_empty() {
                return Ok(());
            }
            let values: Vec<f64> = Vec::try_from(Tensor::stack(pending, 0).view([-1]).to_device(Device::Cpu))?;
            for (i, row) in values.chunks(3).enumerate() {
                ensure!(row[0].is_finite(), "the training loss became {} at update {} (seed {seed})", row[0], first_update + i as u64);
                for (sum, v) in sums.iter_mut().zip(row) {
                    *sum += v;
                }
            }
            pending.clear();
            Ok(())
        };
        for &bi in &order {
            if done_by_updates(state.updates) {
                break;
            }
            let t = batch_tensors(&p.train, &batches[bi], device);
            let (logits, kl) = model.forward_t(&t.src, &t.prev, true)?;
            let (loss, nll) = label_smoothed_loss(&logits, &t.target, cfg.label_smoothing);
            let mut objective = &loss / t.ntokens as f64;
            let kl_value = match &kl {
                Some(kl) => {
                    objective += kl * cfg.kl_weight;
                    has_kl = true;
                    kl.detach().to_kind(Kind::Double)
                }
                None => Tensor::zeros([], (Kind::Double, device)),
            };
            adam.zero_grad();
            objective.backward();
            if let Some(h) = &hook {
                h.apply()?;
            }
            // As fairseq: update n (1-based) runs at the rate the schedule set after update n − 1,
            // so the first one at warmup_init_lr.
            let lr = cfg.schedule.lr_at(state.updates);
            adam.step(lr);
            state.updates += 1;
            pending.push(Tensor::stack(&[loss.detach().to_kind(Kind::Double), nll.detach().to_kind(Kind::Double), kl_value], 0));
            tokens += t.ntokens;
            steps += 1;
            if pending.len() == SYNC_EVERY {
                flush(&mut pending, state.updates + 1 - SYNC_EVERY as u64, &mut sums)?;
                let secs = start.elapsed().as_secs_f64().max(1e-9);
                bar.set_message(format!(
                    "loss {:.3}, lr {lr:.2e}, {:.1} upd/s, {:.0} tok/s",
                    sums[0] / tokens as f64,
                    steps as f64 / secs,
                    tokens as f64 / secs
                ));
            }
            bar.inc(1);
        }
        let first_pending = state.updates + 1 - pending.len() as u64;
        flush(&mut pending, first_pending, &mut sums)?;
        let [loss_sum, nll_sum, kl_sum] = sums;
        let seconds = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        state.train_seconds += seconds;
        state.train_tokens += tokens as u64;
        let (valid_loss, valid_nll) = valid_loss(&model, &p.valid, cfg, device)?;
        let (_, vb, _, _) = translate_and_score(&model, &p.tokenizer, &p.valid, &p.corpus.valid.tgt, &cfg.decode, device, "valid")?;
        state.epoch += 1;
        let m = EpochMetrics {
            seed,
            epoch: state.epoch,
            updates: state.updates,
            lr: cfg.schedule.lr_at(state.updates),
            train_loss: loss_sum / tokens.max(1) as f64,
            train_nll: nll_sum / tokens.max(1) as f64,
            kl: has_kl.then(|| kl_sum / steps.max(1) as f64),
            valid_loss,
            valid_nll,
            valid_bleu: vb.bleu,
            seconds,
            tokens_per_second: tokens as f64 / seconds.max(1e-9),
            hnas_u: hnas_gates(&model),
        };
        println!(
            "seed {seed} epoch {:3}: {} updates, train loss {:.3}, valid loss {:.3}, valid BLEU {:.2}, {:.0} tok/s, {:.0} s",
            m.epoch, m.updates, m.train_loss, m.valid_loss, m.valid_bleu, m.tokens_per_second, m.seconds
        );
        if vb.bleu > state.best_bleu {
            state.best_bleu = vb.bleu;
            state.best_epoch = state.epoch;
            state.waited = 0;
            save_checkpoint(&dir.join("checkpoint_best.safetensors"), &vs, &adam, &state)?;
        } else {
            state.waited += 1;
        }
        if cfg.average_last > 0 {
            let named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
            let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
            probattn::io::write_safetensors_atomic(&dir.join(format!("weights_epoch{}.safetensors", state.epoch)), &refs)?;
            if state.epoch > cfg.average_last {
                let _ = std::fs::remove_file(dir.join(format!("weights_epoch{}.safetensors", state.epoch - cfg.average_last)));
            }
        }
        writeln!(metrics, "{}", serde_json::to_string(&m)?)?;
        metrics.flush()?;
        state.history.push(m);
        save_checkpoint(&last, &vs, &adam, &state)?;
    }
    // The test: the best checkpoint, or the average of the last N epochs' weights.
    let best = dir.join("checkpoint_best.safetensors");
    let (tensors, _) = read_checkpoint(&best)?;
    load_params(&vs, &tensors, &best)?;
    if cfg.average_last > 0 {
        average_last(&mut vs, dir, state.epoch, cfg.average_last)?;
        // Kept so that `--decode --checkpoint` can translate with the averaged model too.
        save_checkpoint(&dir.join("checkpoint_average.safetensors"), &vs, &adam, &state)?;
    }
    let (hyps, bleu, tok, sps) = translate_and_score(&model, &p.tokenizer, &p.test, &p.corpus.test.tgt, &cfg.decode, device, "test")?;
    probattn::io::write_bytes_atomic(&dir.join("test.hyp"), (hyps.join("\n") + "\n").as_bytes())?;
    let (head_diversity, explained_away) = encoder_diagnostics(&model, &p.test, device)?;
    plots(dir, &state.history, &head_diversity, &explained_away)?;
    println!("seed {seed} test: {} {} | tokenized lowercased: BLEU = {:.2} {}", bleu.line(), bleu.signature, tok.bleu, tok.signature);
    Ok(RunResult {
        seed,
        test_bleu: bleu.bleu,
        test_bleu_tok: tok.bleu,
        valid_bleu: state.best_bleu,
        best_epoch: state.best_epoch,
        epochs: state.epoch,
        updates: state.updates,
        train_seconds: state.train_seconds,
        tokens_per_second: state.train_tokens as f64 / state.train_seconds.max(1e-9),
        test_sentences_per_second: sps,
        test_signature: bleu.signature,
        test_signature_tok: tok.signature,
        head_diversity,
        explained_away,
    })
}

/// The run's SVG plots: loss and validation BLEU over epochs, HNAS's u per encoder layer over
/// epochs (hnas runs), and the test set's head diversity and explained-away share per layer.
fn plots(dir: &Path, history: &[EpochMetrics], dist: &[f64], away: &[f64]) -> Result<()> {
    use crate::plot::{line_chart, Series};
    let curve = |name: &str, f: &dyn Fn(&EpochMetrics) -> f64| Series {
        name: name.into(),
        points: history.iter().map(|m| (m.epoch as f64, f(m))).collect(),
    };
    line_chart(
        &dir.join("loss.svg"),
        "label-smoothed loss per target token",
        "epoch",
        "loss",
        &[curve("train", &|m| m.train_loss), curve("valid", &|m| m.valid_loss)],
    )?;
    line_chart(&dir.join("valid_bleu.svg"), "validation BLEU (sacreBLEU, beam)", "epoch", "BLEU", &[curve("valid", &|m| m.valid_bleu)])?;
    if let Some(layers) = history.first().and_then(|m| m.hnas_u.as_ref()).map(Vec::len) {
        let series: Vec<Series> = (0..layers)
            .map(|l| Series {
                name: format!("encoder layer {l}"),
                points: history.iter().filter_map(|m| m.hnas_u.as_ref().map(|u| (m.epoch as f64, u[l]))).collect(),
            })
            .collect();
        line_chart(&dir.join("hnas_u.svg"), "HNAS mixing weight u (mean over heads)", "epoch", "u", &series)?;
    }
    let per_layer = |v: &[f64]| v.iter().enumerate().map(|(l, &x)| (l as f64, x)).collect::<Vec<_>>();
    line_chart(
        &dir.join("head_diversity.svg"),
        "head diversity (Dist) of encoder self-attention, test set",
        "encoder layer",
        "Dist",
        &[Series { name: "Dist".into(), points: per_layer(dist) }],
    )?;
    line_chart(
        &dir.join("explained_away.svg"),
        "share of source tokens explained away (mass < 1e-8), test set",
        "encoder layer",
        "share",
        &[Series { name: "explained away".into(), points: per_layer(away) }],
    )?;
    Ok(())
}

/// Head diversity and the explained-away share of each encoder layer on `data`'s sources.
fn encoder_diagnostics(model: &Seq2Seq, data: &Encoded, device: Device) -> Result<(Vec<f64>, Vec<f64>)> {
    let layers = model.config().transformer.encoder_layers;
    let (mut dist, mut weight) = (vec![0.0; layers], 0.0);
    let (mut away, mut keys) = (vec![0.0; layers], 0.0);
    tch::no_grad(|| -> Result<()> {
        for chunk in (0..data.len()).collect::<Vec<_>>().chunks(64) {
            let rows: Vec<&[i64]> = chunk.iter().map(|&i| data.src[i].as_slice()).collect();
            let src = data::pad_rows(&rows, device);
            let valid = src.ne(PAD); // (B, S)
            let tokens = f64::try_from(valid.sum(Kind::Double))?;
            let heads = model.config().transformer.heads as f64;
            for (l, (w, h)) in model.encoder_attention(&src)?.into_iter().enumerate() {
                dist[l] += probattn::repulsive::head_diversity(&h, Some(&valid))? * tokens;
                let mass = probattn::diagnostics::received_mass(&w); // (B, H, S)
                let counted = valid.unsqueeze(1).expand_as(&mass);
                away[l] += f64::try_from(mass.lt(probattn::diagnostics::EXPLAINED_AWAY_EPS).logical_and(&counted).sum(Kind::Double))?;
                if l == 0 {
                    keys += tokens * heads;
                }
            }
            weight += tokens;
        }
        Ok(())
    })?;
    Ok((dist.iter().map(|d| d / weight.max(1.0)).collect(), away.iter().map(|a| a / keys.max(1.0)).collect()))
}

/// Replaces the parameters by the mean of the last `n` epochs' saved weights.
fn average_last(vs: &mut nn::VarStore, dir: &Path, last_epoch: usize, n: usize) -> Result<()> {
    let first = last_epoch.saturating_sub(n) + 1;
    let files: Vec<PathBuf> = (first..=last_epoch).map(|e| dir.join(format!("weights_epoch{e}.safetensors"))).collect();
    let mut sums: HashMap<String, Tensor> = HashMap::new();
    for f in &files {
        for (name, t) in probattn::io::read_safetensors(f)? {
            let t = t.to_kind(Kind::Double);
            let entry = sums.entry(name).or_insert_with(|| t.zeros_like());
            *entry = &*entry + t;
        }
    }
    for (name, mut t) in vs.variables() {
        let s = sums.get(&name).with_context(|| format!("the averaged checkpoints lack {name}"))?;
        tch::no_grad(|| t.copy_(&(s / files.len() as f64).to_kind(t.kind())));
    }
    eprintln!("test with the average of epochs {first}..={last_epoch}");
    Ok(())
}

/// `probattn export`: the model weights of a translate checkpoint as a safetensors state dict under
/// the PyTorch baseline's names ([`baseline_name`]), which python/baselines/translate.py loads with
/// `load_state_dict(strict=True)`. Returns the number of tensors written.
pub fn export_checkpoint(ckpt: &Path, out: &Path) -> Result<usize> {
    let (tensors, state) = read_checkpoint(ckpt)?;
    ensure!(
        state.config.model.share_all_embeddings,
        "{}: the PyTorch baseline shares one embedding matrix; this model does not",
        ckpt.display()
    );
    let vs = nn::VarStore::new(Device::Cpu);
    Seq2Seq::new(&vs.root(), state.config.model.clone())?;
    load_params(&vs, &tensors, ckpt)?;
    probattn::interop::export_params(&vs, out, |n| baseline_name(n).unwrap_or_else(|| n.to_string()))?;
    Ok(vs.variables().len())
}

/// `--decode`: translate a file with a trained checkpoint.
fn decode_file(args: &TranslateArgs, device: Device) -> Result<()> {
    let ckpt = args.checkpoint.as_ref().context("--decode needs --checkpoint")?;
    let input = args.input.as_ref().context("--decode needs --input")?;
    let (tensors, state) = read_checkpoint(ckpt)?;
    // A run keeps its tokenizer in the run folder, above the seed-N folders of its checkpoints
    // (and above the variants' folders of --attention all).
    let dir = ckpt.parent().unwrap_or(Path::new("."));
    let tok_path =
        dir.ancestors().take(3).map(|d| d.join("tokenizer.json")).find(|p| p.exists()).unwrap_or_else(|| dir.join("tokenizer.json"));
    let tokenizer = data::load_tokenizer(&tok_path)?;
    let vs = nn::VarStore::new(device);
    let model = Seq2Seq::new(&vs.root(), state.config.model.clone())?;
    load_params(&vs, &tensors, ckpt)?;
    let lines = data::read_sentences(input).context("--input")?;
    let sources: Vec<Vec<i64>> = lines
        .iter()
        .map(|l| {
            let mut ids = data::encode(&tokenizer, l)?;
            ids.push(data::EOS);
            Ok(ids)
        })
        .collect::<Result<_>>()?;
    let cfg = DecodeConfig { beam: args.beam, lenpen: args.lenpen, max_len_a: args.max_len_a, max_len_b: args.max_len_b };
    let bar = progress_bar(sources.len() as u64, "decoding".into())?;
    let start = Instant::now();
    let ids = decode::translate(&model, &sources, &cfg, args.decode_batch, device, |n| bar.inc(n as u64))?;
    let beam_s = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let text: Vec<String> = ids.iter().map(|h| data::decode(&tokenizer, h)).collect::<Result<_>>()?;
    let joined = text.join("\n") + "\n";
    if args.decode_bench {
        let greedy_cfg = DecodeConfig { beam: 1, ..cfg };
        let start = Instant::now();
        let cached = decode::translate(&model, &sources, &greedy_cfg, args.decode_batch, device, |_| ())?;
        let cached_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let uncached = decode::greedy_uncached(&model, &sources, &greedy_cfg, args.decode_batch, device)?;
        let uncached_s = start.elapsed().as_secs_f64();
        let same = cached.iter().zip(&uncached).filter(|(a, b)| a == b).count();
        let n = sources.len() as f64;
        eprintln!(
            "{}",
            serde_json::json!({
                "sentences": sources.len(), "batch": args.decode_batch, "threads": tch::get_num_threads(),
                "greedy_cached_sentences_per_second": n / cached_s, "greedy_uncached_sentences_per_second": n / uncached_s,
                "speedup": uncached_s / cached_s, "identical_outputs": same,
                "beam_sentences_per_second": n / beam_s, "beam": cfg.beam,
            })
        );
    }
    match &args.output {
        Some(out) => probattn::io::write_bytes_atomic(out, joined.as_bytes())?,
        None => print!("{joined}"),
    }
    Ok(())
}

/// The rows of `--attention all`: the repulsive-attention paper's MA and RMA, and the other
/// families on the same recipe.
const ALL_ROWS: [(&str, &str, Repulsive); 5] = [
    ("softmax", "softmax", Repulsive::None),
    ("softmax-svgd", "softmax", Repulsive::Svgd),
    ("dnas", "dnas", Repulsive::None),
    ("hnas", "hnas", Repulsive::None),
    ("bam-wc", "bam-wc", Repulsive::None),
];

pub fn run(args: &TranslateArgs) -> Result<()> {
    let device = args.common.setup()?;
    if args.decode {
        return decode_file(args, device);
    }
    ensure!(args.seeds >= 1, "--seeds must be at least 1");
    ensure!(args.checkpoint.is_none() && args.input.is_none(), "--checkpoint and --input go with --decode");
    let data_dir = args.data_dir();
    let all = args.attention == "all";
    let name = |attention: &str, repulsive: Repulsive| match repulsive {
        Repulsive::None => attention.to_string(),
        Repulsive::Svgd => format!("{attention}-svgd"),
        Repulsive::Spos => format!("{attention}-spos"),
    };
    let rows: Vec<(String, Variant, Repulsive)> = if all {
        ensure!(args.repulsive == Repulsive::None, "--attention all runs its own repulsive row; drop --repulsive");
        ALL_ROWS.iter().map(|(n, v, r)| Ok((n.to_string(), v.parse()?, *r))).collect::<Result<_>>()?
    } else {
        vec![(name(&args.attention, args.repulsive), args.attention.parse().context("--attention")?, args.repulsive)]
    };
    // Everything that can be checked before the run folder exists is: a bad flag or a missing
    // corpus leaves no empty folder behind.
    for (_, variant, repulsive) in &rows {
        TranslateConfig::from_args(args, 0, *variant, *repulsive)?;
    }
    let corpus = load_corpus(&data_dir, args)?;
    let resume = args.resume.is_some();
    let dir = match &args.resume {
        Some(d) => {
            ensure!(d.join("tokenizer.json").is_file(), "--resume {}: no tokenizer.json there, so no run to resume", d.display());
            d.clone()
        }
        None => run_dir(args.out.as_deref(), "translate", &name(&args.attention, args.repulsive))?,
    };
    let p = prepare(corpus, args, &dir, resume)?;
    let vocab = p.tokenizer.get_vocab_size(true) as i64;
    let mut table = vec![];
    for (row, variant, repulsive) in rows {
        let sub = if all { dir.join(&row) } else { dir.clone() };
        std::fs::create_dir_all(&sub).with_context(|| format!("creating {}", sub.display()))?;
        let cfg = TranslateConfig::from_args(args, vocab, variant, repulsive)?;
        let results = run_config(&p, &cfg, args, &sub, device, resume)?;
        let (dist, _) = mean_std(&results.runs.iter().map(|r| mean_std(&r.head_diversity).0).collect::<Vec<_>>());
        table.push(vec![
            row,
            format!("{:.2} ± {:.2}", results.test_bleu_tok_mean, results.test_bleu_tok_std),
            format!("{:.2} ± {:.2}", results.test_bleu_mean, results.test_bleu_std),
            format!("{:.2}", results.valid_bleu_mean),
            results.runs.len().to_string(),
            format!("{:.0}", results.tokens_per_second_mean),
            format!("{dist:.3}"),
        ]);
    }
    let header = [
        "attention",
        "test BLEU tok-lc (mean ± std)",
        "test sacreBLEU (mean ± std)",
        "valid sacreBLEU",
        "seeds",
        "train tokens/s",
        "Dist (encoder, mean over layers)",
    ];
    let summary = crate::report::markdown_table(&header, &table);
    println!("\n{summary}");
    if all {
        probattn::io::write_bytes_atomic(&dir.join("summary.md"), summary.as_bytes())?;
    }
    println!("results in {}", dir.display());
    Ok(())
}

/// Trains and tests every seed of one configuration in `dir`; writes its results.json.
fn run_config(
    p: &Prepared,
    cfg: &TranslateConfig,
    args: &TranslateArgs,
    dir: &Path,
    device: Device,
    resume: bool,
) -> Result<TranslateResults> {
    if resume {
        let path = dir.join("config.json");
        ensure!(path.is_file(), "--resume: {} is missing, so no run to resume there", path.display());
        let saved: TranslateConfig =
            serde_json::from_slice(&std::fs::read(&path)?).with_context(|| format!("{} does not parse", path.display()))?;
        ensure!(saved == *cfg, "--resume {}: the flags differ from the original run's (see its config.json)", dir.display());
    } else {
        write_json(&dir.join("config.json"), cfg)?;
    }
    println!(
        "{}-{}: {} / {} / {} sentence pairs, joint BPE {} symbols; {} layers, E = {}, {} heads, attention {} (cross-attention {}), repulsive {:?}; device {}, {} threads",
        cfg.src,
        cfg.tgt,
        p.train.len(),
        p.valid.len(),
        p.test.len(),
        cfg.model.vocab,
        cfg.model.transformer.encoder_layers,
        cfg.model.transformer.embed_dim,
        cfg.model.transformer.heads,
        cfg.model.transformer.variant,
        cfg.model.transformer.cross_variant(),
        cfg.repulsive,
        probattn::device::device_name(device),
        tch::get_num_threads()
    );
    let mut runs = vec![];
    for seed in args.seed_start..args.seed_start + args.seeds {
        runs.push(train_seed(p, cfg, seed, &dir.join(format!("seed-{seed}")), device, resume)?);
    }
    let stat = |f: fn(&RunResult) -> f64| mean_std(&runs.iter().map(f).collect::<Vec<_>>());
    let (test_bleu_mean, test_bleu_std) = stat(|r| r.test_bleu);
    let (test_bleu_tok_mean, test_bleu_tok_std) = stat(|r| r.test_bleu_tok);
    let results = TranslateResults {
        dataset: args.dataset_name(),
        attention: cfg.model.transformer.variant.to_string(),
        repulsive: cfg.repulsive,
        valid_bleu_mean: stat(|r| r.valid_bleu).0,
        tokens_per_second_mean: stat(|r| r.tokens_per_second).0,
        config: cfg.clone(),
        runs,
        test_bleu_mean,
        test_bleu_std,
        test_bleu_tok_mean,
        test_bleu_tok_std,
        provenance: Provenance::gather(device),
    };
    write_results(&dir.join("results.json"), &results)?;
    println!(
        "test BLEU over {} seed(s): sacreBLEU {:.2} ± {:.2}, tokenized lowercased {:.2} ± {:.2}",
        results.runs.len(),
        test_bleu_mean,
        test_bleu_std,
        test_bleu_tok_mean,
        test_bleu_tok_std
    );
    Ok(results)
}
