//! `probattn vqa` as a user runs it, on a tiny Sort-of-CLEVR written by python/probattn_tools/data/vqa.py with
//! detectors from python/probattn_tools/data/vqa_detectors.py: every fusion's results files and reports, the PyTorch
//! baseline scored through --eval-torchscript, and bad input (corrupt, wrong-shaped or stale detectors,
//! malformed data files, unknown fusions) refused with a named error.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use binary::mutate::{each_mutation, mutations, rounds, safetensors_mutations};
use binary::{json, probattn, text};
use common::{python, python_module, run_python, tiny_sort_of_clevr, TempDir};

/// `probattn vqa` for one epoch of one seed, a small model on one thread, with `extra` flags.
fn one_epoch(data: &str, det: &str, out: &str, extra: &[&str]) -> Result<Output> {
    let mut args = vec!["vqa", "--data", data, "--detectors", det, "--seeds", "1", "--max-epochs", "1", "--hidden", "16"];
    args.extend(["--threads", "1", "--out", out]);
    args.extend(extra);
    probattn(&args)
}

#[test]
fn every_fusion_writes_its_results_and_reports() -> Result<()> {
    let dir = TempDir::new("cli-vqa")?;
    let (data, det) = tiny_sort_of_clevr(&dir)?;
    let out = dir.path("run").to_string_lossy().to_string();
    let run = one_epoch(&data, &det, &out, &["--fusion", "all", "--mc-samples", "3", "--image-noise", "0.1"])?;
    ensure!(run.status.success(), "{}", text(&run));
    ensure!(text(&run).contains("features:") && Path::new(&out).join("summary.md").is_file(), "{}", text(&run));
    ensure!(Path::new(&out).join("log_mass.svg").is_file(), "no Fig. 1 histogram across fusions");
    for fusion in ["none", "softmax", "dnas", "hnas", "bam-wc"] {
        let sub = Path::new(&out).join(fusion);
        let r = json(&sub.join("results.json"))?;
        ensure!(r["fusion"] == fusion && r["provenance"]["git_sha"].is_string(), "{fusion}: {r}");
        let run = &r["runs"][0];
        let acc = run["test_acc"].as_f64().context("test_acc")?;
        ensure!((0.0..=1.0).contains(&acc) && run["test_acc_by_type"].as_object().map(|m| m.len()) == Some(6), "{fusion}: {run}");
        let curves = std::fs::read_to_string(sub.join("val_acc.svg")).with_context(|| format!("{fusion}: no validation curves"))?;
        ensure!(curves.contains("closest") && curves.contains("vertical"), "{fusion}: val_acc.svg lacks a question type's curve");
        ensure!(run["test_acc_relational"].is_number() && run["test_acc_nonrelational"].is_number(), "{fusion}: {run}");
        let ea = &run["explained_away"];
        if fusion == "none" {
            ensure!(ea.is_null(), "the no-attention fusion has no weights to report: {ea}");
        } else {
            // 10 test images x (25 + 49) secondary boxes of the grid and wide detectors.
            ensure!(ea["boxes"] == 740, "{fusion}: {ea}");
            let counts: u64 = ea["log_mass_counts"].as_array().context("counts")?.iter().filter_map(|c| c.as_u64()).sum();
            ensure!(counts == 740, "{fusion}: the histogram holds {counts} boxes");
            ensure!(sub.join("log_mass.svg").is_file(), "{fusion}: no histogram");
        }
        if fusion == "dnas" {
            let m = ea["min_mass_times_keys"].as_f64().context("min mass")?;
            ensure!(m >= 1.0 - 1e-4, "DNAS must keep every box's mass >= 1/keys, got {m}");
        }
        ensure!((fusion == "hnas") == run["hnas_u"].is_array(), "{fusion}: hnas_u {}", run["hnas_u"]);
        if fusion == "hnas" {
            ensure!(sub.join("hnas_u.svg").is_file(), "no Fig. 3 plot");
        }
        // Every attention fusion gets the uncertainty report (clean, feature noise, pixel noise);
        // a deterministic one takes two samples, calls every answer certain, so its PAvPU is its
        // accuracy.
        let u = &run["uncertainty"];
        ensure!((fusion != "none") == u.is_object(), "{fusion}: uncertainty {u}");
        if fusion != "none" {
            ensure!(u["samples"] == if fusion == "bam-wc" { 3 } else { 2 } && u["image_noise"] == 0.1, "{fusion}: {u}");
            // The test's measures, then the same on the validation split, where BAM's settings are chosen.
            let sides = [
                ("clean", &u["clean"]),
                ("noisy", &u["noisy"]),
                ("noisy_image", &u["noisy_image"]),
                ("val clean", &u["val"]["clean"]),
                ("val noisy", &u["val"]["noisy"]),
            ];
            for (side, m) in sides {
                let p = m["pavpu_05"].as_f64().with_context(|| format!("{side} pavpu"))?;
                ensure!((0.0..=1.0).contains(&p) && m["ece"].is_number(), "{fusion} {side}: {u}");
                if fusion != "bam-wc" {
                    ensure!(m["uncertain_05"] == 0.0 && m["pavpu_05"] == m["accuracy"], "{fusion} {side}: {u}");
                }
            }
            if fusion != "bam-wc" {
                // A deterministic fusion's clean validation pass is the early-stopping evaluation.
                ensure!(
                    (u["val"]["clean"]["accuracy"].as_f64().context("val accuracy")? - run["val_acc"].as_f64().context("val_acc")?).abs()
                        < 1e-12,
                    "{fusion}: {u}"
                );
            }
            if fusion == "softmax" {
                // The clean Monte Carlo mean is the eval-mode prediction.
                ensure!((u["clean"]["accuracy"].as_f64().context("accuracy")? - acc).abs() < 1e-12, "{u} vs test_acc {acc}");
            }
        }
        let lines = std::fs::read_to_string(sub.join("metrics.jsonl"))?.lines().count();
        ensure!(lines == 1, "{fusion}: one epoch, {lines} metrics lines");
    }
    Ok(())
}

