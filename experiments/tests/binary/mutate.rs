//! Seeded mutations of a file and a runner that accepts only a correct load or a named error: the
//! malformed-input tests (tests/mutation.rs, and the VQA tests for their own files).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use super::text;

/// A 64-bit linear congruential generator: the same mutations on every machine.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The byte-level mutations of `bytes`, `rounds` random ones of each kind: (name, bytes).
pub fn mutations(bytes: &[u8], seed: u64, rounds: usize) -> Vec<(String, Vec<u8>)> {
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
pub fn safetensors_mutations(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
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
pub fn check_run(what: &str, args: &[&str]) -> Result<()> {
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

pub fn rounds() -> Result<usize> {
    match std::env::var("PROBATTN_MUTATION_ROUNDS") {
        Ok(s) => s.parse().with_context(|| format!("PROBATTN_MUTATION_ROUNDS={s}")),
        Err(_) => Ok(1),
    }
}

/// Writes each mutation of `original` to `path` and runs `args`; returns the cases run.
pub fn each_mutation(original: &[u8], path: &Path, cases: Vec<(String, Vec<u8>)>, args: &[&str]) -> Result<usize> {
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
