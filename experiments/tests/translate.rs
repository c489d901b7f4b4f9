//! `probattn translate` as a user runs it, on a small synthetic parallel corpus written here (so
//! the tests need no data): a run killed with SIGKILL in the middle of an epoch, or between an
//! epoch's metrics line and its checkpoint, and resumed ends with exactly the uninterrupted run's
//! metrics and translations; --decode reuses a checkpoint;
//! bad input gets a named error and exit status 1.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use binary::{metrics, probattn, text, FLAGS};
use common::{write_corpus, TempDir};

/// Runs `probattn args` until `ready()` holds (polled every `poll`, at most 5 minutes, the run
/// still going), waits `linger` more, then kills it with SIGKILL while it still runs.
fn kill_when(args: &[&str], ready: impl Fn() -> bool, what: &str, poll: Duration, linger: Duration) -> Result<()> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_probattn")).args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let start = Instant::now();
    while !ready() {
        ensure!(child.try_wait()?.is_none(), "the run ended before {what}");
        ensure!(start.elapsed() < Duration::from_secs(300), "no {what} after 5 minutes");
        std::thread::sleep(poll);
    }
    std::thread::sleep(linger);
    ensure!(child.try_wait()?.is_none(), "the run finished before it could be killed: make it longer");
    child.kill()?;
    child.wait()?;
    Ok(())
}

/// The test flags without --warmup-updates, which the LSTM's schedule does not have.
fn lstm_flags() -> Vec<&'static str> {
    let at = FLAGS.iter().position(|f| *f == "--warmup-updates").unwrap_or(FLAGS.len());
    FLAGS.iter().enumerate().filter(|(i, _)| *i != at && *i != at + 1).map(|(_, f)| *f).collect()
}

/// Our checkpoints are data only: safetensors (an 8-byte little-endian header length, then a JSON
/// header), never a pickle (0x80 ...) or a zip archive (torch.save's "PK").
fn ensure_safetensors(path: &Path) -> Result<()> {
    let bytes = std::fs::read(path)?;
    ensure!(bytes.len() > 9 && bytes[8] == b'{' && !bytes.starts_with(b"PK") && bytes[0] != 0x80, "the checkpoint is not safetensors");
    let header_len = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    ensure!(8 + header_len <= bytes.len(), "the checkpoint's safetensors header runs past its end");
    serde_json::from_slice::<serde_json::Value>(&bytes[8..8 + header_len]).context("the checkpoint's header is not JSON")?;
    Ok(())
}

/// No temporary file of an atomic write is left in `dir`.
fn no_temporary_files(dir: &Path) -> Result<()> {
    let left: Vec<String> =
        std::fs::read_dir(dir)?.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.contains(".tmp-")).collect();
    ensure!(left.is_empty(), "temporary files left behind in {}: {left:?}", dir.display());
    Ok(())
}

