//! One seed's training and test: the updates (one process or a rank's share of each batch), the
//! epoch loop with its checkpoints (resumable), and the test with the best (or averaged) weights.
//! The checkpoints' format is `checkpoint.rs`; validation, decoding, diagnostics and plots are
//! `evaluate.rs`.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use probattn::distributed::Reducer;
use probattn::repulsive::{Method, RepulsiveHook};
use probattn_models::translation::Seq2Seq;
use tch::{nn, Device, Kind, Tensor};

use super::checkpoint::{average_last, fresh_state, load_params, read_checkpoint, save_checkpoint, TrainState};
use super::evaluate::{encoder_diagnostics, hnas_gates, plots, translate_and_score, valid_loss};
use super::loss::label_smoothed_loss;
use super::optim::{clip_grad_norm, Adam};
use super::{EpochMetrics, Prepared, Repulsive, RunResult, TranslateConfig};
use crate::harness::{train_epochs, EpochLine, MetricsLog, Plateau, Stopping, Training};
use crate::ranks::Ranks;
use crate::report::progress_bar;
use crate::seq2seq::data::{batch_tensors, epoch_order, token_batches, Batch};

/// Updates between two readings of the training loss on the CPU (progress bar, NaN check).
const SYNC_EVERY: usize = 10;

/// What one seed's training reads besides its model and optimizer.
struct SeedRun<'a> {
    p: &'a Prepared,
    cfg: &'a TranslateConfig,
    seed: u64,
    dir: &'a Path,
    device: Device,
    ranks: &'a Ranks,
}

/// This process's own training throughput (target tokens and seconds since it started or
/// resumed), for results.json's per-rank list.
#[derive(Default)]
struct OwnThroughput {
    tokens: f64,
    seconds: f64,
}

/// Trains one seed in `dir` (resuming from its checkpoint when there is one); returns its result.
/// Under several ranks, rank 0 reads and writes the files and shares what it read.
pub(super) fn train_seed(
    p: &Prepared,
    cfg: &TranslateConfig,
    seed: u64,
    dir: &Path,
    device: Device,
    resume: bool,
    ranks: &Ranks,
) -> Result<RunResult> {
    let main = ranks.is_main();
    if main {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let run = SeedRun { p, cfg, seed, dir, device, ranks };
    tch::manual_seed(seed as i64);
    let mut vs = nn::VarStore::new(device);
    let model = Seq2Seq::new(&vs.root(), cfg.model.clone())?;
    let mut adam = Adam::new(&vs, cfg.adam);
    let hook = match cfg.repulsive {
        Repulsive::None => None,
        _ => {
            let mut h = RepulsiveHook::new(cfg.repulsive_config.clone(), cfg.selection.clone())?;
            model.transformer().context("repulsive heads need the Transformer's multi-head attention")?.register_repulsive(&mut h);
            Some(h)
        }
    };
    let mut state = if main { start_or_resume(&run, &vs, &mut adam, resume)? } else { fresh_state(cfg, seed) };
    let reducer = match ranks.group() {
        Some(group) => {
            // Rank 0's state, parameters and optimizer moments (fresh or resumed) on every rank.
            state = ranks.share(&state)?;
            group.broadcast_vars(&vs)?;
            let moments = adam.state_tensors();
            group.broadcast(&moments.iter().map(|(_, t)| t).collect::<Vec<_>>(), 0)?;
            adam.step = state.updates;
            Some(group.reducer(&vs.trainable_variables(), false)?)
        }
        None => None,
    };
    let (batches, dropped) = token_batches(&p.train, cfg.max_tokens, cfg.model.max_positions as usize);
    if dropped > 0 && state.epoch == 0 && main {
        eprintln!("left out {dropped} training pairs longer than {} tokens", cfg.model.max_positions);
    }
    let mut metrics = if main { Some(MetricsLog::append_to(&dir.join("metrics.jsonl"))?) } else { None };
    let (done, mut plateau) = (state.epoch, state.plateau);
    let stop = Stopping { max_epochs: cfg.max_epochs, patience: cfg.patience };
    let mut training = SeedTraining {
        run: &run,
        vs: &vs,
        model: &model,
        hook: hook.as_ref(),
        reducer: reducer.as_ref(),
        adam: &mut adam,
        batches: &batches,
        state: &mut state,
        own: OwnThroughput::default(),
    };
    train_epochs(&mut training, stop, done, &mut plateau, metrics.as_mut())?;
    let own = training.own;
    state.plateau = plateau;
    let per_rank = ranks.gather(own.tokens / own.seconds.max(1e-9))?;
    let mut result = test_seed(&run, &mut vs, &model, &adam, &state)?;
    result.distributed_tokens_per_second = ranks.group().map(|_| per_rank);
    Ok(result)
}

impl EpochLine for EpochMetrics {
    fn epoch(&self) -> usize {
        self.epoch
    }
    fn score(&self) -> f64 {
        self.valid_bleu
    }
}

/// One seed's training, as the harness's epoch loop drives it. Every rank takes the same
/// decisions (every rank has the same validation BLEU); rank 0 alone writes files.
struct SeedTraining<'a> {
    run: &'a SeedRun<'a>,
    vs: &'a nn::VarStore,
    model: &'a Seq2Seq,
    hook: Option<&'a RepulsiveHook>,
    reducer: Option<&'a Reducer>,
    adam: &'a mut Adam,
    batches: &'a [Batch],
    state: &'a mut TrainState,
    own: OwnThroughput,
}