#[test]
fn the_pytorch_baseline_scores_the_same_inside_probattn() -> Result<()> {
    let dir = TempDir::new("cli-vqa-ts")?;
    let (data, det) = tiny_sort_of_clevr(&dir)?;
    // A first run extracts and caches the features; the baseline trains on that cache.
    let out = dir.path("run").to_string_lossy().to_string();
    let first = one_epoch(&data, &det, &out, &["--fusion", "dnas"])?;
    ensure!(first.status.success(), "{}", text(&first));
    let cache = std::fs::read_dir(Path::new(&data).join("features"))?.next().context("no feature cache")??.path();
    let model = dir.path("model.pt").to_string_lossy().to_string();
    let base = python_module("baselines.vqa")?
        .args([
            "--data",
            &data,
            "--features",
            &cache.to_string_lossy(),
            "--fusion",
            "dnas",
            "--max-epochs",
            "2",
            "--threads",
            "1",
            "--export-torchscript",
            &model,
        ])
        .output()?;
    ensure!(base.status.success(), "{}", text(&base));
    let expected: serde_json::Value = serde_json::from_slice(&base.stdout)?;
    let ts_out = dir.path("ts").to_string_lossy().to_string();
    let scored =
        probattn(&["vqa", "--data", &data, "--detectors", &det, "--eval-torchscript", &model, "--threads", "1", "--out", &ts_out])?;
    ensure!(scored.status.success(), "{}", text(&scored));
    let ours = json(&Path::new(&ts_out).join("eval_torchscript.json"))?;
    let (a, b) = (ours["test_acc"].as_f64().context("ours")?, expected["runs"][0]["test_acc"].as_f64().context("baseline")?);
    ensure!((a - b).abs() < 1e-6, "the TorchScript baseline scores {a} in probattn and {b} in PyTorch");
    Ok(())
}