#[test]
fn a_killed_run_resumes_to_the_uninterrupted_result() -> Result<()> {
    let tmp = TempDir::new("translate-resume")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [400, 20, 20])?;
    let data = data.to_string_lossy().to_string();
    let (a, b) = (tmp.path("a").to_string_lossy().to_string(), tmp.path("b").to_string_lossy().to_string());

    let whole = probattn(&[&["translate", "--data-dir", &data, "--out", &a][..], &FLAGS].concat())?;
    ensure!(whole.status.success(), "{}", text(&whole));

    // The same run, killed (SIGKILL) after its first checkpoint, in the middle of a later epoch.
    let ckpt = tmp.path("b/seed-1/checkpoint_last.safetensors");
    let args = [&["translate", "--data-dir", &data, "--out", &b][..], &FLAGS].concat();
    kill_when(&args, || ckpt.exists(), "its first checkpoint", Duration::from_millis(20), Duration::from_millis(300))?;
    ensure!(!tmp.path("b/results.json").exists(), "the killed run wrote results");
    ensure_safetensors(&ckpt)?;

    let resumed = probattn(&[&["translate", "--data-dir", &data, "--resume", &b][..], &FLAGS].concat())?;
    ensure!(resumed.status.success(), "{}", text(&resumed));
    ensure!(text(&resumed).contains("resuming seed 1 after epoch"), "{}", text(&resumed));
    ensure!(
        metrics(Path::new(&a))? == metrics(Path::new(&b))?,
        "metrics differ:\n{:?}\n{:?}",
        metrics(Path::new(&a))?,
        metrics(Path::new(&b))?
    );
    let hyp = |d: &str| std::fs::read_to_string(Path::new(d).join("seed-1/test.hyp"));
    ensure!(hyp(&a)? == hyp(&b)?, "test translations differ");
    let results: serde_json::Value = serde_json::from_slice(&std::fs::read(tmp.path("b/results.json"))?)?;
    for field in ["test_bleu", "test_bleu_tok", "valid_bleu", "best_epoch", "epochs", "tokens_per_second"] {
        ensure!(!results["runs"][0][field].is_null(), "results.json lacks runs[0].{field}");
    }
    no_temporary_files(&tmp.path("b/seed-1"))?;

    // The checkpoint translates a file for users, and agrees with the run's own test output.
    let ckpt = tmp.path("b/seed-1/checkpoint_best.safetensors").to_string_lossy().to_string();
    let input = format!("{data}/test.de");
    let out = tmp.path("decoded.txt").to_string_lossy().to_string();
    let decoded = probattn(&[
        "translate",
        "--decode",
        "--checkpoint",
        &ckpt,
        "--input",
        &input,
        "--output",
        &out,
        "--beam",
        "2",
        "--threads",
        "1",
        "--device",
        "cpu",
    ])?;
    ensure!(decoded.status.success(), "{}", text(&decoded));
    ensure!(std::fs::read_to_string(&out)? == hyp(&b)?, "--decode differs from the run's test.hyp");

    // Killed the moment an epoch's metrics line lands, before that epoch's checkpoint_last is
    // saved (the window is a few ms; the tight poll hits it most times): the resumed run must not
    // write that epoch's line twice.
    let c = tmp.path("c").to_string_lossy().to_string();
    let lines = tmp.path("c/seed-1/metrics.jsonl");
    let args = [&["translate", "--data-dir", &data, "--out", &c][..], &FLAGS].concat();
    let second_line = || std::fs::read_to_string(&lines).map_or(0, |t| t.lines().count()) >= 2;
    kill_when(&args, second_line, "its second epoch's metrics", Duration::ZERO, Duration::ZERO)?;
    let resumed = probattn(&[&["translate", "--data-dir", &data, "--resume", &c][..], &FLAGS].concat())?;
    ensure!(resumed.status.success(), "{}", text(&resumed));
    ensure!(
        metrics(Path::new(&a))? == metrics(Path::new(&c))?,
        "metrics differ after a kill between metrics and checkpoint:\n{:?}\n{:?}",
        metrics(Path::new(&a))?,
        metrics(Path::new(&c))?
    );

    // Resuming with other flags is refused by name.
    let other = probattn(&[&["translate", "--data-dir", &data, "--resume", &b, "--label-smoothing", "0.2"][..], &FLAGS].concat())?;
    ensure!(other.status.code() == Some(1) && text(&other).contains("flags differ"), "{}", text(&other));
    Ok(())
}

