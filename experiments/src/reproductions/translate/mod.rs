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

mod args;
mod checkpoint;
mod evaluate;
mod loss;
pub mod optim;
mod train;

use args::Recipe;
pub use args::{Arch, Dataset, Preset, Repulsive, TranslateArgs};
pub use checkpoint::export_checkpoint;
use checkpoint::{load_params, read_checkpoint};
pub use loss::label_smoothed_loss;
use train::train_seed;

use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use probattn::normalize::BamConfig;
use probattn::precision::Precision;
use probattn::repulsive::{Method, RepulsiveConfig, Selection};
use probattn::{NormalizerConfig, Variant};
use probattn_models::translation::{Seq2Seq, Seq2SeqConfig};
use serde::{Deserialize, Serialize};
use tch::{nn, Device};
use tokenizers::Tokenizer;

use crate::provenance::{run_dir, write_json, write_results, Provenance};
use crate::ranks::{DistInfo, Ranks};
use crate::report::{mean_std, progress_bar};
use crate::seq2seq::data::{self, Corpus, Encoded, PAD};
use crate::seq2seq::decode::{self, DecodeConfig};
use optim::{AdamConfig, InverseSqrt, PlateauDecay, Schedule};

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
    /// Updates over which the KL weight rises linearly from 0 (0, and then left out of the JSON:
    /// the full weight from the start).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub kl_anneal_updates: u64,
    pub adam: AdamConfig,
    pub schedule: Schedule,
    /// Gradient norm clipping (0, and then left out of the JSON: none).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub max_grad_norm: f64,
    pub label_smoothing: f64,
    pub max_tokens: usize,
    pub bpe_vocab: usize,
    pub max_epochs: usize,
    pub max_updates: u64,
    pub patience: usize,
    pub decode: DecodeConfig,
    pub average_last: usize,
    /// The precision of training and decoding (absent from configs written before it: float32).
    #[serde(default)]
    pub precision: Precision,
    /// The first N pairs of each split used (`None`: all).
    pub limit_train: Option<usize>,
    pub limit_valid: Option<usize>,
    pub limit_test: Option<usize>,
}

