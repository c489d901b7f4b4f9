//! Running the `probattn` binary as a user does, for the experiments crate's tests.
#![allow(dead_code)] // each test file uses its own subset

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