#[test]
fn bad_input_is_named() -> Result<()> {
    let tmp = TempDir::new("translate-bad")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [30, 5, 5])?;
    let d = data.to_string_lossy().to_string();
    let out = tmp.path("out").to_string_lossy().to_string();
    let run = |extra: &[&str]| probattn(&[&["translate", "--data-dir", &d, "--out", &out][..], &FLAGS, extra].concat());

    std::fs::write(data.join("valid.en"), "one\ntwo\n")?;
    let o = run(&[])?;
    ensure!(
        o.status.code() == Some(1) && text(&o).contains("valid.de has 5 lines but") && text(&o).contains("valid.en has 2"),
        "{}",
        text(&o)
    );
    std::fs::write(data.join("valid.en"), "one\n\nthree\nfour\nfive\n")?;
    let o = run(&[])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("valid.en line 2 is empty"), "{}", text(&o));
    write_corpus(&data, [30, 5, 5])?;
    let o = probattn(&["translate", "--data-dir", "/nonexistent/corpus"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("/nonexistent/corpus"), "{}", text(&o));
    let o = probattn(&["translate", "--no-such-flag"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("--no-such-flag"), "{}", text(&o));
    let o = probattn(&["translate", "--dataset", "wmt14"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("wmt14") && text(&o).contains("multi30k"), "{}", text(&o));
    // IWSLT14 is not shipped: its default folder is named, with what to put there.
    if !Path::new("data/iwslt14").exists() {
        let o = probattn(&["translate", "--dataset", "iwslt14", "--out", &out])?;
        ensure!(o.status.code() == Some(1) && text(&o).contains("data/iwslt14"), "{}", text(&o));
    }
    let o = probattn(&["translate", "--help"])?;
    ensure!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("--dataset"), "{}", text(&o));
    let o = run(&["--attention", "cosine"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("--attention"), "{}", text(&o));
    let bad = tmp.path("bad.safetensors");
    std::fs::write(&bad, b"not a checkpoint")?;
    let o = probattn(&["translate", "--decode", "--checkpoint", &bad.to_string_lossy(), "--input", &format!("{d}/test.de")])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("bad.safetensors"), "{}", text(&o));
    Ok(())
}

#[test]
fn average_last_tests_the_mean_of_the_last_epochs() -> Result<()> {
    let tmp = TempDir::new("translate-average")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [200, 10, 10])?;
    let (d, out) = (data.to_string_lossy().to_string(), tmp.path("out").to_string_lossy().to_string());
    let o = probattn(&[&["translate", "--data-dir", &d, "--out", &out, "--average-last", "2"][..], &FLAGS].concat())?;
    ensure!(o.status.success(), "{}", text(&o));
    ensure!(text(&o).contains("test with the average of epochs 3..=4"), "{}", text(&o));
    // Only the last two epochs' weights are kept.
    let kept: Vec<bool> = (1..=4).map(|e| tmp.path(&format!("out/seed-1/weights_epoch{e}.safetensors")).exists()).collect();
    ensure!(kept == [false, false, true, true], "weights kept: {kept:?}");
    // The tested model (saved as checkpoint_average) is the element-wise mean of those two.
    let read = |name: &str| -> Result<std::collections::HashMap<String, tch::Tensor>> {
        Ok(tch::Tensor::read_safetensors(tmp.path(&format!("out/seed-1/{name}")))?.into_iter().collect())
    };
    let (e3, e4, avg) = (read("weights_epoch3.safetensors")?, read("weights_epoch4.safetensors")?, read("checkpoint_average.safetensors")?);
    ensure!(!e3.is_empty() && e3.len() == e4.len(), "epoch weights: {} and {} tensors", e3.len(), e4.len());
    let mut moved = 0.0f64;
    for (name, a) in &e3 {
        let b = e4.get(name).with_context(|| format!("epoch 4 lacks {name}"))?;
        let got = avg.get(name).with_context(|| format!("checkpoint_average lacks {name}"))?;
        let want = (a.to_kind(tch::Kind::Double) + b.to_kind(tch::Kind::Double)) / 2.0;
        let err = (got.to_kind(tch::Kind::Double) - &want).abs().max().double_value(&[]);
        ensure!(err <= 1e-6 * (1.0 + want.abs().max().double_value(&[])), "{name}: averaged weights off the mean by {err}");
        moved = moved.max((a - b).abs().max().double_value(&[]));
    }
    ensure!(moved > 1e-4, "epochs 3 and 4 hold the same weights (max diff {moved}): the check would not see a wrong average");
    // And it decodes like any checkpoint.
    let input = tmp.path("in.de");
    std::fs::copy(data.join("test.de"), &input)?;
    let input = input.to_string_lossy().to_string();
    let ckpt = tmp.path("out/seed-1/checkpoint_average.safetensors").to_string_lossy().to_string();
    let o =
        probattn(&["translate", "--decode", "--checkpoint", &ckpt, "--input", &input, "--beam", "2", "--device", "cpu", "--threads", "1"])?;
    ensure!(o.status.success() && String::from_utf8_lossy(&o.stdout).lines().count() == 10, "{}", text(&o));
    Ok(())
}