/// The object-box recipe (results/vqa/sort-of-clevr-objects*), as a user runs it:
/// `--detector-boxes` trains object detectors into a folder named by their settings, and the
/// bag-of-words question and the relational layer run over their boxes.
#[test]
fn object_detectors_and_a_bag_of_words_question_run() -> Result<()> {
    let dir = TempDir::new("cli-vqa-objects")?;
    let data = dir.path("data").to_string_lossy().to_string();
    run_python(
        "data.vqa",
        &["sort-of-clevr", "--out", &data, "--train", "40", "--val", "10", "--test", "10", "--questions-per-kind", "2", "--seed", "3"],
    )?;
    let out = dir.path("run").to_string_lossy().to_string();
    let flags = [
        "--detector-epochs",
        "1",
        "--detector-boxes",
        "3",
        "--question-encoder",
        "bow",
        "--relational-heads",
        "2",
        "--fusion",
        "dnas",
        "--lr-decay",
        "0.5",
    ];
    let common = ["--hidden", "16", "--seeds", "1", "--max-epochs", "1", "--mc-samples", "3", "--threads", "1", "--out", &out];
    let run = probattn(&[&["vqa", "--data", &data][..], &flags, &common].concat())?;
    ensure!(run.status.success(), "{}", text(&run));
    let trained = json(&Path::new(&data).join("detectors-e1-boxes3").join("detectors.json"))?;
    ensure!(trained["boxes"] == 3 && trained["epochs"] == 1, "{trained}");
    // The run keeps the manifest of the detectors it used (their sha256 and validation metrics).
    ensure!(json(&Path::new(&out).join("detectors.json"))? == trained, "the run folder's detectors.json is not the detectors' manifest");
    let r = json(&Path::new(&out).join("results.json"))?;
    let model = &r["config"]["model"];
    ensure!(model["question_encoder"] == "bow" && model["view_regions"] == serde_json::json!([3, 3, 3]), "{model}");
    // 10 test images x (3 + 3) secondary boxes.
    ensure!(r["runs"][0]["explained_away"]["boxes"] == 60 && r["runs"][0]["test_acc"].is_number(), "{r}");
    ensure!(r["config"]["lr_decay"] == 0.5 && r["config"]["lr_patience"] == 2, "{}", r["config"]);
    // Each epoch's line has the rate it trained at and the validation accuracy of all six types.
    let epoch: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(Path::new(&out).join("metrics.jsonl"))?.lines().next().context("no metrics line")?)?;
    ensure!(epoch["lr"] == 1e-3 && epoch["val_acc_by_type"].as_object().map(|m| m.len()) == Some(6), "{epoch}");
    // The detector flags say how probattn trains its own detectors: refused beside --detectors,
    // and an unknown encoder or zero epochs are named.
    let never = dir.path("never").to_string_lossy().to_string();
    let det = Path::new(&data).join("detectors-e1-boxes3").to_string_lossy().to_string();
    for (bad, says) in [
        (vec!["--detectors", &det, "--detector-boxes", "6"], "do not apply to --detectors"),
        (vec!["--detector-epochs", "0"], "--detector-epochs must be at least 1"),
        (vec!["--question-encoder", "transformer"], "transformer"),
        (vec!["--lr-decay", "0"], "--lr-decay must be in (0, 1]"),
        (vec!["--lr-decay", "1.5"], "--lr-decay must be in (0, 1]"),
        (vec!["--lr-patience", "0"], "--lr-patience must be at least 1"),
    ] {
        let out = probattn(
            &[&["vqa", "--data", &data, "--seeds", "1", "--max-epochs", "1", "--threads", "1", "--out", &never][..], &bad].concat(),
        )?;
        ensure!(out.status.code() == Some(1) && text(&out).contains(says), "{bad:?}: {}", text(&out));
    }
    ensure!(!dir.path("never").exists(), "a refused run left an output folder");
    Ok(())
}

