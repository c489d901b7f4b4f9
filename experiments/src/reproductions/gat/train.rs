//! One seed's full-batch training with the original's early stopping, and its test accuracy.

use std::time::Instant;

use anyhow::{ensure, Result};
use indicatif::ProgressBar;
use probattn::Mode;
use probattn_models::gat::Gat;
use serde::{Deserialize, Serialize};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use super::{GatRunConfig, Graph};
use crate::harness::{train_epochs, BestWeights, EpochLine, MetricsLog, Plateau, Stopping, Training, Verdict};

/// One run's outcome.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub seed: u64,
    pub val_acc: f64,
    pub val_loss: f64,
    pub test_acc: f64,
    pub best_epoch: usize,
    pub epochs: usize,
    pub train_seconds: f64,
    pub epoch_ms: f64,
}

fn accuracy(logits: &Tensor, labels: &Tensor, idx: &Tensor) -> Result<f64> {
    let hit = logits.index_select(0, idx).argmax(-1, false).eq_tensor(&labels.index_select(0, idx));
    Ok(f64::try_from(hit.to_kind(Kind::Double).mean(Kind::Double))?)
}

fn cross_entropy(logits: &Tensor, labels: &Tensor, idx: &Tensor) -> Tensor {
    logits.index_select(0, idx).cross_entropy_for_logits(&labels.index_select(0, idx))
}

/// One epoch's line of metrics.jsonl (fields in the order the file has always had them).
#[derive(Debug, Serialize)]
struct EpochMetrics {
    epoch: usize,
    /// The KL term of stochastic attention (before its weight), if any.
    kl: Option<f64>,
    seed: u64,
    train_loss: f64,
    val_acc: f64,
    val_loss: f64,
}

impl EpochLine for EpochMetrics {
    fn epoch(&self) -> usize {
        self.epoch
    }
    fn score(&self) -> f64 {
        self.val_acc
    }
}

/// One seed's full-batch training, as the harness's epoch loop drives it.
struct GatTraining<'a> {
    graph: &'a Graph,
    cfg: &'a GatRunConfig,
    seed: u64,
    model: Gat,
    opt: nn::Optimizer,
    kept: BestWeights,
    /// The best validation accuracy and loss so far, each on its own (the patience rule).
    best_acc: f64,
    best_loss: f64,
    /// The kept epoch's validation loss.
    kept_loss: f64,
    bar: &'a ProgressBar,
}

impl Training for GatTraining<'_> {
    type Epoch = EpochMetrics;

    fn epoch(&mut self, epoch: usize) -> Result<EpochMetrics> {
        let (graph, cfg) = (self.graph, self.cfg);
        // The forward pass in the run's precision, the loss in float32.
        let device = graph.labels.device();
        let region = cfg.precision.enter(device)?;
        let out = self.model.forward(&graph.features, &graph.support, Mode::TRAIN)?;
        region.exit()?;
        let mut loss = cross_entropy(&out.logits, &graph.labels, &graph.train);
        let kl = match &out.kl {
            Some(kl) => {
                let w = cfg.kl_schedule.weight_at(epoch as u64);
                if w != 0.0 {
                    loss += kl * w;
                }
                Some(kl.detach())
            }
            None => None,
        };
        self.opt.backward_step(&loss);
        let (val_loss, val_acc) = tch::no_grad(|| -> Result<(f64, f64)> {
            let logits = cfg.precision.run(device, || self.model.forward(&graph.features, &graph.support, Mode::EVAL))??.logits;
            Ok((f64::try_from(cross_entropy(&logits, &graph.labels, &graph.val))?, accuracy(&logits, &graph.labels, &graph.val)?))
        })?;
        let kl = kl.map(f64::try_from).transpose()?;
        Ok(EpochMetrics { epoch, kl, seed: self.seed, train_loss: f64::try_from(loss.detach())?, val_acc, val_loss })
    }

    /// The original's rule: patience starts over when validation accuracy ≥ its best or
    /// validation loss ≤ its best; the weights are kept when both hold.
    fn judge(&mut self, m: &EpochMetrics, _: &Plateau) -> Result<Verdict> {
        let (epoch, seed, val_acc, val_loss) = (m.epoch, self.seed, m.val_acc, m.val_loss);
        ensure!(val_loss.is_finite(), "validation loss became {val_loss} at epoch {epoch} (seed {seed})");
        let verdict = match (val_acc >= self.best_acc, val_loss <= self.best_loss) {
            (true, true) => Verdict::Best,
            (false, false) => Verdict::Wait,
            _ => Verdict::Progress,
        };
        self.best_acc = self.best_acc.max(val_acc);
        self.best_loss = self.best_loss.min(val_loss);
        Ok(verdict)
    }

    fn keep(&mut self, m: &EpochMetrics, _: &Plateau) -> Result<()> {
        self.kept.keep();
        self.kept_loss = m.val_loss;
        Ok(())
    }

    fn after(&mut self, m: EpochMetrics, plateau: &Plateau) -> Result<()> {
        self.bar.set_message(format!("epoch {}, val acc {:.4}, kept {:.4} @ {}", m.epoch, m.val_acc, plateau.best, plateau.best_epoch));
        self.bar.tick();
        Ok(())
    }
}

/// Trains one model from `seed` with early stopping; appends per-epoch metrics to `metrics`.
pub fn train_run(
    graph: &Graph,
    cfg: &GatRunConfig,
    seed: u64,
    device: Device,
    bar: &ProgressBar,
    metrics: &mut MetricsLog,
) -> Result<RunResult> {
    tch::manual_seed(seed as i64);
    let vs = nn::VarStore::new(device);
    let model = Gat::new(&vs.root(), graph.features.features(), graph.classes, cfg.model.clone())?;
    let opt = nn::Adam { wd: cfg.weight_decay, ..Default::default() }.build(&vs, cfg.lr)?;
    let kept = BestWeights::new(&vs);
    let mut training =
        GatTraining { graph, cfg, seed, model, opt, kept, best_acc: 0.0, best_loss: f64::INFINITY, kept_loss: f64::INFINITY, bar };
    // The kept accuracy starts at 0 (what the result reports if no epoch is ever kept).
    let mut plateau = Plateau { best: 0.0, ..Plateau::default() };
    let start = Instant::now();
    let stop = Stopping { max_epochs: cfg.max_epochs, patience: cfg.patience };
    let epochs = train_epochs(&mut training, stop, 0, &mut plateau, Some(metrics))?;
    let train_seconds = start.elapsed().as_secs_f64();
    training.kept.restore();
    let logits =
        tch::no_grad(|| cfg.precision.run(device, || training.model.forward(&graph.features, &graph.support, Mode::EVAL)))??.logits;
    Ok(RunResult {
        seed,
        val_acc: plateau.best,
        val_loss: training.kept_loss,
        test_acc: accuracy(&logits, &graph.labels, &graph.test)?,
        best_epoch: plateau.best_epoch,
        epochs,
        train_seconds,
        epoch_ms: 1e3 * train_seconds / epochs.max(1) as f64,
    })
}
