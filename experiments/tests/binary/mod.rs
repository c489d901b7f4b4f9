//! Running the `probattn` binary as a user does, for the experiments crate's tests.
#![allow(dead_code)] // each test file uses its own subset

pub mod mutate;

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{Context, Result};

/// `probattn ARGS`, waited for, its output captured.
pub fn probattn(args: &[&str]) -> Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_probattn")).args(args).output().context("running probattn")
}

/// Standard output then standard error, as text.
pub fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A JSON file, parsed.
pub fn json(path: &Path) -> Result<serde_json::Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?)?)
}

/// The flags of the small `probattn translate` runs of the tests: a tiny model on a synthetic
/// corpus, 4 epochs, one thread.
pub const FLAGS: [&str; 18] = [
    "--preset",
    "tiny",
    "--bpe-vocab",
    "120",
    "--max-tokens",
    "300",
    "--max-epochs",
    "4",
    "--beam",
    "2",
    "--warmup-updates",
    "20",
    "--threads",
    "1",
    "--device",
    "cpu",
    "--seeds",
    "1",
];

/// A translate run's seed-1 metrics.jsonl without the timing fields, which differ between runs.
pub fn metrics(dir: &Path) -> Result<Vec<serde_json::Value>> {
    metrics_file(&dir.join("seed-1/metrics.jsonl"))
}

/// The lines of a metrics.jsonl without the timing fields (`seconds`, `tokens_per_second`).
pub fn metrics_file(path: &Path) -> Result<Vec<serde_json::Value>> {
    let body = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    body.lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l)?;
            let o = v.as_object_mut().context("object")?;
            o.remove("seconds");
            o.remove("tokens_per_second");
            Ok(v)
        })
        .collect()
}