#[test]
fn bad_detectors_and_data_are_named() -> Result<()> {
    let dir = TempDir::new("cli-vqa-bad")?;
    let (data, det) = tiny_sort_of_clevr(&dir)?;
    let d = |name: &str| Path::new(&det).join(name).to_string_lossy().to_string();
    let never = dir.path("never").to_string_lossy().to_string();
    let base = ["vqa", "--data", &data, "--max-epochs", "1", "--seeds", "1", "--threads", "1", "--out", &never];
    let run = |extra: &[&str]| probattn(&[&base[..], extra].concat());
    // A corrupt TorchScript file.
    std::fs::write(dir.path("garbage.pt"), b"not a zip archive")?;
    let garbage = dir.path("garbage.pt").to_string_lossy().to_string();
    let out = run(&["--detector", &d("patch.pt"), "--detector", &garbage])?;
    ensure!(out.status.code() == Some(1) && text(&out).contains("garbage.pt"), "{}", text(&out));
    // A detector returning (B, dim) instead of (B, regions, dim).
    let flat = dir.path("flat.pt").to_string_lossy().to_string();
    let code = "import sys, torch\nclass Flat(torch.nn.Module):\n    def forward(self, x):\n        return x.flatten(1)[:, :64]\ntorch.jit.trace(Flat(), torch.zeros(2, 3, 75, 75)).save(sys.argv[1])\n";
    let made = Command::new(python()?).args(["-c", code, &flat]).output()?;
    ensure!(made.status.success(), "{}", text(&made));
    let out = run(&["--detector", &d("patch.pt"), "--detector", &flat])?;
    ensure!(out.status.code() == Some(1) && text(&out).contains("returned shape [60, 64] for 60 images"), "{}", text(&out));
    // An unknown fusion.
    let out = run(&["--detectors", &det, "--fusion", "attn"])?;
    ensure!(out.status.code() == Some(1) && text(&out).contains("unknown attention variant 'attn'"), "{}", text(&out));
    // A bad model flag is named (the end checks that nothing was written); a good one runs the relational layer.
    let out = run(&["--detectors", &det, "--relational-heads=-1"])?;
    ensure!(out.status.code() == Some(1) && text(&out).contains("--relational-heads must be 0 or more"), "{}", text(&out));
    let related = dir.path("related").to_string_lossy().to_string();
    let out = one_epoch(&data, &det, &related, &["--fusion", "dnas", "--relational-heads", "2"])?;
    ensure!(out.status.success(), "{}", text(&out));
    let r = json(&Path::new(&related).join("results.json"))?;
    ensure!(r["config"]["model"]["relational_heads"] == 2 && r["runs"][0]["test_acc"].is_number(), "{r}");
    // Malformed meta.json, and answers outside the answer list.
    let meta = Path::new(&data).join("meta.json");
    let good = std::fs::read_to_string(&meta)?;
    std::fs::write(&meta, "{ not json")?;
    let out = run(&["--detectors", &det])?;
    ensure!(out.status.code() == Some(1) && text(&out).contains("meta.json is not a VQA data description"), "{}", text(&out));
    let mut fewer: serde_json::Value = serde_json::from_str(&good)?;
    fewer["answers"] = serde_json::json!(["square", "circle"]);
    std::fs::write(&meta, fewer.to_string())?;
    let out = run(&["--detectors", &det])?;
    ensure!(
        out.status.code() == Some(1) && text(&out).contains("train_answer holds ids") && text(&out).contains("outside 0..2"),
        "{}",
        text(&out)
    );
    // Detectors trained for an earlier conversion of the data (another data file), and for
    // data whose meta.json now asks for another view.
    std::fs::write(&meta, &good)?;
    let manifest = Path::new(&det).join("detectors.json");
    let trained = std::fs::read_to_string(&manifest)?;
    let mut other: serde_json::Value = serde_json::from_str(&trained)?;
    other["data_sha256"] = serde_json::json!("0123");
    std::fs::write(&manifest, other.to_string())?;
    let out = run(&["--detectors", &det])?;
    ensure!(
        out.status.code() == Some(1) && text(&out).contains("were trained for other data") && text(&out).contains("sha256"),
        "{}",
        text(&out)
    );
    std::fs::write(&manifest, &trained)?;
    let mut global: serde_json::Value = serde_json::from_str(&good)?;
    global["detector_context"] = serde_json::json!("global");
    std::fs::write(&meta, global.to_string())?;
    let out = run(&["--detectors", &det])?;
    ensure!(out.status.code() == Some(1) && text(&out).contains("detector_context differs"), "{}", text(&out));
    ensure!(!dir.path("never").exists(), "a failed run left an output folder");
    Ok(())
}

#[test]
fn mutated_vqa_files_load_or_are_named() -> Result<()> {
    // Every file `probattn vqa` reads from a converted dataset and a detector folder, mutated as
    // tests/mutation.rs mutates the others: a correct load or a named error, never a crash.
    let dir = TempDir::new("mutation-vqa")?;
    let (data, det) = tiny_sort_of_clevr(&dir)?;
    let out = dir.path("run").to_string_lossy().to_string();
    let args = [
        "vqa",
        "--data",
        &data,
        "--detectors",
        &det,
        "--fusion",
        "dnas",
        "--seeds",
        "1",
        "--max-epochs",
        "1",
        "--mc-samples",
        "2",
        "--hidden",
        "16",
        "--threads",
        "1",
        "--out",
        &out,
    ];
    let rounds = rounds()?;
    let mut n = 0;
    for (seed, path) in [(40, Path::new(&data).join("meta.json")), (41, Path::new(&det).join("detectors.json"))] {
        let original = std::fs::read(&path)?;
        n += each_mutation(&original, &path, mutations(&original, seed, rounds), &args)?;
    }
    let path = Path::new(&data).join("data.safetensors");
    let original = std::fs::read(&path)?;
    let mut cases = mutations(&original, 42, rounds);
    cases.extend(safetensors_mutations(&original)?);
    n += each_mutation(&original, &path, cases, &args)?;
    eprintln!("VQA data and detector files: {n} mutations");
    Ok(())
}
