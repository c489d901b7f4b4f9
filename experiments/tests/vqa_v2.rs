//! `probattn vqa --dataset vqa-v2` on small files this test writes in the official formats:
//! question and annotation JSON (train2014, val2014) and one folder of `.npz` region features per
//! detector (both file namings). The run's test accuracy must be the official evaluation of the
//! results file it writes (checked again with `probattn vqa-eval`), features read from disk must
//! give the same run as features held in memory, and bad input is refused by name.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;

use anyhow::{ensure, Context, Result};
use binary::mutate::{each_mutation, mutations, rounds};
use binary::{json, probattn, text};
use common::TempDir;
use tch::{Kind, Tensor};

const COLOURS: [&str; 3] = ["red", "blue", "green"];

/// Ten human answers from (answer, times) pairs.
fn humans(list: &[(&str, usize)]) -> Vec<String> {
    list.iter().flat_map(|&(a, n)| std::iter::repeat(a.to_string()).take(n)).collect()
}

/// Three questions per image (one per answer type); the answers follow the image id, and the
/// human answers disagree and need the official normalisation ("Red." is "red", "two" is "2").
fn write_split(dir: &Path, split: &str, images: &[u64]) -> Result<()> {
    let (mut questions, mut annotations) = (vec![], vec![]);
    for &image in images {
        let colour = COLOURS[(image % 3) as usize];
        let count = image % 4;
        let yes = if image % 2 == 0 { "yes" } else { "no" };
        let capitalised = format!("{}{}.", colour[..1].to_uppercase(), &colour[1..]);
        let count = count.to_string();
        let cases = [
            (
                "What color is the big shape?",
                "what color is the",
                "other",
                humans(&[(colour, 7), (&capitalised, 1), ("purple", 1), ("pink", 1)]),
            ),
            ("How many circles are there?", "how many", "number", humans(&[(&count, 6), ("two", 2), ("7", 2)])),
            ("Is the square left of the circle?", "is the", "yes/no", humans(&[(yes, 9), ("maybe", 1)])),
        ];
        for (k, (q, qtype, atype, humans)) in cases.into_iter().enumerate() {
            let id = image * 10 + k as u64;
            questions.push(serde_json::json!({"image_id": image, "question": q, "question_id": id}));
            let answers: Vec<_> = humans
                .iter()
                .enumerate()
                .map(|(i, a)| serde_json::json!({"answer": a, "answer_confidence": "yes", "answer_id": i + 1}))
                .collect();
            annotations.push(serde_json::json!({"question_id": id, "image_id": image, "question_type": qtype, "answer_type": atype, "multiple_choice_answer": humans[0], "answers": answers}));
        }
    }
    std::fs::write(
        dir.join(format!("v2_OpenEnded_mscoco_{split}_questions.json")),
        serde_json::to_vec(&serde_json::json!({"questions": questions}))?,
    )?;
    std::fs::write(
        dir.join(format!("v2_mscoco_{split}_annotations.json")),
        serde_json::to_vec(&serde_json::json!({"annotations": annotations}))?,
    )?;
    Ok(())
}

/// Region features `(4, 8)` per image that carry the image id's colour, count and parity.
fn write_features(dir: &Path, images: &[(u64, &str)], coco_names: bool, boxes: i64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    for &(image, split) in images {
        let x = Tensor::randn([boxes, 8], (Kind::Float, tch::Device::Cpu)) * 0.1;
        let _ = x.get(0).get((image % 3) as i64).fill_(1.0);
        let _ = x.get(1).get(3 + (image % 4) as i64).fill_(1.0);
        let _ = x.get(2).get(7).fill_((image % 2) as f64);
        let name = if coco_names { format!("COCO_{split}_{image:012}.npz") } else { format!("{image}.npz") };
        Tensor::write_npz(&[("x", &x)], dir.join(name))?;
    }
    Ok(())
}

struct Files {
    data: String,
    features: [String; 3],
}

