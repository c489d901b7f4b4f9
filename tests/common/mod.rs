//! Helpers shared by the integration tests: the project's Python, temporary folders, tensor
//! comparisons, and the devices to run each case on.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

/// The project's Python (with torch 2.11, numpy, safetensors), as download_libtorch.sh set it up.
pub fn python() -> Result<PathBuf> {
    let py = std::env::var_os("PROBATTN_PYTHON")
        .context("PROBATTN_PYTHON is not set: run ./download_libtorch.sh, which sets it in .cargo/config.toml")?;
    Ok(PathBuf::from(py))
}

/// The workspace's `python/` folder: the first ancestor of this crate's folder that holds it.
pub fn python_dir() -> Result<PathBuf> {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = crate_dir.ancestors().find(|d| d.join("python/probattn_tools").is_dir()).context("no python/ folder above the crate")?;
    Ok(root.join("python"))
}

/// `python -m probattn_tools.<module>` (e.g. `reference.parity`), with this checkout's `python/`
/// first on `PYTHONPATH`, so that the package imported is this tree's whatever is installed.
pub fn python_module(module: &str) -> Result<Command> {
    let dir = python_dir()?;
    let mut path = std::ffi::OsString::from(&dir);
    if let Some(rest) = std::env::var_os("PYTHONPATH") {
        path.push(":");
        path.push(rest);
    }
    let mut command = Command::new(python()?);
    command.arg("-m").arg(format!("probattn_tools.{module}")).env("PYTHONPATH", path);
    Ok(command)
}

