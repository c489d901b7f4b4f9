//! Malformed input at scale: seeded mutations of every kind of file the command line loads, each
//! run through `probattn` as a user would. Every case must end in a correct load (status 0) or a
//! named error (status 1, an `error:` line), never a panic (status 101), a signal (an abort or a
//! crash) or a hang (killed after 120 s).
//!
//! The files: an `attend` input (safetensors), a training checkpoint (safetensors) and its
//! tokenizer (JSON), a corpus (text), a graph in Planetoid's format (pickles and text), a
//! TorchScript archive (zip) and a `.pt2` package (zip); the VQA files are mutated by the VQA
//! tests (`vqa.rs`: meta.json, data.safetensors, detectors.json; `vqa_v2.rs`: the official
//! questions and annotations JSON, a region-feature .npz, a results file for `vqa-eval`). The
//! mutations (binary/mutate.rs): truncation, bit flips, a run of 0xFF bytes (huge numbers), bytes
//! appended, an empty file, and for safetensors a huge declared header length and headers with a
//! wrong dtype or shape or a huge one. A `.pt2` package is mutated everywhere but its compiled
//! library, which runs inside the process by design (docs/interop.md).
//!
//! `PROBATTN_MUTATION_ROUNDS` (default 1) repeats the random mutations with further seeds: the
//! long run of the closing notes.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;

use anyhow::{ensure, Context, Result};
use binary::mutate::{check_run, each_mutation, mutations, rounds, safetensors_mutations, Lcg};
use binary::{probattn, text, FLAGS};
use common::{run_python, write_corpus, TempDir};
use tch::{Device, Kind, Tensor};

#[test]
fn mutated_attend_inputs_load_or_are_named() -> Result<()> {
    let tmp = TempDir::new("mutation-attend")?;
    let input = tmp.path("qkv.safetensors");
    let opts = (Kind::Double, Device::Cpu);
    let (q, k, v) = (Tensor::randn([1, 2, 5, 4], opts), Tensor::randn([1, 2, 6, 4], opts), Tensor::randn([1, 2, 6, 3], opts));
    let pad = Tensor::from_slice(&[false, false, false, false, true, true]).view([1, 6]);
    probattn::io::write_safetensors_atomic(&input, &[("q", &q), ("k", &k), ("v", &v), ("key_padding_mask", &pad)])?;
    let original = std::fs::read(&input)?;
    let mut cases = mutations(&original, 1, rounds()?);
    cases.extend(safetensors_mutations(&original)?);
    let (i, o) = (input.to_string_lossy().to_string(), tmp.path("out.safetensors").to_string_lossy().to_string());
    let n = each_mutation(&original, &input, cases, &["attend", "--variant", "dnas", "--input", &i, "--output", &o, "--device", "cpu"])?;
    eprintln!("attend input: {n} mutations");
    Ok(())
}

#[test]
fn mutated_checkpoints_tokenizers_and_corpora_load_or_are_named() -> Result<()> {
    let tmp = TempDir::new("mutation-translate")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [120, 10, 10])?;
    let (d, run) = (data.to_string_lossy().to_string(), tmp.path("run").to_string_lossy().to_string());
    let mut flags: Vec<&str> = FLAGS.to_vec();
    let epochs = flags.iter().position(|f| *f == "--max-epochs").context("FLAGS sets --max-epochs")? + 1;
    flags[epochs] = "1";
    let trained = probattn(&[&["translate", "--data-dir", &d, "--out", &run][..], &flags].concat())?;
    ensure!(trained.status.success(), "{}", text(&trained));
    let rounds = rounds()?;

    let checkpoint = tmp.path("run/seed-1/checkpoint_best.safetensors");
    let (c, input, o) =
        (checkpoint.to_string_lossy().to_string(), format!("{d}/test.de"), tmp.path("decoded.txt").to_string_lossy().to_string());
    let decode = [
        "translate",
        "--decode",
        "--checkpoint",
        &c,
        "--input",
        &input,
        "--output",
        &o,
        "--beam",
        "2",
        "--threads",
        "1",
        "--device",
        "cpu",
    ];
    let original = std::fs::read(&checkpoint)?;
    let mut cases = mutations(&original, 2, rounds);
    cases.extend(safetensors_mutations(&original)?);
    let mut n = each_mutation(&original, &checkpoint, cases, &decode)?;

    let tokenizer = tmp.path("run/seed-1/tokenizer.json");
    let tokenizer = if tokenizer.is_file() { tokenizer } else { tmp.path("run/tokenizer.json") };
    let original = std::fs::read(&tokenizer).with_context(|| format!("reading {}", tokenizer.display()))?;
    n += each_mutation(&original, &tokenizer, mutations(&original, 3, rounds), &decode)?;

    // A corpus: invalid UTF-8, a cut line, stray bytes; one epoch on each.
    let train = data.join("train.de");
    let original = std::fs::read(&train)?;
    let out = tmp.path("corpus-run").to_string_lossy().to_string();
    let cases: Vec<_> = mutations(&original, 4, rounds).into_iter().filter(|(name, _)| name != "empty").collect();
    let args = [&["translate", "--data-dir", &d, "--out", &out][..], &flags].concat();
    for (name, bytes) in cases {
        std::fs::write(&train, &bytes)?;
        let _ = std::fs::remove_dir_all(&out);
        check_run(&format!("train.de {name}"), &args)?;
        n += 1;
    }
    std::fs::write(&train, &original)?;
    eprintln!("checkpoint, tokenizer and corpus: {n} mutations");
    Ok(())
}