fn is_zero_u64(x: &u64) -> bool {
    *x == 0
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

impl TranslateConfig {
    /// The KL weight of the update after `updates` updates (`kl_weight`, annealed).
    pub fn kl_weight_at(&self, updates: u64) -> f64 {
        match self.kl_anneal_updates {
            0 => self.kl_weight,
            n => self.kl_weight * ((updates + 1) as f64 / n as f64).min(1.0),
        }
    }
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
    /// Target tokens per second of training (forward, backward, hook and update); a distributed
    /// run's total over its ranks (comparable with a single process's).
    pub tokens_per_second: f64,
    /// A distributed run's tokens per second of each rank on its own, in rank order (over the
    /// epochs this job trained); absent in a single-process run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distributed_tokens_per_second: Option<Vec<f64>>,
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
    /// World size, backend and restarts of a run under torchrun; absent for one process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distributed: Option<DistInfo>,
    pub provenance: Provenance,
}

impl TranslateConfig {
    fn from_args(args: &TranslateArgs, vocab: i64, variant: Variant, repulsive: Repulsive) -> Result<Self> {
        let preset = args.preset();
        let arch = args.arch;
        if let Some(a) = preset.arch().filter(|a| *a != arch) {
            anyhow::bail!(
                "--preset {} is a preset of the {}; --arch {} takes {}",
                clap::ValueEnum::to_possible_value(&preset).map_or("?".into(), |v| v.get_name().to_string()),
                if a == Arch::Lstm { "attentional LSTM" } else { "Transformer" },
                if arch == Arch::Lstm { "lstm" } else { "transformer" },
                if arch == Arch::Lstm { "deng2018, deng2018-small or tiny" } else { "small, iwslt or tiny" }
            );
        }
        let recipe = preset.recipe(arch);
        let model = model_config(args, vocab, variant, repulsive)?;
        let schedule = schedule(args, &recipe)?;
        let label_smoothing = args.label_smoothing.unwrap_or(recipe.label_smoothing);
        let max_tokens = args.max_tokens.unwrap_or(if args.quick { 2000 } else { recipe.max_tokens });
        let max_grad_norm = args.max_grad_norm.unwrap_or(recipe.max_grad_norm);
        let selection: Selection = match &args.selection {
            Some(s) => serde_json::from_str(s)
                .with_context(|| format!("--selection {s:?} is not a selection (JSON with kinds, layers, projections)"))?,
            None => Selection::default(),
        };
        let method = if repulsive == Repulsive::Spos { Method::Spos } else { Method::Svgd };
        let repulsive_config =
            RepulsiveConfig { method, alpha: args.repulsive_alpha, stepsize: args.repulsive_stepsize, ..Default::default() };
        repulsive_config.validate()?;
        ensure!((0.0..1.0).contains(&label_smoothing), "--label-smoothing must lie in [0, 1)");
        ensure!(max_tokens >= 16, "--max-tokens must be at least 16");
        ensure!(max_grad_norm >= 0.0 && max_grad_norm.is_finite(), "--max-grad-norm must be finite and at least 0 (0: no clipping)");
        ensure!(args.beam >= 1, "--beam must be at least 1");
        Ok(Self {
            data_dir: args.data_dir().to_string_lossy().into(),
            src: args.src.clone(),
            tgt: args.tgt.clone(),
            preset,
            model,
            repulsive,
            repulsive_config,
            selection,
            kl_weight: args.kl_weight,
            kl_anneal_updates: args.kl_anneal_updates,
            adam: AdamConfig { beta1: 0.9, beta2: recipe.beta2, eps: 1e-8, weight_decay: args.weight_decay.unwrap_or(recipe.weight_decay) },
            schedule,
            max_grad_norm,
            label_smoothing,
            max_tokens,
            bpe_vocab: args.bpe_vocab.unwrap_or(recipe.bpe),
            max_epochs: args.max_epochs,
            // --quick's 300 updates unless --max-updates says otherwise (it used to override it).
            max_updates: if args.quick && args.max_updates == 0 { 300 } else { args.max_updates },
            patience: args.patience,
            decode: DecodeConfig { beam: args.beam, lenpen: args.lenpen, max_len_a: args.max_len_a, max_len_b: args.max_len_b },
            average_last: args.average_last,
            precision: args.precision.precision,
            limit_train: args.limit_train.or(args.quick.then_some(3000)),
            limit_valid: args.limit_valid.or(args.quick.then_some(100)),
            limit_test: args.limit_test,
        })
    }
}

/// The model of a run: its architecture's preset with the variant, the normalizer's settings and
/// the tile; a variant the LSTM refuses is refused here, before the run folder exists.
fn model_config(args: &TranslateArgs, vocab: i64, variant: Variant, repulsive: Repulsive) -> Result<Seq2SeqConfig> {
    let normalizer =
        NormalizerConfig { bam: BamConfig { k: args.k.unwrap_or(10.0), sigma: args.sigma, ..BamConfig::default() }, ..Default::default() };
    let (preset, tile) = (args.preset(), args.memory.tile());
    Ok(match args.arch {
        Arch::Transformer => {
            let mut transformer = preset.transformer();
            transformer.variant = variant;
            transformer.decoder_self_variant = args.decoder_self_attention.parse().context("--decoder-self-attention")?;
            transformer.normalizer = normalizer;
            transformer.tile = tile;
            Seq2SeqConfig { transformer: Some(transformer), lstm: None, vocab, pad: PAD, share_all_embeddings: true, max_positions: 1024 }
        }
        Arch::Lstm => {
            ensure!(repulsive == Repulsive::None, "--repulsive moves the heads of multi-head attention; the LSTM's attention has one head");
            ensure!(
                args.decoder_self_attention == "softmax",
                "--decoder-self-attention is the Transformer's; the LSTM decoder has no self-attention"
            );
            let lstm = probattn_models::lstm::LstmConfig { variant, normalizer, tile, ..preset.lstm() };
            // Built once here, on the CPU, so that a variant the LSTM refuses is refused before
            // the run folder exists.
            probattn_models::lstm::AttentionalLstm::new(&nn::VarStore::new(Device::Cpu).root(), lstm.clone(), vocab.max(PAD + 1), PAD)?;
            Seq2SeqConfig { transformer: None, lstm: Some(lstm), vocab, pad: PAD, share_all_embeddings: false, max_positions: 1024 }
        }
    })
}

/// The learning-rate schedule of a run: the preset's recipe, overridden by the flags.
fn schedule(args: &TranslateArgs, recipe: &Recipe) -> Result<Schedule> {
    Ok(match recipe.warmup {
        Some(warmup) => Schedule::InverseSqrt(InverseSqrt {
            lr: args.lr.unwrap_or(recipe.lr),
            warmup_updates: args.warmup_updates.unwrap_or(warmup),
            warmup_init_lr: args.warmup_init_lr,
        }),
        None => {
            ensure!(
                args.warmup_updates.is_none(),
                "--warmup-updates belongs to the inverse-sqrt schedule; the LSTM presets decay the rate as OpenNMT-py does"
            );
            Schedule::PlateauDecay(PlateauDecay { lr: args.lr.unwrap_or(recipe.lr), decay: 0.5, start_decay_at: recipe.start_decay_at })
        }
    })
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
        (Dataset::Multi30k, None) => {
            format!(" (`python -m probattn_tools.data.multi30k download --dir {}` fetches Multi30k)", data_dir.display())
        }
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

/// Rank 0 learns the BPE (or reads the resumed run's) and shares it with the other ranks.
fn prepare(corpus: Corpus, args: &TranslateArgs, dir: &Path, resume: bool, ranks: &Ranks) -> Result<Prepared> {
    let tok_path = dir.join("tokenizer.json");
    let mut json = vec![];
    if ranks.is_main() {
        let tokenizer = if resume {
            data::load_tokenizer(&tok_path)?
        } else {
            let vocab = args.bpe_vocab.unwrap_or(args.preset().recipe(args.arch).bpe);
            data::learn_bpe(&corpus.train, vocab, dir)?
        };
        json = tokenizer.to_string(true).map_err(|e| anyhow::anyhow!("serializing the tokenizer: {e}"))?.into_bytes();
        if !resume {
            probattn::io::write_bytes_atomic(&tok_path, &json)?;
        }
    }
    let tokenizer = data::tokenizer_from_json(&ranks.share_bytes(&json)?).context("rank 0's tokenizer")?;
    let train = Encoded::new(&tokenizer, &corpus.train)?;
    let valid = Encoded::new(&tokenizer, &corpus.valid)?;
    let test = Encoded::new(&tokenizer, &corpus.test)?;
    Ok(Prepared { corpus, tokenizer, train, valid, test })
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
    // Checkpoints are float32 whatever precision trained them; --precision picks the decoding's.
    let region = args.precision.precision.enter(device)?;
    let ids = decode::translate(&model, &sources, &cfg, args.decode_batch, device, |n| bar.inc(n as u64))?;
    region.exit()?;
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

/// The run's folder, and whether the run resumes there: `--resume`'s, the restarted job's `--out`
/// (torchrun's agent restarting the workers with --max-restarts), or a new one that rank 0 makes
/// and names (`name`) and shares with the other ranks, which never write there.
fn run_folder(args: &TranslateArgs, ranks: &Ranks, name: &str) -> Result<(std::path::PathBuf, bool)> {
    let restart = match (&args.resume, &args.out) {
        (None, Some(out)) if ranks.restarted() && out.join("tokenizer.json").is_file() => Some(out.clone()),
        (None, None) if ranks.restarted() => anyhow::bail!("a restarted job resumes from --out: give the run an --out folder"),
        _ => None,
    };
    let resume_dir = args.resume.clone().or(restart);
    let resume = resume_dir.is_some();
    let dir = match &resume_dir {
        Some(d) => {
            ensure!(
                !ranks.is_main() || d.join("tokenizer.json").is_file(),
                "--resume {}: no tokenizer.json there, so no run to resume",
                d.display()
            );
            d.clone()
        }
        None if ranks.is_main() => run_dir(args.out.as_deref(), "translate", name)?,
        None => std::path::PathBuf::new(),
    };
    Ok((std::path::PathBuf::from(ranks.share(&dir.to_string_lossy().into_owned())?), resume))
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

/// The rows of `--attention all --arch lstm`: the BAM paper's Table 4 pair, and causal DNAS.
const LSTM_ROWS: [(&str, &str, Repulsive); 3] =
    [("softmax", "softmax", Repulsive::None), ("dnas", "dnas", Repulsive::None), ("bam-wc", "bam-wc", Repulsive::None)];

pub fn run(args: &TranslateArgs) -> Result<()> {
    let device = args.common.setup()?;
    let _precision = args.precision.begin(device)?;
    if args.decode {
        return decode_file(args, device);
    }
    let (ranks, device) = Ranks::join(&args.dist, device)?;
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
        let rows = if args.arch == Arch::Lstm { &LSTM_ROWS[..] } else { &ALL_ROWS[..] };
        rows.iter().map(|(n, v, r)| Ok((n.to_string(), v.parse()?, *r))).collect::<Result<_>>()?
    } else {
        vec![(name(&args.attention, args.repulsive), args.attention.parse().context("--attention")?, args.repulsive)]
    };
    // Everything that can be checked before the run folder exists is: a bad flag or a missing
    // corpus leaves no empty folder behind.
    for (_, variant, repulsive) in &rows {
        TranslateConfig::from_args(args, 0, *variant, *repulsive)?;
    }
    let corpus = load_corpus(&data_dir, args)?;
    let (dir, resume) = run_folder(args, &ranks, &name(&args.attention, args.repulsive))?;
    let p = prepare(corpus, args, &dir, resume, &ranks)?;
    let vocab = p.tokenizer.get_vocab_size(true) as i64;
    let mut table = vec![];
    for (row, variant, repulsive) in rows {
        let sub = if all { dir.join(&row) } else { dir.clone() };
        if ranks.is_main() {
            std::fs::create_dir_all(&sub).with_context(|| format!("creating {}", sub.display()))?;
        }
        let cfg = TranslateConfig::from_args(args, vocab, variant, repulsive)?;
        let results = run_config(&p, &cfg, args, &sub, device, resume, &ranks)?;
        let (dist, _) = mean_std(&results.runs.iter().map(|r| mean_std(&r.head_diversity).0).collect::<Vec<_>>());
        table.push(vec![
            row,
            format!("{:.2} ± {:.2}", results.test_bleu_tok_mean, results.test_bleu_tok_std),
            format!("{:.2} ± {:.2}", results.test_bleu_mean, results.test_bleu_std),
            format!("{:.2}", results.valid_bleu_mean),
            results.runs.len().to_string(),
            format!("{:.0}", results.tokens_per_second_mean),
            if dist.is_nan() { "–".into() } else { format!("{dist:.3}") }, // the LSTM's encoder has no heads
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
    if !ranks.is_main() {
        return Ok(());
    }
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
    ranks: &Ranks,
) -> Result<TranslateResults> {
    let main = ranks.is_main();
    if resume && main {
        let path = dir.join("config.json");
        ensure!(path.is_file(), "--resume: {} is missing, so no run to resume there", path.display());
        let saved: TranslateConfig =
            serde_json::from_slice(&std::fs::read(&path)?).with_context(|| format!("{} does not parse", path.display()))?;
        ensure!(saved == *cfg, "--resume {}: the flags differ from the original run's (see its config.json)", dir.display());
    } else if main {
        write_json(&dir.join("config.json"), cfg)?;
    }
    if main {
        print_setup(p, cfg, device);
    }
    let mut runs = vec![];
    for seed in args.seed_start..args.seed_start + args.seeds {
        runs.push(train_seed(p, cfg, seed, &dir.join(format!("seed-{seed}")), device, resume, ranks)?);
    }
    let stat = |f: fn(&RunResult) -> f64| mean_std(&runs.iter().map(f).collect::<Vec<_>>());
    let (test_bleu_mean, test_bleu_std) = stat(|r| r.test_bleu);
    let (test_bleu_tok_mean, test_bleu_tok_std) = stat(|r| r.test_bleu_tok);
    let results = TranslateResults {
        dataset: args.dataset_name(),
        attention: cfg.model.variant().to_string(),
        repulsive: cfg.repulsive,
        valid_bleu_mean: stat(|r| r.valid_bleu).0,
        tokens_per_second_mean: stat(|r| r.tokens_per_second).0,
        config: cfg.clone(),
        runs,
        test_bleu_mean,
        test_bleu_std,
        test_bleu_tok_mean,
        test_bleu_tok_std,
        distributed: ranks.info(),
        provenance: Provenance::gather(device),
    };
    if !main {
        return Ok(results);
    }
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

/// The run's one-line description: data, model, attention, device.
fn print_setup(p: &Prepared, cfg: &TranslateConfig, device: Device) {
    println!(
        "{}-{}: {} / {} / {} sentence pairs, joint BPE {} symbols; {}, repulsive {:?}; device {}, {} threads",
        cfg.src,
        cfg.tgt,
        p.train.len(),
        p.valid.len(),
        p.test.len(),
        cfg.model.vocab,
        cfg.model.describe(),
        cfg.repulsive,
        probattn::device::device_name(device),
        tch::get_num_threads()
    );
}
