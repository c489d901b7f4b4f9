//! What every training experiment does the same way around its own model and step: the seeds it
//! runs, the epoch loop with its early stopping ([`train_epochs`]), the per-epoch metrics it
//! appends, and the weights it keeps from its best epoch.
//! (Statistics over seeds, progress and tables: `report.rs`; result folders, results files and
//! provenance: `provenance.rs`; plots: `plot.rs`.)
//!
//! `gat`, `translate` and `vqa` bring their configuration, data, step and report; what they share
//! lives here and in those modules, never in each other's.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

/// The seeds of a run: `start`, `start + 1`, ..., `count` of them (`--seed-start`, `--seeds`).
pub fn seeds(start: u64, count: u64) -> Range<u64> {
    start..start + count
}

/// The best validation score so far, the epoch that reached it, and the epochs waited since the
/// last progress. −∞ before the first epoch (JSON writes it as null).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plateau {
    #[serde(alias = "best_bleu", deserialize_with = "null_as_neg_infinity")]
    pub best: f64,
    pub best_epoch: usize,
    pub waited: usize,
}

impl Default for Plateau {
    fn default() -> Self {
        Self { best: f64::NEG_INFINITY, best_epoch: 0, waited: 0 }
    }
}

fn null_as_neg_infinity<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NEG_INFINITY))
}

/// What one epoch's validation means for the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A new best: its weights are kept and patience starts over.
    Best,
    /// Not weights to keep, but progress enough to start patience over (GAT's rule: validation
    /// accuracy or loss improved, not both).
    Progress,
    /// No progress: one more epoch waited.
    Wait,
}

/// An epoch's metrics line as the loop reads it.
pub trait EpochLine: Serialize {
    /// The epoch's number as the line records it.
    fn epoch(&self) -> usize;
    /// The validation score that selects the best epoch (higher is better).
    fn score(&self) -> f64;
}

/// One experiment's training as [`train_epochs`] drives it: the experiment brings its epoch
/// (updates and validation), how it keeps the best weights, and what it does after each epoch.
pub trait Training {
    type Epoch: EpochLine;

    /// Trains one epoch and validates; `done` epochs came before it.
    fn epoch(&mut self, done: usize) -> Result<Self::Epoch>;

    /// The epoch against the best so far. Default: a new best when its score is strictly higher.
    fn judge(&mut self, line: &Self::Epoch, plateau: &Plateau) -> Result<Verdict> {
        Ok(if line.score() > plateau.best { Verdict::Best } else { Verdict::Wait })
    }

    /// Keeps the current weights as the best (in memory or as a checkpoint); `plateau` already
    /// records this epoch as the best.
    fn keep(&mut self, line: &Self::Epoch, plateau: &Plateau) -> Result<()>;

    /// After the epoch's line is written and judged: the log line, checkpoints, schedules.
    fn after(&mut self, line: Self::Epoch, plateau: &Plateau) -> Result<()>;

    /// Whether training is over before the epoch limit (an update budget). Default: never.
    fn finished(&self) -> bool {
        false
    }
}

/// When the epoch loop stops: after `max_epochs` epochs, or `patience` epochs without progress.
#[derive(Clone, Copy, Debug)]
pub struct Stopping {
    pub max_epochs: usize,
    pub patience: usize,
}

/// The epoch loop every experiment shares: from `done` finished epochs (a resumed run's), trains
/// epochs until `stop` or the training says it is finished; writes each epoch's line to `metrics`
/// (when given: rank 0's), judges it against `plateau` and keeps the best weights. Returns the
/// number of finished epochs.
pub fn train_epochs<T: Training>(
    training: &mut T,
    stop: Stopping,
    mut done: usize,
    plateau: &mut Plateau,
    mut metrics: Option<&mut MetricsLog>,
) -> Result<usize> {
    while done < stop.max_epochs && plateau.waited < stop.patience && !training.finished() {
        let line = training.epoch(done)?;
        done += 1;
        if let Some(metrics) = metrics.as_deref_mut() {
            metrics.write(&line)?;
        }
        match training.judge(&line, plateau)? {
            Verdict::Best => {
                *plateau = Plateau { best: line.score(), best_epoch: line.epoch(), waited: 0 };
                training.keep(&line, plateau)?;
            }
            Verdict::Progress => plateau.waited = 0,
            Verdict::Wait => plateau.waited += 1,
        }
        training.after(line, plateau)?;
    }
    Ok(done)
}