#[test]
fn mutated_planetoid_files_load_or_are_named() -> Result<()> {
    let tmp = TempDir::new("mutation-planetoid")?;
    let dir = tmp.path("graph");
    let d = dir.to_string_lossy().to_string();
    run_python("data.planetoid", &["synth", "--dir", &d, "--name", "cora", "--seed", "5"])?;
    let out = tmp.path("run").to_string_lossy().to_string();
    let args = [
        "gat",
        "--dataset",
        "cora",
        "--unverified",
        "--data-dir",
        &d,
        "--seeds",
        "1",
        "--max-epochs",
        "1",
        "--device",
        "cpu",
        "--out",
        &out,
    ];
    let mut n = 0;
    for (i, part) in ["x", "y", "allx", "ally", "tx", "ty", "graph", "test.index"].iter().enumerate() {
        let path = dir.join(format!("ind.cora.{part}"));
        let original = std::fs::read(&path)?;
        n += each_mutation(&original, &path, mutations(&original, 10 + i as u64, rounds()?), &args)?;
    }
    eprintln!("Planetoid files: {n} mutations");
    Ok(())
}

#[test]
fn mutated_torchscript_archives_load_or_are_named() -> Result<()> {
    let tmp = TempDir::new("mutation-torchscript")?;
    let (m, i) = (tmp.path("mha.pt").to_string_lossy().to_string(), tmp.path("in.safetensors").to_string_lossy().to_string());
    run_python("export.torchscript", &["mha", "--embed-dim", "16", "--heads", "4", "--out", &m, "--inputs", &i])?;
    let original = std::fs::read(&m)?;
    let args = ["compare", "--torchscript", &m, "--native", "mha", "--heads", "4", "--inputs", &i, "--device", "cpu"];
    let n = each_mutation(&original, Path::new(&m), mutations(&original, 20, rounds()?), &args)?;
    eprintln!("TorchScript archive: {n} mutations");
    Ok(())
}

/// The byte ranges of a zip archive's entries whose names end in `.so`, from each local header
/// to the end of its data: the compiled library of a `.pt2` package.
fn shared_library_spans(zip: &[u8]) -> Result<Vec<std::ops::Range<usize>>> {
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(zip))?;
    let mut spans = vec![];
    for i in 0..archive.len() {
        let entry = archive.by_index_raw(i)?;
        if entry.name().ends_with(".so") {
            spans.push(entry.header_start() as usize..(entry.data_start() + entry.compressed_size()) as usize);
        }
    }
    Ok(spans)
}

#[test]
fn mutated_pt2_archives_load_or_are_named() -> Result<()> {
    // The archive's structure and every entry but the compiled library: its zip framing, the
    // metadata, the weights. The library itself runs inside the process by design (docs/interop.md).
    let tmp = TempDir::new("mutation-pt2")?;
    let (m, i) = (tmp.path("mha.pt2").to_string_lossy().to_string(), tmp.path("in.safetensors").to_string_lossy().to_string());
    run_python("export.pt2", &["mha", "--embed-dim", "16", "--heads", "4", "--out", &m, "--inputs", &i])?;
    let original = std::fs::read(&m)?;
    let library = shared_library_spans(&original)?;
    ensure!(!library.is_empty(), "{m} holds no compiled library");
    let outside = |rng: &mut Lcg| loop {
        let at = rng.below(original.len() - 8);
        if !library.iter().any(|s| s.contains(&at) || s.contains(&(at + 7))) {
            break at;
        }
    };
    let mut rng = Lcg(30);
    let mut cases = vec![("empty".to_string(), vec![])];
    for round in 0..rounds()? {
        let cut = rng.below(original.len());
        cases.push((format!("truncated at {cut} (round {round})"), original[..cut].to_vec()));
        for flips in [1, 4, 16] {
            let mut flipped = original.clone();
            for _ in 0..flips {
                let at = outside(&mut rng);
                flipped[at] ^= 1 << rng.below(8);
            }
            cases.push((format!("{flips} bits flipped outside the library (round {round})"), flipped));
        }
        let mut ones = original.clone();
        let at = outside(&mut rng);
        ones[at..at + 8].fill(0xff);
        cases.push((format!("0xFF x 8 at {at} (round {round})"), ones));
        let mut longer = original.clone();
        longer.extend((0..1 + rng.below(64)).map(|_| rng.next() as u8));
        cases.push((format!("bytes appended (round {round})"), longer));
    }
    let args = ["compare", "--pt2", &m, "--native", "mha", "--heads", "4", "--inputs", &i, "--device", "cpu", "--threads", "1"];
    let n = each_mutation(&original, Path::new(&m), cases, &args)?;
    eprintln!(".pt2 archive: {n} mutations");
    Ok(())
}