impl Training for SeedTraining<'_> {
    type Epoch = EpochMetrics;

    fn epoch(&mut self, _done: usize) -> Result<EpochMetrics> {
        train_epoch(self.run, self.model, self.hook, self.reducer, self.adam, self.batches, self.state, &mut self.own)
    }

    fn keep(&mut self, _: &EpochMetrics, plateau: &Plateau) -> Result<()> {
        self.state.plateau = *plateau;
        if self.run.ranks.is_main() {
            save_checkpoint(&self.run.dir.join("checkpoint_best.safetensors"), self.vs, self.adam, self.state)?;
        }
        Ok(())
    }

    /// The epoch's line on stdout, the weights for `--average-last`, and the last checkpoint.
    fn after(&mut self, m: EpochMetrics, plateau: &Plateau) -> Result<()> {
        let (cfg, dir, state) = (self.run.cfg, self.run.dir, &mut *self.state);
        state.plateau = *plateau;
        if !self.run.ranks.is_main() {
            state.history.push(m);
            return Ok(());
        }
        println!(
            "seed {} epoch {:3}: {} updates, train loss {:.3}, valid loss {:.3}, valid BLEU {:.2}, {:.0} tok/s, {:.0} s",
            self.run.seed, m.epoch, m.updates, m.train_loss, m.valid_loss, m.valid_bleu, m.tokens_per_second, m.seconds
        );
        if cfg.average_last > 0 {
            let named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
            let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
            probattn::io::write_safetensors_atomic(&dir.join(format!("weights_epoch{}.safetensors", state.epoch)), &refs)?;
            if state.epoch > cfg.average_last {
                let _ = std::fs::remove_file(dir.join(format!("weights_epoch{}.safetensors", state.epoch - cfg.average_last)));
            }
        }
        state.history.push(m);
        save_checkpoint(&dir.join("checkpoint_last.safetensors"), self.vs, self.adam, state)
    }

    /// `--max-updates` reached.
    fn finished(&self) -> bool {
        self.run.cfg.max_updates > 0 && self.state.updates >= self.run.cfg.max_updates
    }
}