fn vqa_v2(dir: &TempDir) -> Result<Files> {
    let data = dir.path("vqa-v2");
    std::fs::create_dir_all(&data)?;
    let train: Vec<u64> = (1..=30).collect();
    let val: Vec<u64> = (101..=110).collect();
    write_split(&data, "train2014", &train)?;
    write_split(&data, "val2014", &val)?;
    let images: Vec<(u64, &str)> = train.iter().map(|&i| (i, "train2014")).chain(val.iter().map(|&i| (i, "val2014"))).collect();
    let features = ["det-a", "det-b", "det-c"].map(|d| dir.path(d).to_string_lossy().to_string());
    for (i, f) in features.iter().enumerate() {
        write_features(Path::new(f), &images, i == 1, 4)?;
    }
    Ok(Files { data: data.to_string_lossy().to_string(), features })
}

fn run_args<'a>(f: &'a Files, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "vqa",
        "--dataset",
        "vqa-v2",
        "--data",
        &f.data,
        "--features",
        &f.features[0],
        "--features",
        &f.features[1],
        "--features",
        &f.features[2],
    ];
    args.extend([
        "--seeds",
        "1",
        "--max-epochs",
        "3",
        "--hidden",
        "16",
        "--threads",
        "1",
        "--answers",
        "12",
        "--val-fraction",
        "0.2",
        "--mc-samples",
        "3",
        "--out",
        out,
    ]);
    args.extend(extra);
    args
}

#[test]
fn vqa_v2_scores_its_results_file_with_the_official_evaluation() -> Result<()> {
    let dir = TempDir::new("cli-vqa-v2")?;
    let f = vqa_v2(&dir)?;
    let out = dir.path("run").to_string_lossy().to_string();
    let run = probattn(&run_args(&f, &out, &["--fusion", "bam-wc"]))?;
    ensure!(run.status.success(), "{}", text(&run));
    // 30 train2014 images, 6 held out; val2014's 10 are the test split.
    ensure!(text(&run).contains("vqa-v2: 40 images, 12 answers, train/val/test questions 72/18/30"), "{}", text(&run));
    let r = json(&Path::new(&out).join("results.json"))?;
    let seed = &r["runs"][0];
    let official = &seed["official"];
    let overall = official["overall"].as_f64().context("official overall")?;
    ensure!((seed["test_acc"].as_f64().context("test_acc")? * 100.0 - overall).abs() < 1e-9, "{seed}");
    let types: Vec<&String> = seed["test_acc_by_type"].as_object().context("by type")?.keys().collect();
    ensure!(types == ["number", "other", "yes/no"], "{types:?}");
    ensure!(seed["uncertainty"]["clean"]["pavpu_05"].is_number() && seed["uncertainty"]["noisy"]["ece"].is_number(), "{seed}");

    let results = Path::new(&out).join("test_results-seed0.json");
    let written = json(&results)?;
    ensure!(written.as_array().map(Vec::len) == Some(30) && written[0]["answer"].is_string(), "{written}");
    let (q, a) =
        (format!("{}/v2_OpenEnded_mscoco_val2014_questions.json", f.data), format!("{}/v2_mscoco_val2014_annotations.json", f.data));
    let eval = probattn(&["vqa-eval", "--questions", &q, "--annotations", &a, "--results", &results.to_string_lossy(), "--json"])?;
    ensure!(eval.status.success(), "{}", text(&eval));
    let scored: serde_json::Value = serde_json::from_slice(&eval.stdout)?;
    ensure!(scored["overall"].as_f64() == Some(overall) && scored["perAnswerType"] == official["perAnswerType"], "{scored} vs {official}");

    // The same run with every feature read from disk, batch by batch.
    let out2 = dir.path("run-disk").to_string_lossy().to_string();
    let run = probattn(&run_args(&f, &out2, &["--fusion", "bam-wc", "--feature-memory-gb", "0"]))?;
    ensure!(run.status.success() && text(&run).contains("reading them from disk"), "{}", text(&run));
    let r2 = json(&Path::new(&out2).join("results.json"))?;
    ensure!(
        r2["runs"][0]["official"] == *official && r2["runs"][0]["val_acc"] == seed["val_acc"],
        "disk {} vs memory {}",
        r2["runs"][0],
        seed
    );
    Ok(())
}

