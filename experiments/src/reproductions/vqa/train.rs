//! One seed's training of the VQA model: batches, the epoch loop with early stopping on
//! validation accuracy, and the scores of a split.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use probattn::precision::{widen, Precision};
use probattn::Mode;
use probattn_models::vqa::VqaModel;
use serde::Serialize;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use super::data::{Questions, Views};
use super::v2;
use super::{Prepared, RunResult, VqaRunConfig};
use crate::harness::{train_epochs, BestWeights, EpochLine, MetricsLog, Plateau, Stopping, Training};
use crate::provenance::write_json;
use crate::ranks::Ranks;
use crate::report::progress_bar;
use probattn::distributed::Reducer;

/// A batch of one split, on the device.
pub(super) struct Batch {
    pub(super) views: Vec<Tensor>,
    pub(super) tokens: Tensor,
    pub(super) answer: Tensor,
    /// VQA-v2's soft scores `(B, answers)`.
    pub(super) target: Option<Tensor>,
    pub(super) kind: Tensor,
}

/// The question rows of a split in order, `size` at a time (evaluation batches).
pub(super) fn chunks(q: &Questions, size: i64) -> impl Iterator<Item = Tensor> + '_ {
    (0..q.len())
        .step_by(size as usize)
        .map(move |start| Tensor::arange_start(start, (start + size).min(q.len()), (Kind::Int64, Device::Cpu)))
}

pub(super) fn batch_of(views: &Views, q: &Questions, idx: &Tensor, device: Device) -> Result<Batch> {
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
pub(super) fn accuracy_of(b: &Batch, predicted: &Tensor) -> Result<Vec<f64>> {
    let acc = match &b.target {
        Some(t) => t.gather(1, &predicted.unsqueeze(1), false).squeeze_dim(1).to_kind(Kind::Double),
        None => predicted.eq_tensor(&b.answer).to_kind(Kind::Double),
    };
    Ok(Vec::<f64>::try_from(acc.to_device(Device::Cpu))?)
}

/// Accuracy and (summed accuracy, questions) per question type over a split, eval mode.
pub(super) fn evaluate(
    model: &VqaModel,
    p: &Prepared,
    split: &str,
    device: Device,
    precision: Precision,
) -> Result<(f64, Vec<(f64, u64)>)> {
    score(p, split, device, &|views, tokens| Ok(widen(&precision.run(device, || model.forward(views, tokens, Mode::EVAL))??.logits)))
}

/// Accuracy and (summed accuracy, questions) per question type of `predict` (views, tokens ->
/// logits `(B, answers)`) over a split, under `no_grad`.
pub(super) fn score(
    p: &Prepared,
    split: &str,
    device: Device,
    predict: &dyn Fn(&[Tensor], &Tensor) -> Result<Tensor>,
) -> Result<(f64, Vec<(f64, u64)>)> {
    score_and_predict(p, split, device, predict).map(|(acc, per_type, _)| (acc, per_type))
}

/// [`score`], and every predicted answer id in question order.
/// Accuracy, per question type (accuracy, count), and the predicted answers.
pub(super) type Scored = (f64, Vec<(f64, u64)>, Vec<i64>);

pub(super) fn score_and_predict(
    p: &Prepared,
    split: &str,
    device: Device,
    predict: &dyn Fn(&[Tensor], &Tensor) -> Result<Tensor>,
) -> Result<Scored> {
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
    /// The same accuracies in `meta.json`'s type order, for the trace (not in the file).
    #[serde(skip)]
    val_by_type: Vec<f64>,
}

impl EpochLine for EpochMetrics {
    fn epoch(&self) -> usize {
        self.epoch
    }
    fn score(&self) -> f64 {
        self.val_acc
    }
}

/// What one run records for its plots: HNAS's `u` every 50 updates (`(update, u per view)`) and the
/// validation accuracy per question type after every epoch (`(epoch, accuracy per type)`, the types
/// in `meta.json`'s order).
#[derive(Default)]
pub(super) struct Trace {
    pub(super) gates: Vec<(f64, Vec<f64>)>,
    pub(super) val_by_type: Vec<(f64, Vec<f64>)>,
}

/// What an epoch's updates read besides the model and the optimizer.
struct Trainer<'a> {
    p: &'a Prepared,
    cfg: &'a VqaRunConfig,
    device: Device,
    ranks: &'a Ranks,
    reducer: Option<Reducer>,
}

impl<'a> Trainer<'a> {
    /// Under several ranks: rank 0's initial weights everywhere, and DDP's reducer over them.
    fn new(p: &'a Prepared, cfg: &'a VqaRunConfig, device: Device, ranks: &'a Ranks, vs: &nn::VarStore) -> Result<Self> {
        let reducer = match ranks.group() {
            Some(group) => {
                group.broadcast_vars(vs)?;
                // Some parameters get no gradient in some configurations (a fusion's unused view
                // projections): the reducer looks for them each step, as DDP's find_unused_parameters.
                Some(group.reducer(&vs.trainable_variables(), true)?)
            }
            None => None,
        };
        Ok(Self { p, cfg, device, ranks, reducer })
    }