/// `metrics.jsonl`: one JSON object per line, one line per epoch (and seed), flushed as it is
/// written so a killed run keeps every finished epoch.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsLog {
    /// A new, empty log at `path` (an existing one is replaced).
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path: path.to_path_buf(), out: BufWriter::new(file) })
    }

    /// The log at `path` continued: new lines go after the ones it holds (a resumed run).
    pub fn append_to(path: &Path) -> Result<Self> {
        let file =
            std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { path: path.to_path_buf(), out: BufWriter::new(file) })
    }

    /// Appends `line` (a typed record, or a `serde_json::Value`) and flushes.
    pub fn write(&mut self, line: &impl Serialize) -> Result<()> {
        let text = serde_json::to_string(line)?;
        writeln!(self.out, "{text}").and_then(|()| self.out.flush()).with_context(|| format!("writing {}", self.path.display()))
    }
}

/// The trainable weights of the best epoch so far, kept in memory beside the model: early stopping
/// restores them before the test. Starts as a copy of the initial weights.
#[derive(Debug)]
pub struct BestWeights {
    variables: Vec<Tensor>,
    kept: Vec<Tensor>,
}

impl BestWeights {
    pub fn new(vs: &nn::VarStore) -> Self {
        let variables = vs.trainable_variables();
        let kept = variables.iter().map(|v| v.detach().copy()).collect();
        Self { variables, kept }
    }

    /// Keeps the current weights.
    pub fn keep(&mut self) {
        tch::no_grad(|| {
            for (k, v) in self.kept.iter_mut().zip(&self.variables) {
                k.copy_(v);
            }
        });
    }