#[test]
fn the_attentional_lstm_trains_resumes_decodes_and_refuses_what_it_lacks() -> Result<()> {
    let tmp = TempDir::new("translate-lstm")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [200, 10, 10])?;
    let (d, a, b) =
        (data.to_string_lossy().to_string(), tmp.path("a").to_string_lossy().to_string(), tmp.path("b").to_string_lossy().to_string());
    let flags = lstm_flags();
    let lstm = ["--arch", "lstm", "--attention", "bam-wc", "--kl-weight", "0.1", "--kl-anneal-updates", "8"];
    let o = probattn(&[&["translate", "--data-dir", &d, "--out", &a][..], &flags, &lstm].concat())?;
    ensure!(o.status.success(), "{}", text(&o));
    ensure!(text(&o).contains("attentional LSTM") && text(&o).contains("attention bam-wc"), "{}", text(&o));
    let r = binary::json(&tmp.path("a/results.json"))?;
    let cfg = &r["config"];
    ensure!(cfg["model"]["lstm"]["variant"] == "bam-wc" && cfg["model"]["transformer"].is_null(), "{cfg}");
    ensure!(cfg["schedule"]["decay"] == 0.5 && cfg["max_grad_norm"] == 5.0 && cfg["kl_anneal_updates"] == 8, "{cfg}");
    let lines = metrics(Path::new(&a))?;
    ensure!(lines.len() == 4 && lines.iter().all(|m| m["kl"].as_f64().is_some_and(f64::is_finite)), "{lines:?}");
    ensure!(r["runs"][0]["test_bleu"].is_number(), "{r}");

    // Killed after its first checkpoint and resumed: the uninterrupted run's metrics.
    let ckpt = tmp.path("b/seed-1/checkpoint_last.safetensors");
    let args = [&["translate", "--data-dir", &d, "--out", &b][..], &flags, &lstm].concat();
    kill_when(&args, || ckpt.exists(), "its first checkpoint", Duration::from_millis(20), Duration::ZERO)?;
    let o = probattn(&[&["translate", "--data-dir", &d, "--resume", &b][..], &flags, &lstm].concat())?;
    ensure!(o.status.success(), "{}", text(&o));
    ensure!(metrics(Path::new(&b))? == lines, "the resumed LSTM run's metrics differ from the uninterrupted run's");

    // Its checkpoint decodes.
    let ckpt = tmp.path("a/seed-1/checkpoint_best.safetensors").to_string_lossy().to_string();
    let input = format!("{d}/test.de");
    let o =
        probattn(&["translate", "--decode", "--checkpoint", &ckpt, "--input", &input, "--beam", "2", "--device", "cpu", "--threads", "1"])?;
    ensure!(o.status.success() && String::from_utf8_lossy(&o.stdout).lines().count() == 10, "{}", text(&o));

    // What the LSTM has no place for: a named error, nothing written.
    let never = tmp.path("never").to_string_lossy().to_string();
    for (extra, said) in [
        (&["--attention", "hnas"][..], "one decoder state at a time"),
        (&["--repulsive", "svgd"][..], "one head"),
        (&["--preset", "small"][..], "--arch lstm takes deng2018, deng2018-small or tiny"),
        (&["--warmup-updates", "10"][..], "OpenNMT-py"),
    ] {
        let mut args = [&["translate", "--data-dir", &d, "--out", &never][..], &flags, &["--arch", "lstm"], extra].concat();
        if extra[0] == "--preset" {
            let at = args.iter().position(|a| *a == "tiny").context("the flags set --preset tiny")?;
            args[at] = "small";
            args.truncate(args.len() - 2);
        }
        let o = probattn(&args)?;
        ensure!(o.status.code() == Some(1) && text(&o).contains(said), "{extra:?}: expected '{said}':\n{}", text(&o));
    }
    ensure!(!Path::new(&never).exists(), "a refused run left {never} behind");
    Ok(())
}

