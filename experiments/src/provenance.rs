//! Where a result came from: code version, library versions, device, threads, command line;
//! and the helpers experiments share (the project's Python, run folders, atomic JSON).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// Provenance recorded in every results file.
#[derive(Debug, Clone, Serialize)]
pub struct Provenance {
    pub git_sha: String,
    pub git_dirty: bool,
    /// A dirty build's diff against `git_sha`, saved as `dirty.diff` beside the results: its
    /// SHA-256, so the saved file can be checked against the binary that ran. `None` when clean.
    pub git_diff_sha256: Option<String>,
    pub probattn_version: String,
    pub tch_version: String,
    pub libtorch_version: Option<String>,
    pub device: String,
    /// The processor as the OS names it, and the bfloat16 instructions it has, which decide
    /// bfloat16's speed on the CPU (`docs/precision.md`); `None` where `/proc/cpuinfo` names no
    /// model (absent, or an architecture whose cpuinfo has no `model name` line).
    pub cpu: Option<String>,
    pub threads: i32,
    /// `retain` when freed memory is kept for reuse (`--allocator`), else `system`.
    pub allocator: String,
    pub command: Vec<String>,
    pub unix_time: u64,
    /// The attention backend the command asked for (`--attention-backend`; `auto` unless forced).
    pub attention_backend: String,
    /// The attention calls each route served up to the record (`{"eager": 120, "kernel": 40}`;
    /// `probattn::backend`).
    pub attention_routes: serde_json::Value,
}

impl Provenance {
    pub fn gather(device: tch::Device) -> Self {
        let report = crate::doctor::Report::gather(device);
        Self {
            // Recorded when the binary was built (experiments/build.rs): the code that ran.
            git_sha: env!("PROBATTN_GIT_SHA").into(),
            git_dirty: env!("PROBATTN_GIT_DIRTY") == "true",
            git_diff_sha256: (!BUILD_DIFF.is_empty()).then(|| sha256_hex(BUILD_DIFF.as_bytes())),
            probattn_version: report.probattn_version,
            tch_version: report.tch_version,
            libtorch_version: report.libtorch_version,
            device: probattn::device::device_name(device),
            cpu: report.cpu,
            threads: tch::get_num_threads(),
            allocator: if probattn::allocator::freed_memory_retained() { "retain" } else { "system" }.into(),
            command: portable_command(std::env::args()),
            unix_time: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            attention_backend: probattn::backend::default().to_string(),
            attention_routes: probattn::backend::routes_taken_json(),
        }
    }
}

/// The diff of a dirty build against its commit (experiments/build.rs); empty for a clean build.
const BUILD_DIFF: &str = include_str!(concat!(env!("OUT_DIR"), "/dirty.diff"));

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The command line as a record that means the same on another machine: the binary by its file
/// name, and absolute paths inside the checkout the binary was built from relative to it (paths
/// elsewhere are kept: they are where the run read or wrote).
fn portable_command(args: impl Iterator<Item = String>) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = root.canonicalize().unwrap_or(root);
    args.enumerate()
        .map(|(i, arg)| {
            let path = Path::new(&arg);
            if i == 0 {
                return path.file_name().map_or(arg.clone(), |n| n.to_string_lossy().into_owned());
            }
            match path.strip_prefix(&root) {
                Ok(relative) if path.is_absolute() => relative.display().to_string(),
                _ => arg,
            }
        })
        .collect()
}

/// Writes a results file (pretty JSON, atomically) with what provenance needs beside it: from a
/// dirty build, its diff as `dirty.diff` in the same folder (its SHA-256 is in the provenance)
/// and a warning, since the commit alone cannot reproduce such results.
pub fn write_results(path: &Path, value: &impl Serialize) -> Result<()> {
    write_results_with(path, value, BUILD_DIFF)
}

fn write_results_with(path: &Path, value: &impl Serialize, build_diff: &str) -> Result<()> {
    write_json(path, value)?;
    if !build_diff.is_empty() {
        let diff = path.with_file_name("dirty.diff");
        probattn::io::write_bytes_atomic(&diff, build_diff.as_bytes()).with_context(|| format!("writing {}", diff.display()))?;
        eprintln!(
            "warning: this binary was built from a tree with uncommitted changes to {}: its diff is saved as {} (label these results \
             exploratory, or rebuild from a commit)",
            env!("PROBATTN_GIT_SHA"),
            diff.display()
        );
    }
    Ok(())
}