#[test]
fn vqa_v2_bad_input_is_named() -> Result<()> {
    let dir = TempDir::new("cli-vqa-v2-bad")?;
    let f = vqa_v2(&dir)?;
    let out = dir.path("never").to_string_lossy().to_string();
    let expect = |args: Vec<&str>, needle: &str| -> Result<()> {
        let o = probattn(&args)?;
        ensure!(o.status.code() == Some(1) && text(&o).contains(needle), "expected '{needle}':\n{}", text(&o));
        ensure!(!text(&o).contains("panicked"), "{}", text(&o));
        Ok(())
    };
    // A missing image, a detector with another box count for one image, too few views.
    std::fs::remove_file(Path::new(&f.features[2]).join("105.npz"))?;
    expect(run_args(&f, &out, &["--fusion", "softmax"]), "no features for image 105")?;
    write_features(Path::new(&f.features[2]), &[(105, "val2014")], false, 4)?;
    write_features(Path::new(&f.features[0]), &[(7, "train2014")], false, 5)?;
    expect(run_args(&f, &out, &["--fusion", "softmax"]), "variable box counts are not supported")?;
    write_features(Path::new(&f.features[0]), &[(7, "train2014")], false, 4)?;
    expect(
        vec!["vqa", "--dataset", "vqa-v2", "--data", &f.data, "--features", &f.features[0], "--out", &out],
        "needs --features at least twice",
    )?;
    // Not an .npz file; a missing annotations file; a malformed questions file.
    std::fs::write(Path::new(&f.features[1]).join("COCO_val2014_000000000101.npz"), b"not a zip")?;
    expect(run_args(&f, &out, &["--fusion", "softmax"]), "COCO_val2014_000000000101.npz is not a readable .npz file")?;
    std::fs::remove_file(Path::new(&f.data).join("v2_mscoco_val2014_annotations.json"))?;
    expect(run_args(&f, &out, &["--fusion", "softmax"]), "v2_mscoco_val2014_annotations.json")?;
    std::fs::write(Path::new(&f.data).join("v2_OpenEnded_mscoco_train2014_questions.json"), b"{\"questions\": 3}")?;
    expect(run_args(&f, &out, &["--fusion", "softmax"]), "is not in the official VQA-v2 format")?;
    ensure!(!Path::new(&out).exists(), "a failed run left {out} behind");
    Ok(())
}

#[test]
fn mutated_vqa_v2_files_load_or_are_named() -> Result<()> {
    // The official questions and annotations JSON, a region-feature .npz, and `vqa-eval`'s
    // results file, mutated as tests/mutation.rs mutates the others: a correct load or a named
    // error, never a crash.
    let dir = TempDir::new("mutation-vqa-v2")?;
    let f = vqa_v2(&dir)?;
    let out = dir.path("run").to_string_lossy().to_string();
    let mut args = run_args(&f, &out, &["--fusion", "softmax"]);
    let epochs = args.iter().position(|a| *a == "--max-epochs").context("--max-epochs")? + 1;
    args[epochs] = "1";
    let rounds = rounds()?;
    let data = Path::new(&f.data);
    let mut n = 0;
    for (seed, path) in [
        (50, data.join("v2_OpenEnded_mscoco_train2014_questions.json")),
        (51, data.join("v2_mscoco_val2014_annotations.json")),
        (52, Path::new(&f.features[1]).join("COCO_train2014_000000000003.npz")),
    ] {
        let original = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        n += each_mutation(&original, &path, mutations(&original, seed, rounds), &args)?;
    }
    // vqa-eval on a results file of the run above.
    let run = probattn(&args)?;
    ensure!(run.status.success(), "{}", text(&run));
    let results = Path::new(&out).join("test_results-seed0.json");
    let (q, a, r) = (
        data.join("v2_OpenEnded_mscoco_val2014_questions.json").to_string_lossy().to_string(),
        data.join("v2_mscoco_val2014_annotations.json").to_string_lossy().to_string(),
        results.to_string_lossy().to_string(),
    );
    let original = std::fs::read(&results)?;
    let eval = ["vqa-eval", "--questions", &q, "--annotations", &a, "--results", &r, "--json"];
    n += each_mutation(&original, &results, mutations(&original, 53, rounds), &eval)?;
    eprintln!("VQA-v2 files: {n} mutations");
    Ok(())
}