    /// One epoch's updates in `order` (question rows; every rank's the same), each rank on its
    /// share of each batch; returns the mean training loss and KL term over the updates.
    fn epoch(
        &self,
        model: &VqaModel,
        opt: &mut nn::Optimizer,
        order: &Tensor,
        seed: u64,
        epoch: usize,
        trace: &mut Trace,
    ) -> Result<(f64, f64)> {
        let (p, cfg, device, ranks) = (self.p, self.cfg, self.device, self.ranks);
        let train = &p.data.splits["train"];
        let steps_per_epoch = (train.len() + cfg.batch - 1) / cfg.batch;
        let world = ranks.world_size() as f64;
        let bar = progress_bar(steps_per_epoch as u64, format!("{} seed {seed} epoch {epoch}", cfg.model.fusion_name()))?;
        // Summed on the device (float64) and read every 50 updates: no CPU sync per update.
        let (loss_sum, kl_sum) = (Tensor::zeros([], (Kind::Double, device)), Tensor::zeros([], (Kind::Double, device)));
        for step in 0..steps_per_epoch {
            let whole = order.narrow(0, step * cfg.batch, cfg.batch.min(train.len() - step * cfg.batch));
            let share = ranks.shard(whole.size()[0] as usize);
            ensure!(!share.is_empty(), "a batch of {} questions cannot be shared by {} ranks", whole.size()[0], ranks.world_size());
            let share_weight = world * share.len() as f64 / whole.size()[0] as f64;
            let idx = whole.narrow(0, share.start as i64, share.len() as i64);
            let b = batch_of(&p.views, train, &idx, device)?;
            // The forward pass in the run's precision, the loss in float32.
            let out = cfg.precision.run(device, || model.forward(&b.views, &b.tokens, Mode::TRAIN))??;
            let logits = widen(&out.logits);
            let mut loss = match &b.target {
                // Pythia's soft-score loss: binary cross-entropy per answer, times the answers.
                Some(t) => logits.binary_cross_entropy_with_logits::<Tensor>(t, None, None, tch::Reduction::Mean) * t.size()[1] as f64,
                None => logits.cross_entropy_for_logits(&b.answer),
            };
            if let Some(kl) = &out.kl {
                if cfg.kl_weight != 0.0 {
                    loss = loss + kl * cfg.kl_weight;
                }
                let _ = kl_sum.shallow_clone().g_add_(&kl.detach().to_kind(Kind::Double));
            }
            // One process: share_weight is 1. Several: the ranks' mean is the whole batch's.
            let loss = loss * share_weight;
            opt.zero_grad();
            match &self.reducer {
                Some(r) => r.backward(&loss)?,
                None => loss.f_backward()?,
            }
            opt.step();
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
        bar.finish_and_clear();
        let [loss_total, kl_total] = ranks.sum(&[f64::try_from(&loss_sum)?, f64::try_from(&kl_sum)?])?[..] else {
            unreachable!("two sums")
        };
        Ok((loss_total / world / steps_per_epoch as f64, kl_total / world / steps_per_epoch as f64))
    }
}

/// One seed's training, as the harness's epoch loop drives it.
struct VqaTraining<'a> {
    p: &'a Prepared,
    cfg: &'a VqaRunConfig,
    seed: u64,
    device: Device,
    ranks: &'a Ranks,
    model: VqaModel,
    opt: nn::Optimizer,
    trainer: Trainer<'a>,
    trace: &'a mut Trace,
    lr: f64,
    kept: BestWeights,
    /// Seconds in the updates alone (no validation), summed over epochs.
    update_seconds: f64,
    start: Instant,
}

