//! What every training experiment does the same way around its own model and step: the seeds it
//! runs, the per-epoch metrics it appends, and the weights it keeps from its best epoch.
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
use serde::Serialize;
use tch::{nn, Tensor};

/// The seeds of a run: `start`, `start + 1`, ..., `count` of them (`--seed-start`, `--seeds`).
pub fn seeds(start: u64, count: u64) -> Range<u64> {
    start..start + count
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
