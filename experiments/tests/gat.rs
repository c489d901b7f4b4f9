//! `probattn gat` as a user runs it: the Planetoid data (statistics as shared/data/README.md
//! records them), clear errors for missing or corrupt files, and a short run's results files.
//! These tests read the canonical files from ../shared/data/planetoid (beside the checkout, as in
//! CI) or data/planetoid (`python python/planetoid.py download --dir data/planetoid`); where
//! neither exists they say so and skip.

mod binary;

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use binary::{probattn, text};

/// The Planetoid folder, or `None` (with a notice) when this machine has none.
fn planetoid() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let found = [root.join("../shared/data/planetoid"), root.join("data/planetoid")].into_iter().find(|d| d.join("ind.cora.x").exists());
    if found.is_none() {
        eprintln!("SKIPPED: no Planetoid data beside the checkout (../shared/data/planetoid) or in data/planetoid");
    }
    found
}

fn tmp(tag: &str) -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("probattn-gat-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

#[test]
fn a_short_run_reports_the_data_and_writes_every_results_field() -> Result<()> {
    let Some(data) = planetoid() else { return Ok(()) };
    let out_dir = tmp("run")?;
    let data = data.to_string_lossy().to_string();
    let out = probattn(&[
        "gat",
        "--dataset",
        "cora",
        "--attention",
        "bam-wc",
        "--seeds",
        "2",
        "--max-epochs",
        "8",
        "--device",
        "cpu",
        "--data-dir",
        &data,
        "--out",
        &out_dir.to_string_lossy(),
    ])?;
    let said = text(&out);
    ensure!(out.status.success(), "{said}");
    // shared/data/README.md: 2708 nodes, 1433 features, 7 classes, 5278 undirected edges
    // (10556 directed) plus 2708 self-loops; split 140/500/1000.
    ensure!(
        said.contains("cora: 2708 nodes, 1433 features, 7 classes, 13264 edges with self-loops; train/val/test 140/500/1000"),
        "{said}"
    );
    ensure!(said.contains("bam-wc     seed   0: test acc") && said.contains("seed   1:"), "{said}");
    let results: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("results.json"))?)?;
    for key in ["dataset", "attention", "config", "runs", "test_acc_mean", "test_acc_std", "provenance"] {
        ensure!(!results[key].is_null(), "results.json lacks {key}");
    }
    for key in ["seed", "val_acc", "test_acc", "best_epoch", "epochs", "train_seconds", "epoch_ms"] {
        ensure!(!results["runs"][0][key].is_null(), "runs[0] lacks {key}");
    }
    for key in ["git_sha", "tch_version", "device", "threads"] {
        ensure!(!results["provenance"][key].is_null(), "provenance lacks {key}");
    }
    ensure!(results["runs"][0]["epochs"] == 8 && results["attention"] == "bam-wc");
    ensure!(out_dir.join("config.json").exists() && out_dir.join("metrics.jsonl").exists());
    let lines = std::fs::read_to_string(out_dir.join("metrics.jsonl"))?.lines().count();
    ensure!(lines == 16, "metrics.jsonl has {lines} lines, expected 2 runs x 8 epochs");
    std::fs::remove_dir_all(&out_dir)?;
    Ok(())
}

#[test]
fn citeseer_is_padded_as_the_gcn_loader_pads_it() -> Result<()> {
    let Some(data) = planetoid() else { return Ok(()) };
    let out_dir = tmp("citeseer")?;
    let data = data.to_string_lossy().to_string();
    let out = probattn(&[
        "gat",
        "--dataset",
        "citeseer",
        "--seeds",
        "1",
        "--max-epochs",
        "1",
        "--data-dir",
        &data,
        "--out",
        &out_dir.to_string_lossy(),
    ])?;
    // 3312 real nodes + 15 padded; 4552 undirected edges without self-loops -> 9104 + 3327.
    ensure!(
        text(&out).contains("citeseer: 3327 nodes, 3703 features, 6 classes, 12431 edges with self-loops; train/val/test 120/500/1000"),
        "{}",
        text(&out)
    );
    std::fs::remove_dir_all(&out_dir)?;
    Ok(())
}

#[test]
fn missing_and_corrupt_data_are_named_with_how_to_get_them() -> Result<()> {
    let Some(folder) = planetoid() else { return Ok(()) };
    let data = folder.to_string_lossy().to_string();
    // Pubmed in shared/data lacks ind.pubmed.allx; elsewhere its files may be absent altogether.
    let out = probattn(&["gat", "--dataset", "pubmed", "--data-dir", &data])?;
    let said = text(&out);
    ensure!(!out.status.success() && said.contains("ind.pubmed.") && said.contains("is missing"), "{said}");
    if folder.join("pubmed_incomplete").is_dir() {
        ensure!(said.contains("ind.pubmed.allx is missing") && said.contains("git hash-object"), "{said}");
    }
    // A corrupted copy of Cora.
    let copy = tmp("corrupt")?;
    for entry in std::fs::read_dir(&folder)? {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("ind.cora.")) {
            std::fs::copy(&path, copy.join(path.file_name().context("name")?))?;
        }
    }
    let graph = copy.join("ind.cora.graph");
    let mut bytes = std::fs::read(&graph)?;
    bytes[100] ^= 0xff;
    std::fs::write(&graph, bytes)?;
    let out = probattn(&["gat", "--dataset", "cora", "--data-dir", &copy.to_string_lossy()])?;
    let said = text(&out);
    ensure!(!out.status.success() && said.contains("ind.cora.graph is corrupt") && said.contains("download"), "{said}");
    std::fs::remove_file(copy.join("ind.cora.ty"))?;
    let out = probattn(&["gat", "--dataset", "cora", "--data-dir", &copy.to_string_lossy()])?;
    ensure!(text(&out).contains("ind.cora.ty is missing"), "{}", text(&out));
    std::fs::remove_dir_all(&copy)?;
    let out = probattn(&["gat", "--dataset", "cora", "--data-dir", "/no/such/folder"])?;
    ensure!(!out.status.success() && text(&out).contains("/no/such/folder does not exist"), "{}", text(&out));
    let out = probattn(&["gat", "--dataset", "cora", "--attention", "softmaxx", "--data-dir", &data])?;
    ensure!(!out.status.success() && text(&out).contains("unknown attention variant 'softmaxx'"), "{}", text(&out));
    ensure!(!text(&out).contains("panicked"), "{}", text(&out));
    Ok(())
}