impl Training for VqaTraining<'_> {
    type Epoch = EpochMetrics;

    fn epoch(&mut self, epoch: usize) -> Result<EpochMetrics> {
        let (p, seed, ranks) = (self.p, self.seed, self.ranks);
        let train = &p.data.splits["train"];
        tch::manual_seed((seed * 1_000 + epoch as u64) as i64);
        let order = Tensor::randperm(train.len(), (Kind::Int64, Device::Cpu));
        if ranks.rank() > 0 {
            // The order above is every rank's; dropout and noise below are this rank's own.
            tch::manual_seed(((seed * 1_000 + epoch as u64) as i64).wrapping_add((ranks.rank() as i64).wrapping_mul(0x9E37_79B9)));
        }
        let loop_start = Instant::now();
        let (train_loss, kl_mean) = self.trainer.epoch(&self.model, &mut self.opt, &order, seed, epoch, self.trace)?;
        self.update_seconds += loop_start.elapsed().as_secs_f64();
        ensure!(train_loss.is_finite(), "training loss became {train_loss} in epoch {epoch} (seed {seed})");
        let (val_acc, val_per_type) = evaluate(&self.model, p, "val", self.device, self.cfg.precision)?;
        // Per type too: a plateau on one question type (Sort-of-CLEVR's closest) hides in the mean.
        let val_by_type: Vec<f64> = val_per_type.iter().map(|(h, n)| *h / (*n).max(1) as f64).collect();
        let val_acc_by_type: BTreeMap<String, f64> = p.data.meta.types.iter().cloned().zip(val_by_type.iter().copied()).collect();
        Ok(EpochMetrics {
            epoch,
            hnas_u: gates(&self.model)?,
            kl: kl_mean,
            lr: self.lr,
            seconds: self.start.elapsed().as_secs_f64(),
            seed,
            train_loss,
            val_acc,
            val_acc_by_type,
            val_by_type,
        })
    }

    fn keep(&mut self, _: &EpochMetrics, _: &Plateau) -> Result<()> {
        self.kept.keep();
        Ok(())
    }

    /// The trace, the epoch's line on stdout, and the learning-rate decay after every
    /// `lr_patience` epochs waited (unless patience has run out).
    fn after(&mut self, m: EpochMetrics, plateau: &Plateau) -> Result<()> {
        self.trace.val_by_type.push((m.epoch as f64, m.val_by_type));
        if self.ranks.is_main() {
            println!(
                "{} seed {} epoch {:3}: train loss {:.4}, val acc {:.4}, {:.0} s",
                self.cfg.model.fusion_name(),
                self.seed,
                m.epoch,
                m.train_loss,
                m.val_acc,
                self.start.elapsed().as_secs_f64()
            );
        }
        let cfg = self.cfg;
        let waited = plateau.waited;
        if waited > 0 && waited < cfg.patience && cfg.lr_decay != 1.0 && waited % cfg.lr_patience == 0 {
            self.lr *= cfg.lr_decay;
            self.opt.set_lr(self.lr);
        }
        Ok(())
    }
}

/// HNAS's `u` per secondary view, when the fusion has gates.
fn gates(model: &VqaModel) -> Result<Option<Vec<f64>>> {
    Ok(model.fusion.gates().map(|u| Vec::<f64>::try_from(u.to_kind(Kind::Double).to_device(Device::Cpu))).transpose()?)
}

/// Trains one model from `seed`; appends per-epoch metrics to `metrics` (rank 0's) and to
/// `trace`.
///
/// Under several ranks every rank draws the same question order and takes its share of each
/// batch; each rank's loss is scaled by its share of the batch times the world size, so the
/// reducer's mean is the whole batch's mean loss. Every rank evaluates the whole validation set
/// (the same weights give the same accuracy), so early stopping decides alike everywhere.
pub(super) fn train_run(
    p: &Prepared,
    cfg: &VqaRunConfig,
    seed: u64,
    device: Device,
    metrics: Option<&mut MetricsLog>,
    trace: &mut Trace,
    ranks: &Ranks,
) -> Result<(RunResult, VqaModel)> {
    tch::manual_seed(seed as i64);
    let vs = nn::VarStore::new(device);
    let model = VqaModel::new(&vs.root(), cfg.model.clone())?;
    let opt = nn::Adam::default().build(&vs, cfg.lr)?;
    let trainer = Trainer::new(p, cfg, device, ranks, &vs)?;
    let kept = BestWeights::new(&vs);
    let start = Instant::now();
    let mut training =
        VqaTraining { p, cfg, seed, device, ranks, model, opt, trainer, trace, lr: cfg.lr, kept, update_seconds: 0.0, start };
    // −1: below any accuracy, so the first epoch is always kept.
    let mut plateau = Plateau { best: -1.0, ..Plateau::default() };
    let stop = Stopping { max_epochs: cfg.max_epochs, patience: cfg.patience };
    let epochs = train_epochs(&mut training, stop, 0, &mut plateau, metrics)?;
    let VqaTraining { model, kept, update_seconds, .. } = training;
    let (best, best_epoch) = (plateau.best, plateau.best_epoch);
    let train_seconds = start.elapsed().as_secs_f64();
    kept.restore();
    let (test_acc, per_type) = evaluate(&model, p, "test", device, cfg.precision)?;
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
    let hnas_u = gates(&model)?;
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
pub(super) fn official_test(model: &VqaModel, p: &Prepared, path: &Path, device: Device) -> Result<crate::vqa_eval::Accuracy> {
    let (_, _, predicted) = score_and_predict(p, "test", device, &|views, tokens| Ok(model.forward(views, tokens, Mode::EVAL)?.logits))?;
    let ids = Vec::<i64>::try_from(p.data.splits["test"].question_id.as_ref().context("VQA-v2 questions without ids")?)?;
    let answers = &p.data.meta.answers;
    let results: Vec<serde_json::Value> =
        ids.iter().zip(&predicted).map(|(&q, &a)| serde_json::json!({"question_id": q, "answer": answers[a as usize]})).collect();
    write_json(path, &results)?;
    let (questions, annotations) = v2::official_files(&p.data.dir, "val2014");
    crate::vqa_eval::evaluate(&questions, &annotations, path)
}