/// What python/probattn_tools/baselines/translate.py's LSTM gives (`--logits`) for the inputs in
/// `inputs` with the weights in `sd64`: a run folder of its own holds `config` (the same run with
/// another attention: only config.json differs).
fn pytorch_lstm(
    tmp: &TempDir,
    config: &serde_json::Value,
    variant: &str,
    sd64: &Path,
    inputs: &Path,
) -> Result<std::collections::HashMap<String, tch::Tensor>> {
    let dir = tmp.path(&format!("run-{variant}"));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), serde_json::to_string(config)?)?;
    let theirs = tmp.path(&format!("logits-{variant}.safetensors"));
    let o = common::python_module("baselines.translate")?
        .args([
            "--run",
            &dir.to_string_lossy(),
            "--load-state-dict",
            &sd64.to_string_lossy(),
            "--logits",
            &inputs.to_string_lossy(),
            &theirs.to_string_lossy(),
        ])
        .output()?;
    ensure!(o.status.success(), "the PyTorch LSTM ({variant}) did not run: {}", text(&o));
    Ok(tch::Tensor::read_safetensors(&theirs)?.into_iter().collect())
}

#[test]
fn the_lstm_equals_an_independent_pytorch_lstm_on_the_same_weights() -> Result<()> {
    // python/probattn_tools/baselines/translate.py writes the LSTM again in PyTorch (packed bidirectional
    // nn.LSTM, LSTMCell decoder, softmax and causal DNAS attention by hand); our trained checkpoint,
    // exported and cast to float64, must give the same logits on a padded batch, and the same
    // gradient of a random weighting of them for every parameter, with either attention (the two
    // share their parameters, so one trained run serves both).
    let tmp = TempDir::new("translate-lstm-parity")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [100, 5, 5])?;
    let (d, run) = (data.to_string_lossy().to_string(), tmp.path("run").to_string_lossy().to_string());
    let mut flags = lstm_flags();
    let epochs = flags.iter().position(|f| *f == "--max-epochs").context("--max-epochs")? + 1;
    flags[epochs] = "1";
    let o = probattn(&[&["translate", "--arch", "lstm", "--data-dir", &d, "--out", &run][..], &flags].concat())?;
    ensure!(o.status.success(), "{}", text(&o));
    let sd = tmp.path("sd.safetensors");
    let o = probattn(&["export", "--checkpoint", &format!("{run}/seed-1/checkpoint_best.safetensors"), "--out", &sd.to_string_lossy()])?;
    ensure!(o.status.success(), "{}", text(&o));
    let weights: Vec<(String, tch::Tensor)> =
        tch::Tensor::read_safetensors(&sd)?.into_iter().map(|(n, t)| (n, t.to_kind(tch::Kind::Double))).collect();
    let sd64 = tmp.path("sd64.safetensors");
    tch::Tensor::write_safetensors(&weights.iter().map(|(n, t)| (n.as_str(), t)).collect::<Vec<_>>(), &sd64)?;
    // A padded batch of ids from the vocabulary (4 and up: not the special tokens), and the
    // weighting of the logits whose gradients are compared.
    let src = tch::Tensor::from_slice(&[5i64, 9, 11, 7, 2, 8, 4, 2, 1, 1, 12, 6, 2, 1, 1]).view([3, 5]);
    let prev = tch::Tensor::from_slice(&[2i64, 7, 9, 4, 2, 5, 10, 1, 2, 13, 1, 1]).view([3, 4]);
    let mut config = binary::json(&tmp.path("run/config.json"))?;
    let vocab = config["model"]["vocab"].as_i64().context("model.vocab")?;
    tch::manual_seed(5);
    let r = tch::Tensor::randn([3, 4, vocab], (tch::Kind::Double, tch::Device::Cpu));
    let inputs = tmp.path("in.safetensors");
    tch::Tensor::write_safetensors(&[("src", &src), ("prev", &prev), ("r", &r)], &inputs)?;
    // Padded target steps are nobody's output; compare the live ones.
    let live = prev.ne(1).unsqueeze(-1).to_kind(tch::Kind::Double);

    for variant in ["softmax", "dnas"] {
        config["model"]["lstm"]["variant"] = variant.into();
        let theirs = pytorch_lstm(&tmp, &config, variant, &sd64, &inputs)?;

        let cfg: probattn_models::translation::Seq2SeqConfig = serde_json::from_value(config["model"].clone())?;
        let mut vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let model = probattn_models::translation::Seq2Seq::new(&vs.root(), cfg)?;
        vs.double();
        vs.load(&sd64)?;
        let (ours, _) = model.forward_t(&src, &prev, false)?;
        let expected = theirs.get("logits").context("no logits")?;
        let err = ((&ours - expected) * &live).abs().max().double_value(&[]);
        let scale = expected.abs().max().double_value(&[]);
        ensure!(err <= 1e-10 * (1.0 + scale), "{variant}: ours and PyTorch's LSTM logits differ by {err} (scale {scale})");

        (&r * &ours * &live).sum(tch::Kind::Double).backward();
        let variables = vs.variables();
        ensure!(
            variables.len() + 1 == theirs.len(),
            "{variant}: {} parameters here, {} gradients there",
            variables.len(),
            theirs.len() - 1
        );
        for (name, var) in &variables {
            let expected = theirs.get(&format!("grad.{name}")).with_context(|| format!("{variant}: no gradient of {name}"))?;
            let err = (var.grad() - expected).abs().max().double_value(&[]);
            let scale = expected.abs().max().double_value(&[]);
            ensure!(err <= 1e-10 * (1.0 + scale), "{variant}: the gradients of {name} differ by {err} (scale {scale})");
        }
    }
    Ok(())
}

