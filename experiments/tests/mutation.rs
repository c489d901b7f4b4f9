//! Malformed input at scale: seeded mutations of every kind of file the command line loads, each
//! run through `probattn` as a user would. Every case must end in a correct load (status 0) or a
//! named error (status 1, an `error:` line), never a panic (status 101), a signal (an abort or a
//! crash) or a hang (killed after 120 s).
//!
//! The files: an `attend` input (safetensors), a training checkpoint (safetensors) and its
//! tokenizer (JSON), a corpus (text), a graph in Planetoid's format (pickles and text), and a
//! TorchScript archive (zip). The mutations: truncation, bit flips, a run of 0xFF bytes (huge
//! numbers), bytes appended, an empty file, and for safetensors a huge declared header length
//! and headers with a wrong dtype or shape or a huge one. Not mutated: a `.pt2` package's
//! compiled library, which runs inside the process by design (docs/interop.md).
//!
//! `PROBATTN_MUTATION_ROUNDS` (default 1) repeats the random mutations with further seeds: the
//! long run of the closing notes.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use binary::{probattn, text, FLAGS};
use common::{run_python, write_corpus, TempDir};
use tch::{Device, Kind, Tensor};

/// A 64-bit linear congruential generator: the same mutations on every machine.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The byte-level mutations of `bytes`, `rounds` random ones of each kind: (name, bytes).
fn mutations(bytes: &[u8], seed: u64, rounds: usize) -> Vec<(String, Vec<u8>)> {
    let mut rng = Lcg(seed);
    let mut out = vec![("empty".to_string(), vec![])];
    for round in 0..rounds {
        let cut = rng.below(bytes.len());
        out.push((format!("truncated at {cut} (round {round})"), bytes[..cut].to_vec()));
        let mut flipped = bytes.to_vec();
        let flips = 1 + rng.below(8);
        for _ in 0..flips {
            let at = rng.below(flipped.len());
            flipped[at] ^= 1 << rng.below(8);
        }
        out.push((format!("{flips} bits flipped (round {round})"), flipped));
        let mut ones = bytes.to_vec();
        let at = rng.below(ones.len());
        for b in ones.iter_mut().skip(at).take(8) {
            *b = 0xff;
        }
        out.push((format!("0xFF x 8 at {at} (round {round})"), ones));
        let mut longer = bytes.to_vec();
        longer.extend((0..1 + rng.below(64)).map(|_| rng.next() as u8));
        out.push((format!("bytes appended (round {round})"), longer));
    }
    out
}

/// Mutations that keep a safetensors file's framing but lie in its header.
fn safetensors_mutations(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let header_len = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len])?.to_string();
    let body = &bytes[8 + header_len..];
    let with_header = |h: &str| {
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h.as_bytes());
        out.extend(body);
        out
    };
    let mut out = vec![];
    for huge in [u64::MAX, 1 << 40, (bytes.len() as u64) + 1] {
        let mut b = bytes.to_vec();
        b[..8].copy_from_slice(&huge.to_le_bytes());
        out.push((format!("header length {huge}"), b));
    }
    for (from, to) in
        [("\"F64\"", "\"I64\""), ("\"F64\"", "\"F16\""), ("\"F64\"", "\"XX\""), ("\"F32\"", "\"BOOL\""), ("\"F32\"", "\"U8\"")]
    {
        if header.contains(from) {
            out.push((format!("dtype {from} -> {to}"), with_header(&header.replacen(from, to, 1))));
        }
    }
    // Shapes: one dimension changed, one made huge (the offsets no longer match either).
    if let Some(start) = header.find("\"shape\":[") {
        let open = start + "\"shape\":[".len();
        let close = open + header[open..].find(']').context("a shape without ]")?;
        for shape in ["1", "1,2,3,4,5", "4611686018427387904,4", "0,7"] {
            out.push((format!("shape [{shape}]"), with_header(&format!("{}{shape}{}", &header[..open], &header[close..]))));
        }
    }
    out.push(("header not JSON".into(), with_header(&"x".repeat(header_len))));
    Ok(out)
}

/// Runs `probattn args`, killing it after 120 s; an error unless it loaded (status 0) or named
/// its error (status 1 with an `error:` line and no panic).
fn check_run(what: &str, args: &[&str]) -> Result<()> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_probattn")).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let start = Instant::now();
    while child.try_wait()?.is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            child.kill()?;
            bail!("{what}: still running after 120 s (a hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    let said = text(&out);
    match out.status.code() {
        Some(0) => Ok(()),
        Some(1) if said.contains("error:") && !said.contains("panicked") => Ok(()),
        Some(code) => bail!("{what}: exit status {code}:\n{said}"),
        None => bail!("{what}: killed by a signal (a crash or an abort):\n{said}"),
    }
}

fn rounds() -> Result<usize> {
    match std::env::var("PROBATTN_MUTATION_ROUNDS") {
        Ok(s) => s.parse().with_context(|| format!("PROBATTN_MUTATION_ROUNDS={s}")),
        Err(_) => Ok(1),
    }
}

/// Writes each mutation of `original` to `path` and runs `args`; returns the cases run.
fn each_mutation(original: &[u8], path: &Path, cases: Vec<(String, Vec<u8>)>, args: &[&str]) -> Result<usize> {
    let mut failures = vec![];
    let n = cases.len();
    for (name, bytes) in cases {
        std::fs::write(path, &bytes)?;
        if let Err(e) = check_run(&format!("{} {name}", path.display()), args) {
            failures.push(format!("{e:#}"));
        }
    }
    std::fs::write(path, original)?;
    ensure!(failures.is_empty(), "{} of {n} mutations failed:\n{}", failures.len(), failures.join("\n"));
    Ok(n)
}

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
    run_python("planetoid.py", &["synth", "--dir", &d, "--name", "cora", "--seed", "5"])?;
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
    run_python("export_torchscript.py", &["mha", "--embed-dim", "16", "--heads", "4", "--out", &m, "--inputs", &i])?;
    let original = std::fs::read(&m)?;
    let args = ["compare", "--torchscript", &m, "--native", "mha", "--heads", "4", "--inputs", &i, "--device", "cpu"];
    let n = each_mutation(&original, Path::new(&m), mutations(&original, 20, rounds()?), &args)?;
    eprintln!("TorchScript archive: {n} mutations");
    Ok(())
}