/// The project's Python: `PROBATTN_PYTHON`, else the one download_libtorch.sh set up at build time.
pub fn python() -> PathBuf {
    std::env::var_os("PROBATTN_PYTHON").map_or_else(|| PathBuf::from(env!("PROBATTN_PYTHON_DEFAULT")), PathBuf::from)
}

/// The project's `python/` folder (the scripts the experiments call), found at run time so that a
/// binary copied or installed elsewhere still finds it: `PROBATTN_PYTHON_DIR`, else `python/` next
/// to the binary, two levels up (the checkout of `target/release/probattn`) or in
/// `../share/probattn/python` (an install prefix), else the checkout the binary was built from.
/// A folder counts when it holds `probattn_tools/`, the package of every script.
pub fn python_dir() -> Result<PathBuf> {
    let is_ours = |d: &Path| d.join("probattn_tools").is_dir();
    if let Some(dir) = std::env::var_os("PROBATTN_PYTHON_DIR") {
        let dir = PathBuf::from(dir);
        anyhow::ensure!(is_ours(&dir), "PROBATTN_PYTHON_DIR={}: no probattn_tools/ there, so not probattn's python/ folder", dir.display());
        return Ok(dir);
    }
    let mut candidates = vec![];
    if let Some(bin) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        candidates.extend([bin.join("python"), bin.join("../../python"), bin.join("../share/probattn/python")]);
    }
    candidates.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../python"));
    candidates.into_iter().find(|d| is_ours(d)).context(
        "probattn's python/ folder was not found next to the binary nor in the checkout it was built from: set PROBATTN_PYTHON_DIR \
         to the python/ folder of a probattn checkout",
    )
}

/// Runs `python -m probattn_tools.<module> args...` (`module` as `data.planetoid`), with
/// [`python_dir`] first on `PYTHONPATH`; on failure the error carries the script's own message.
pub fn run_python(module: &str, args: &[&str]) -> Result<String> {
    let python = python();
    let mut path = std::ffi::OsString::from(python_dir()?);
    if let Some(rest) = std::env::var_os("PYTHONPATH") {
        path.push(":");
        path.push(rest);
    }
    let out = Command::new(&python)
        .arg("-m")
        .arg(format!("probattn_tools.{module}"))
        .args(args)
        .env("PYTHONPATH", path)
        .envs(probattn::allocator::child_env())
        .output()
        .with_context(|| format!("running {} (set PROBATTN_PYTHON, or run ./download_libtorch.sh)", python.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stderr = stderr.trim().trim_start_matches("error: ");
        // A process killed by a signal often says nothing: name the signal (9 is what the
        // kernel's out-of-memory killer sends).
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = out.status.signal() {
            let hint = if signal == 9 { " (SIGKILL: the system's out-of-memory killer, or a user)" } else { "" };
            bail!("probattn_tools.{module} was killed by signal {signal}{hint}{}{stderr}", if stderr.is_empty() { "" } else { ": " });
        }
        bail!("{stderr}");
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A new run folder `runs/<experiment>/<UTC stamp>-<tag>` (or `out` when given), created.
pub fn run_dir(out: Option<&Path>, experiment: &str, tag: &str) -> Result<PathBuf> {
    let dir = match out {
        Some(d) => d.to_path_buf(),
        None => Path::new("runs").join(experiment).join(format!("{}-{tag}", utc_stamp())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Writes `value` as pretty JSON to `path`, atomically.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    probattn::io::write_bytes_atomic(path, text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// `YYYYMMDD-HHMMSS` in UTC.
pub fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_recorded_without_this_machines_paths() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap();
        let inside = root.join("results/x").display().to_string();
        let args = ["/somewhere/bin/probattn-abc", "gat", "--out", &inside, "--data-dir", "/data/planetoid", "relative/dir"];
        let command = portable_command(args.iter().map(|s| s.to_string()));
        assert_eq!(command, ["probattn-abc", "gat", "--out", "results/x", "--data-dir", "/data/planetoid", "relative/dir"]);
    }

    #[test]
    fn a_dirty_build_saves_its_diff_beside_the_results() {
        let dir = std::env::temp_dir().join(format!("probattn-provenance-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let results = dir.join("results.json");
        write_results_with(&results, &serde_json::json!({"a": 1}), "").unwrap();
        assert!(results.is_file() && !dir.join("dirty.diff").exists(), "a clean build writes no diff");
        let diff = "diff --git a/src/lib.rs b/src/lib.rs\n+changed\n";
        write_results_with(&results, &serde_json::json!({"a": 2}), diff).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("dirty.diff")).unwrap(), diff);
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