/// Runs each `test_*.py` module of `tests` (at least `at_least` of them) with `python -m unittest
/// discover -v`, every module in a process of its own and all side by side; `python` makes the
/// process (the interpreter, its working folder and `PYTHONPATH`). Fails with the output of every
/// module that failed or ran no test.
pub fn run_unittest_modules(tests: &Path, at_least: usize, python: impl Fn() -> Result<Command> + Sync) -> Result<()> {
    let mut modules = Vec::new();
    for entry in std::fs::read_dir(tests).with_context(|| format!("reading {}", tests.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("test_") && name.ends_with(".py") {
            modules.push(name);
        }
    }
    modules.sort();
    anyhow::ensure!(modules.len() >= at_least, "{} holds {modules:?}", tests.display());
    let failures: Vec<String> = std::thread::scope(|scope| {
        let runs: Vec<_> = modules
            .iter()
            .map(|module| {
                let python = &python;
                scope.spawn(move || -> Result<()> {
                    let out = python()?.args(["-m", "unittest", "discover", "-v", "-s"]).arg(tests).args(["-p", module]).output()?;
                    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
                    anyhow::ensure!(out.status.success() && text.contains("\nOK"), "{module}: {text}");
                    anyhow::ensure!(!text.contains("Ran 0 tests"), "{module} ran no test");
                    Ok(())
                })
            })
            .collect();
        runs.into_iter()
            .filter_map(|run| run.join().map_err(|_| anyhow::anyhow!("a test thread panicked")).and_then(|r| r).err())
            .map(|e| format!("{e:#}"))
            .collect()
    });
    anyhow::ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Runs `python -m probattn_tools.<module>` with `args`; fails with its stderr.
pub fn run_python(module: &str, args: &[&str]) -> Result<()> {
    let out = python_module(module)?.args(args).output().with_context(|| format!("running probattn_tools.{module}"))?;
    if !out.status.success() {
        bail!("probattn_tools.{module} {args:?} failed:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A fresh temporary folder, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("probattn-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn load(path: &Path) -> Result<HashMap<String, Tensor>> {
    Ok(probattn::io::read_safetensors(path)?)
}

/// The cases listed in `dir/cases.json` as JSON objects.
pub fn manifest(dir: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(dir.join("cases.json"))?;
    Ok(serde_json::from_str(&text)?)
}

/// `max |ours − expected| / max(1, max |expected|)`: absolute for values of order one, relative
/// for large ones (gradients at scores of 1e4 reach the thousands).
pub fn scaled_error(ours: &Tensor, expected: &Tensor) -> Result<f64> {
    if ours.size() != expected.size() {
        bail!("shape {:?}, expected {:?}", ours.size(), expected.size());
    }
    if expected.numel() == 0 {
        return Ok(0.0);
    }
    let ours = ours.to_device(Device::Cpu).to_kind(tch::Kind::Double);
    let expected = expected.to_kind(tch::Kind::Double);
    let diff = f64::try_from((&ours - &expected).abs().max())?;
    let scale = f64::try_from(expected.abs().max())?.max(1.0);
    if !diff.is_finite() {
        bail!("non-finite difference");
    }
    Ok(diff / scale)
}

/// CPU always; CUDA device 0 too when libtorch sees one.
pub fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    if tch::Cuda::is_available() {
        d.push(Device::Cuda(0));
    }
    d
}

/// Holds a process-wide lock for a test's duration. libtorch's generator is global and tests run
/// in parallel threads, so without it a test's seeded draws interleave with another's and its data
/// changes from run to run; under the lock every seeded test sees the same data every time.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A toy language pair: the target is the source's words mapped through a fixed dictionary and
/// reversed, so a small model can learn it; `pairs` sentences from a seeded generator.
pub fn write_corpus(dir: &Path, pairs: [usize; 3]) -> Result<()> {
    let src_words =
        ["der", "hund", "die", "katze", "ein", "mann", "rot", "blau", "läuft", "sitzt", "im", "park", "auf", "dem", "gras", "zwei"];
    let tgt_words = ["the", "dog", "the", "cat", "a", "man", "red", "blue", "runs", "sits", "in", "park", "on", "the", "grass", "two"];
    let mut state: u64 = 42;
    let mut next = || {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    for (split, n) in ["train", "valid", "test"].iter().zip(pairs) {
        let (mut de, mut en) = (String::new(), String::new());
        for _ in 0..n {
            let len = 3 + next() % 6;
            let idx: Vec<usize> = (0..len).map(|_| next() % src_words.len()).collect();
            de += &(idx.iter().map(|&i| src_words[i]).collect::<Vec<_>>().join(" ") + ".\n");
            en += &(idx.iter().rev().map(|&i| tgt_words[i]).collect::<Vec<_>>().join(" ") + ".\n");
        }
        std::fs::write(dir.join(format!("{split}.de")), de)?;
        std::fs::write(dir.join(format!("{split}.en")), en)?;
    }
    Ok(())
}

/// A tiny Sort-of-CLEVR in `dir` (40 / 10 / 10 images, 4 questions each, from python/probattn_tools/data/vqa.py)
/// and detectors trained on it for one epoch (python/probattn_tools/data/vqa_detectors.py): (data, detectors).
pub fn tiny_sort_of_clevr(dir: &TempDir) -> Result<(String, String)> {
    let data = dir.path("data").to_string_lossy().to_string();
    let det = dir.path("detectors").to_string_lossy().to_string();
    run_python(
        "data.vqa",
        &["sort-of-clevr", "--out", &data, "--train", "40", "--val", "10", "--test", "10", "--questions-per-kind", "2", "--seed", "3"],
    )?;
    run_python("data.vqa_detectors", &["--data", &data, "--out", &det, "--epochs", "1", "--threads", "1"])?;
    Ok((data, det))
}

/// The largest magnitude in `t` (0 for an empty tensor).
pub fn max_abs(t: &Tensor) -> f64 {
    if t.numel() == 0 {
        0.0
    } else {
        t.abs().max().to_kind(Kind::Double).double_value(&[])
    }
}

/// The largest difference between `a` and `b`, in float64.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_abs(&(a.to_kind(Kind::Double) - b.to_kind(Kind::Double)))
}

/// A whole number from the environment variable `name`, else `default`.
pub fn env_u64(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(s) => s.parse().with_context(|| format!("{name}={s} is not a whole number")),
        Err(_) => Ok(default),
    }
}
