//! `probattn vqa-eval` against python/probattn_tools/reference/vqa_eval.py (the official evaluation's steps) on
//! seeded files in the official formats whose answers exercise every normalisation (punctuation
//! next to spaces, commas in numbers, periods, number words, articles, contractions, tabs and
//! newlines, answers that agree and disagree); and its bad input.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::Output;

use anyhow::{ensure, Context, Result};
use binary::{probattn, text};
use common::{python_module, TempDir};

fn reference(args: &[&str]) -> Result<Output> {
    python_module("reference.vqa_eval")?.args(args).output().context("running probattn_tools.reference.vqa_eval")
}

#[test]
fn vqa_eval_equals_the_official_computation() -> Result<()> {
    let tmp = TempDir::new("vqa-eval")?;
    for seed in 0..4 {
        let dir = tmp.path(&format!("seed{seed}"));
        let d = dir.to_string_lossy().to_string();
        let made = reference(&["make-cases", "--out", &d, "--seed", &seed.to_string(), "--questions", "400"])?;
        ensure!(made.status.success(), "{}", text(&made));
        let files = [format!("{d}/questions.json"), format!("{d}/annotations.json"), format!("{d}/results.json")];
        let theirs = reference(&["score", "--questions", &files[0], "--annotations", &files[1], "--results", &files[2]])?;
        ensure!(theirs.status.success(), "{}", text(&theirs));
        let ours = probattn(&["vqa-eval", "--questions", &files[0], "--annotations", &files[1], "--results", &files[2], "--json"])?;
        ensure!(ours.status.success(), "{}", text(&ours));
        let (a, b): (serde_json::Value, serde_json::Value) =
            (serde_json::from_slice(&ours.stdout)?, serde_json::from_slice(&theirs.stdout)?);
        ensure!(a == b, "seed {seed}: probattn {a} vs the official computation {b}");
        ensure!(a["overall"].as_f64().is_some_and(|x| x > 10.0 && x < 95.0), "seed {seed}: a degenerate case: {a}");
    }
    Ok(())
}

#[test]
fn bad_input_is_named() -> Result<()> {
    let tmp = TempDir::new("vqa-eval-bad")?;
    let d = tmp.0.to_string_lossy().to_string();
    ensure!(reference(&["make-cases", "--out", &d, "--questions", "5"])?.status.success());
    let (q, a, r) = (format!("{d}/questions.json"), format!("{d}/annotations.json"), format!("{d}/results.json"));
    let run = |results: &str| probattn(&["vqa-eval", "--questions", &q, "--annotations", &a, "--results", results]);
    let bad = format!("{d}/bad.json");
    let cases: [(&str, &str); 5] = [
        ("[{\"question_id\": 1, \"answer\": \"yes\"}", "not in the official format"),
        ("[{\"question_id\": 1, \"answer\": \"yes\"}]", "question 2 has no answer"),
        ("[{\"question_id\": 99, \"answer\": \"yes\"}]", "question 99 is not in --annotations"),
        ("[{\"question_id\": 1, \"answer\": \"a\"}, {\"question_id\": 1, \"answer\": \"b\"}]", "question 1 is answered twice"),
        ("{\"question_id\": 1}", "not in the official format"),
    ];
    for (body, needle) in cases {
        std::fs::write(&bad, body)?;
        let o = run(&bad)?;
        ensure!(o.status.code() == Some(1) && text(&o).contains(needle), "{body}: exit {:?}, {}", o.status.code(), text(&o));
    }
    let o = run(&format!("{d}/absent.json"))?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("absent.json"), "{}", text(&o));
    ensure!(run(&r)?.status.success());
    Ok(())
}