#[test]
fn a_bfloat16_run_records_its_precision_and_keeps_float32_checkpoints() -> Result<()> {
    // `--precision bf16` trains (DNAS in the encoder: a doubly-normalized variant's float32
    // statistics under autocast), records the precision, warns where bfloat16 is emulated, and
    // writes float32 weights that decoding reads in either precision; an unknown precision is named.
    let tmp = TempDir::new("translate-bf16")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [120, 10, 10])?;
    let (d, out) = (data.to_string_lossy().to_string(), tmp.path("out").to_string_lossy().to_string());
    let args = [&["translate", "--data-dir", &d, "--out", &out, "--attention", "dnas", "--precision", "bf16"][..], &FLAGS].concat();
    let o = probattn(&args)?;
    ensure!(o.status.success(), "{}", text(&o));
    // Where the CPU has no bfloat16 instructions, the run says it will be slower than float32.
    let emulated = !probattn::precision::cpu_has_bf16_instructions();
    let warned = String::from_utf8_lossy(&o.stderr).contains("warning: bf16 on this CPU, which has no bfloat16 instructions");
    ensure!(warned == emulated, "bfloat16 emulated: {emulated}, warned: {warned}: {}", text(&o));
    let results: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.path("out/results.json"))?)?;
    ensure!(results["config"]["precision"] == "bf16", "results.json records {}", results["config"]["precision"]);
    let ckpt = tmp.path("out/seed-1/checkpoint_best.safetensors");
    let weights = tch::Tensor::read_safetensors(&ckpt)?;
    // Every tensor but the training state (JSON as bytes): weights and Adam's moments.
    let other: Vec<String> = weights
        .iter()
        .filter(|(n, t)| n != "train_state.json" && t.kind() != tch::Kind::Float)
        .map(|(n, t)| format!("{n} {:?}", t.kind()))
        .collect();
    ensure!(!weights.is_empty() && other.is_empty(), "checkpoint tensors not float32: {other:?}");
    let input = data.join("test.de").to_string_lossy().to_string();
    let ckpt = ckpt.to_string_lossy().to_string();
    for precision in ["f32", "bf16"] {
        let args = ["translate", "--decode", "--checkpoint", &ckpt, "--input", &input, "--beam", "2", "--precision", precision];
        let o = probattn(&[&args[..], &["--device", "cpu", "--threads", "1"]].concat())?;
        ensure!(o.status.success() && String::from_utf8_lossy(&o.stdout).lines().count() == 10, "{precision}: {}", text(&o));
        ensure!(precision == "bf16" || !String::from_utf8_lossy(&o.stderr).contains("warning: bf16"), "f32 warned: {}", text(&o));
    }
    let o = probattn(&["translate", "--precision", "fp8", "--data-dir", &d])?;
    ensure!(!o.status.success() && text(&o).contains("unknown precision 'fp8' (known: f32, tf32, bf16)"), "{}", text(&o));
    Ok(())
}