    /// Puts the kept weights back into the model.
    pub fn restore(&self) {
        tch::no_grad(|| {
            for (v, k) in self.variables.iter().zip(&self.kept) {
                v.shallow_clone().copy_(k);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Validation scores given in advance; records what the loop asked of it.
    struct Scripted {
        scores: Vec<f64>,
        /// Scores at or above this count as progress without being kept (GAT's "either" rule).
        progress_at: f64,
        kept: Vec<usize>,
        after: Vec<(usize, Plateau)>,
        finish_after: usize,
    }

    #[derive(Serialize)]
    struct Line {
        epoch: usize,
        score: f64,
    }

    impl EpochLine for Line {
        fn epoch(&self) -> usize {
            self.epoch
        }
        fn score(&self) -> f64 {
            self.score
        }
    }

    impl Training for Scripted {
        type Epoch = Line;
        fn epoch(&mut self, done: usize) -> Result<Line> {
            Ok(Line { epoch: done + 1, score: self.scores[done] })
        }
        fn judge(&mut self, line: &Line, plateau: &Plateau) -> Result<Verdict> {
            Ok(match line.score {
                s if s > plateau.best => Verdict::Best,
                s if s >= self.progress_at => Verdict::Progress,
                _ => Verdict::Wait,
            })
        }
        fn keep(&mut self, line: &Line, plateau: &Plateau) -> Result<()> {
            assert_eq!((plateau.best, plateau.best_epoch, plateau.waited), (line.score, line.epoch, 0));
            self.kept.push(line.epoch);
            Ok(())
        }
        fn after(&mut self, line: Line, plateau: &Plateau) -> Result<()> {
            self.after.push((line.epoch, *plateau));
            Ok(())
        }
        fn finished(&self) -> bool {
            self.after.len() >= self.finish_after
        }
    }

    fn scripted(scores: &[f64], progress_at: f64) -> Scripted {
        Scripted { scores: scores.to_vec(), progress_at, kept: vec![], after: vec![], finish_after: usize::MAX }
    }

    #[test]
    fn the_epoch_loop_keeps_the_best_and_stops_after_patience() {
        let mut t = scripted(&[1.0, 3.0, 2.0, 2.5, 2.0, 9.0], f64::INFINITY);
        let mut plateau = Plateau::default();
        let path = std::env::temp_dir().join(format!("probattn-loop-{}.jsonl", std::process::id()));
        let mut log = MetricsLog::create(&path).unwrap();
        let done = train_epochs(&mut t, Stopping { max_epochs: 10, patience: 3 }, 0, &mut plateau, Some(&mut log)).unwrap();
        // Epochs 3, 4, 5 do not beat 3.0: patience 3 ends the run before the 9.0.
        assert_eq!(done, 5);
        assert_eq!(t.kept, [1, 2]);
        assert_eq!(plateau, Plateau { best: 3.0, best_epoch: 2, waited: 3 });
        assert_eq!(t.after.iter().map(|(_, p)| p.waited).collect::<Vec<_>>(), [0, 0, 1, 2, 3]);
        let lines = std::fs::read_to_string(&path).unwrap();
        assert_eq!(lines.lines().count(), 5);
        assert!(lines.starts_with("{\"epoch\":1,\"score\":1.0}\n"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn progress_restarts_patience_without_keeping_and_a_resumed_loop_continues() {
        // 2.5 counts as progress: patience starts over, the kept epoch stays the 3.0.
        let mut t = scripted(&[3.0, 2.0, 2.5, 2.0, 2.0, 2.0], 2.5);
        let mut plateau = Plateau::default();
        let done = train_epochs(&mut t, Stopping { max_epochs: 10, patience: 2 }, 0, &mut plateau, None).unwrap();
        assert_eq!((done, t.kept.as_slice()), (5, &[1][..]));
        assert_eq!(plateau, Plateau { best: 3.0, best_epoch: 1, waited: 2 });
        // A resumed run: two epochs done before, one allowed; and a training that finishes early.
        let mut t = scripted(&[0.0, 0.0, 5.0, 6.0], f64::INFINITY);
        let mut plateau = Plateau { best: 4.0, best_epoch: 2, waited: 0 };
        assert_eq!(train_epochs(&mut t, Stopping { max_epochs: 3, patience: 5 }, 2, &mut plateau, None).unwrap(), 3);
        assert_eq!((plateau.best, plateau.best_epoch), (5.0, 3));
        let mut t = scripted(&[1.0, 2.0, 3.0], f64::INFINITY);
        t.finish_after = 1;
        assert_eq!(train_epochs(&mut t, Stopping { max_epochs: 3, patience: 5 }, 0, &mut Plateau::default(), None).unwrap(), 1);
    }

    #[test]
    fn a_plateau_reads_null_as_minus_infinity_and_the_old_best_bleu_name() {
        let fresh: Plateau = serde_json::from_str(&serde_json::to_string(&Plateau::default()).unwrap()).unwrap();
        assert_eq!(fresh, Plateau::default());
        let old: Plateau = serde_json::from_str(r#"{"best_bleu":35.5,"best_epoch":7,"waited":2}"#).unwrap();
        assert_eq!(old, Plateau { best: 35.5, best_epoch: 7, waited: 2 });
        // A resumed run (and every rank of a distributed one) reads the best score back from JSON:
        // bit for bit, so a tie is decided as the uninterrupted run decided it. (serde_json's
        // default parser misses this one by an ulp; the workspace enables float_roundtrip.)
        let score = Plateau { best: 9.762104020478679, best_epoch: 8, waited: 0 };
        assert_eq!(serde_json::from_str::<Plateau>(&serde_json::to_string(&score).unwrap()).unwrap(), score);
    }

    #[test]
    fn best_weights_come_back_after_later_epochs() {
        let vs = nn::VarStore::new(Device::Cpu);
        let w = vs.root().var("w", &[3], nn::Init::Const(1.0));
        let mut best = BestWeights::new(&vs);
        let _ = tch::no_grad(|| w.shallow_clone().fill_(2.0));
        best.keep();
        let _ = tch::no_grad(|| w.shallow_clone().fill_(5.0));
        best.restore();
        assert_eq!(Vec::<f64>::try_from(w.to_kind(Kind::Double)).unwrap(), [2.0, 2.0, 2.0]);
    }

    #[test]
    fn metrics_lines_are_json_and_a_continued_log_keeps_them() {
        let path = std::env::temp_dir().join(format!("probattn-metrics-{}.jsonl", std::process::id()));
        let mut log = MetricsLog::create(&path).unwrap();
        log.write(&serde_json::json!({"epoch": 0})).unwrap();
        drop(log);
        MetricsLog::append_to(&path).unwrap().write(&serde_json::json!({"epoch": 1})).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"epoch\":0}\n{\"epoch\":1}\n");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(seeds(3, 2).collect::<Vec<_>>(), [3, 4]);
    }
}