/// A fresh training state, or the one in `dir`'s last checkpoint (with the model's and the
/// optimizer's tensors loaded) when resuming; metrics.jsonl is made to match it.
fn start_or_resume(run: &SeedRun, vs: &nn::VarStore, adam: &mut Adam, resume: bool) -> Result<TrainState> {
    let (cfg, seed, dir) = (run.cfg, run.seed, run.dir);
    let last = dir.join("checkpoint_last.safetensors");
    let fresh = fresh_state(cfg, seed);
    if resume {
        // A kill during an atomic write leaves only its temporary file behind: remove it.
        for entry in std::fs::read_dir(dir)?.flatten() {
            if entry.file_name().to_string_lossy().contains(".tmp-") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    if !(resume && last.exists()) {
        // A fresh start: drop any metrics of an earlier attempt in this folder.
        let _ = std::fs::remove_file(dir.join("metrics.jsonl"));
        return Ok(fresh);
    }
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
    load_params(vs, &tensors, &last)?;
    adam.load_state(&tensors, saved.updates).with_context(|| last.display().to_string())?;
    eprintln!("resuming seed {seed} after epoch {} ({} updates)", saved.epoch, saved.updates);
    // metrics.jsonl gets an epoch's line just before checkpoint_last is saved: a kill between
    // the two leaves a line the checkpoint does not know, which the resumed epoch would write
    // again. The checkpoint's history is the record: rewrite the file from it.
    let lines: String = saved.history.iter().map(|m| serde_json::to_string(m).map(|l| l + "\n")).collect::<serde_json::Result<_>>()?;
    probattn::io::write_bytes_atomic(&dir.join("metrics.jsonl"), lines.as_bytes())?;
    Ok(saved)
}

/// The epoch's running sums of (loss, nll, KL). Per-update values stay on the device and reach
/// the CPU together every SYNC_EVERY updates and at the end of the epoch: one synchronization
/// instead of three per update. They are added in update order, so the sums are the same.
struct LossSums {
    seed: u64,
    sums: [f64; 3],
    pending: Vec<Tensor>,
    /// The (1-based) update number of `pending[0]`.
    first_pending: u64,
}

impl LossSums {
    fn new(seed: u64) -> Self {
        Self { seed, sums: [0.0; 3], pending: vec![], first_pending: 0 }
    }

    /// Adds update `update`'s (loss, nll, KL); true when that brought the sums up to date.
    fn push(&mut self, update: u64, values: Tensor) -> Result<bool> {
        if self.pending.is_empty() {
            self.first_pending = update;
        }
        self.pending.push(values);
        if self.pending.len() < SYNC_EVERY {
            return Ok(false);
        }
        self.flush()?;
        Ok(true)
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let values: Vec<f64> = Vec::try_from(Tensor::stack(&self.pending, 0).view([-1]).to_device(Device::Cpu))?;
        for (i, row) in values.chunks(3).enumerate() {
            let update = self.first_pending + i as u64;
            ensure!(row[0].is_finite(), "the training loss became {} at update {update} (seed {})", row[0], self.seed);
            for (sum, v) in self.sums.iter_mut().zip(row) {
                *sum += v;
            }
        }
        self.pending.clear();
        Ok(())
    }
}

/// What one update hands back: its (loss, nll, KL) on the device, this rank's target tokens, and
/// whether the model has a KL term.
struct UpdateStats {
    values: Tensor,
    tokens: usize,
    has_kl: bool,
}

/// One update on this rank's share of `whole` (a batch's sentence indices): forward, the loss
/// scaled so that the ranks' mean is the whole batch's loss per target token, backward (with
/// the gradient all-reduce under several ranks), the repulsive hook, Adam's step at `lr`.
#[allow(clippy::too_many_arguments)]
fn update(
    run: &SeedRun,
    model: &Seq2Seq,
    hook: Option<&RepulsiveHook>,
    reducer: Option<&Reducer>,
    adam: &mut Adam,
    whole: &[usize],
    lr: f64,
    kl_weight: f64,
) -> Result<UpdateStats> {
    let (p, cfg, device, ranks) = (run.p, run.cfg, run.device, run.ranks);
    let world = ranks.world_size() as f64;
    let share = ranks.shard(whole.len());
    ensure!(!share.is_empty(), "a batch of {} sentences cannot be shared by {} ranks: raise --max-tokens", whole.len(), ranks.world_size());
    let whole_tokens: usize = whole.iter().map(|&i| p.train.tgt[i].len()).sum();
    let t = batch_tensors(&p.train, &whole[share], device);
    // The forward pass in the run's precision; the loss takes its log-probabilities in float32.
    let region = cfg.precision.enter(device)?;
    let (logits, kl) = model.forward_t(&t.src, &t.prev, true)?;
    let (loss, nll) = label_smoothed_loss(&logits, &t.target, cfg.label_smoothing);
    region.exit()?;
    let mut objective = &loss * (world / whole_tokens as f64);
    let kl_value = match &kl {
        Some(kl) => {
            // The KL is a mean over this rank's attention entries: weighed by the rank's share of
            // the batch's target tokens (1 in a single process).
            objective += kl * (kl_weight * world * t.ntokens as f64 / whole_tokens as f64);
            kl.detach().to_kind(Kind::Double)
        }
        None => Tensor::zeros([], (Kind::Double, device)),
    };
    adam.zero_grad();
    match reducer {
        Some(r) => r.backward(&objective)?, // the gradients are the ranks' mean when it returns
        None => objective.f_backward()?,
    }
    if let Some(h) = hook {
        h.apply()?;
        if let (Some(group), Method::Spos) = (ranks.group(), h.config().method) {
            // SPOS's noise is drawn on each rank: rank 0's direction for every rank.
            let grads: Vec<Tensor> = h.params().iter().map(Tensor::grad).collect();
            group.broadcast(&grads.iter().collect::<Vec<_>>(), 0)?;
        }
    }
    if cfg.max_grad_norm > 0.0 {
        // After the all-reduce and the hook: the norm of the gradient Adam will take.
        clip_grad_norm(&adam.params(), cfg.max_grad_norm);
    }
    adam.step(lr);
    let values = Tensor::stack(&[loss.detach().to_kind(Kind::Double), nll.detach().to_kind(Kind::Double), kl_value], 0);
    Ok(UpdateStats { values, tokens: t.ntokens, has_kl: kl.is_some() })
}

/// One epoch: the updates over `batches` in the epoch's seeded order, then validation loss and
/// BLEU; advances `state`'s epoch, update, time and token counts and returns the epoch's line.
///
/// Under several ranks every rank walks the same batches and takes its share of each batch's
/// sentences ([`update`]), so the run sees exactly one process's batches.
#[allow(clippy::too_many_arguments)]
fn train_epoch(
    run: &SeedRun,
    model: &Seq2Seq,
    hook: Option<&RepulsiveHook>,
    reducer: Option<&Reducer>,
    adam: &mut Adam,
    batches: &[Batch],
    state: &mut TrainState,
    own: &mut OwnThroughput,
) -> Result<EpochMetrics> {
    let (p, cfg, seed, device, ranks) = (run.p, run.cfg, run.seed, run.device, run.ranks);
    let epoch = state.epoch;
    let done_by_updates = |u: u64| cfg.max_updates > 0 && u >= cfg.max_updates;
    // Dropout, BAM noise and the batch order depend on (seed, epoch) only; each rank's dropout
    // and noise on its rank too (rank 0's are a single process's).
    let rank_offset = (ranks.rank() as i64).wrapping_mul(0x9E37_79B9);
    tch::manual_seed((seed as i64).wrapping_mul(1_000_003).wrapping_add(epoch as i64 + 1).wrapping_add(rank_offset));
    let order = epoch_order(batches, seed, epoch);
    let valid_losses: Vec<f64> = state.history.iter().map(|m| m.valid_loss).collect();
    let bar = progress_bar(order.len() as u64, format!("seed {seed} epoch {}", epoch + 1))?;
    let start = Instant::now();
    let mut sums = LossSums::new(seed);
    let (mut tokens, mut steps, mut has_kl) = (0usize, 0usize, false);
    for &bi in &order {
        if done_by_updates(state.updates) {
            break;
        }
        // As fairseq: update n (1-based) runs at the rate the schedule set after update n − 1,
        // so the first one at warmup_init_lr.
        let lr = cfg.schedule.lr(state.updates, &valid_losses);
        let u = update(run, model, hook, reducer, adam, &batches[bi], lr, cfg.kl_weight_at(state.updates))?;
        state.updates += 1;
        (tokens, steps, has_kl) = (tokens + u.tokens, steps + 1, u.has_kl);
        if sums.push(state.updates, u.values)? {
            let secs = start.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!(
                "loss {:.3}, lr {lr:.2e}, {:.1} upd/s, {:.0} tok/s",
                sums.sums[0] / tokens as f64,
                steps as f64 / secs,
                tokens as f64 / secs
            ));
        }
        bar.inc(1);
    }
    sums.flush()?;
    let seconds = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    own.tokens += tokens as f64;
    own.seconds += seconds;
    // The job's sums: every rank's tokens, the slowest rank's time.
    let [loss_sum, nll_sum, kl_sum] = sums.sums;
    let [loss_sum, nll_sum, kl_sum, tokens, kl_terms] = ranks.sum(&[loss_sum, nll_sum, kl_sum, tokens as f64, steps as f64])?[..] else {
        unreachable!("five sums")
    };
    let seconds = ranks.gather(seconds)?.into_iter().fold(0.0, f64::max);
    state.train_seconds += seconds;
    state.train_tokens += tokens as u64;
    let region = cfg.precision.enter(device)?;
    let (valid_loss, valid_nll) = valid_loss(model, &p.valid, cfg, device, ranks)?;
    let (_, vb, _, _) = translate_and_score(model, &p.tokenizer, &p.valid, &p.corpus.valid.tgt, &cfg.decode, device, "valid", ranks)?;
    region.exit()?;
    state.epoch += 1;
    Ok(EpochMetrics {
        seed,
        epoch: state.epoch,
        updates: state.updates,
        lr: cfg.schedule.lr(state.updates, &[valid_losses, vec![valid_loss]].concat()),
        train_loss: loss_sum / tokens.max(1.0),
        train_nll: nll_sum / tokens.max(1.0),
        kl: has_kl.then(|| kl_sum / kl_terms.max(1.0)),
        valid_loss,
        valid_nll,
        valid_bleu: vb.bleu,
        seconds,
        tokens_per_second: tokens / seconds.max(1e-9),
        hnas_u: hnas_gates(model),
    })
}

/// The test: the best checkpoint, or the average of the last N epochs' weights, translates the
/// test set; its translations, diagnostics and plots go into the seed's folder.
fn test_seed(run: &SeedRun, vs: &mut nn::VarStore, model: &Seq2Seq, adam: &Adam, state: &TrainState) -> Result<RunResult> {
    let (p, cfg, seed, dir, device, ranks) = (run.p, run.cfg, run.seed, run.dir, run.device, run.ranks);
    if ranks.is_main() {
        let best = dir.join("checkpoint_best.safetensors");
        let (tensors, _) = read_checkpoint(&best)?;
        load_params(vs, &tensors, &best)?;
        if cfg.average_last > 0 {
            average_last(vs, dir, state.epoch, cfg.average_last)?;
            // Kept so that `--decode --checkpoint` can translate with the averaged model too.
            save_checkpoint(&dir.join("checkpoint_average.safetensors"), vs, adam, state)?;
        }
    }
    if let Some(group) = ranks.group() {
        group.broadcast_vars(vs)?; // the test weights, which rank 0 read
    }
    let region = cfg.precision.enter(device)?;
    let (hyps, bleu, tok, sps) = translate_and_score(model, &p.tokenizer, &p.test, &p.corpus.test.tgt, &cfg.decode, device, "test", ranks)?;
    region.exit()?;
    // The diagnostics and the files are rank 0's.
    let (head_diversity, explained_away) = if ranks.is_main() {
        probattn::io::write_bytes_atomic(&dir.join("test.hyp"), (hyps.join("\n") + "\n").as_bytes())?;
        let (dist, away) = encoder_diagnostics(model, &p.test, device)?;
        plots(dir, &state.history, &dist, &away)?;
        println!("seed {seed} test: {} {} | tokenized lowercased: BLEU = {:.2} {}", bleu.line(), bleu.signature, tok.bleu, tok.signature);
        (dist, away)
    } else {
        (vec![], vec![])
    };
    Ok(RunResult {
        seed,
        test_bleu: bleu.bleu,
        test_bleu_tok: tok.bleu,
        valid_bleu: state.plateau.best,
        best_epoch: state.plateau.best_epoch,
        epochs: state.epoch,
        updates: state.updates,
        train_seconds: state.train_seconds,
        tokens_per_second: state.train_tokens as f64 / state.train_seconds.max(1e-9),
        distributed_tokens_per_second: None,
        test_sentences_per_second: sps,
        test_signature: bleu.signature,
        test_signature_tok: tok.signature,
        head_diversity,
        explained_away,
    })
}
