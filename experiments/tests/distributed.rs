//! `probattn translate` as several processes, on a small synthetic corpus (Gloo over loopback):
//! a run resumes with 2 ranks from a 1-rank checkpoint and the reverse; a SIGKILLed rank ends
//! the other with a named error and no partial file; under torchrun --max-restarts 1 a killed
//! rank restarts the job, which ends with the uninterrupted run's metrics and translations.
//! `probattn vqa` trains on two ranks, and on one rank of a process group as one process does.
//!
//! Ranks are started either by this test with torchrun's variables set by hand, or by torchrun
//! itself (the one in the set-up's virtualenv, beside PROBATTN_PYTHON).

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use binary::{metrics, metrics_file, probattn, text, FLAGS};
use common::{tiny_sort_of_clevr, write_corpus, TempDir};

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `probattn <args>` as rank `rank` of `world` with torchrun's variables set (a plain process,
/// without them, when `world` is 0), its output in `log`.
fn spawn_probattn(args: &[&str], rank: usize, world: usize, port: u16, log: &Path) -> Result<Child> {
    let log = std::fs::File::create(log)?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_probattn"));
    command.args(args).stdout(Stdio::null()).stderr(log);
    if world == 0 {
        return Ok(command.spawn()?);
    }
    Ok(command
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .spawn()?)
}

/// `probattn translate <args> FLAGS` as rank `rank` of `world` (a plain process when `world`
/// is 1), its output in `log`.
fn spawn_rank(args: &[&str], rank: usize, world: usize, port: u16, log: &Path) -> Result<Child> {
    let world = if world == 1 { 0 } else { world };
    spawn_probattn(&[&["translate"][..], args, &FLAGS].concat(), rank, world, port, log)
}

/// Runs `probattn <args>` on `world` ranks (0: one plain process) to the end; fails with the
/// ranks' logs.
fn run_job(args: &[&str], world: usize, logs: &Path) -> Result<()> {
    let port = free_port()?;
    let children: Vec<Child> =
        (0..world.max(1)).map(|r| spawn_probattn(args, r, world, port, &logs.join(format!("rank{r}.log")))).collect::<Result<_>>()?;
    for (r, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        let log = std::fs::read_to_string(logs.join(format!("rank{r}.log"))).unwrap_or_default();
        ensure!(status.success(), "rank {r} of {world} failed: {log}");
    }
    Ok(())
}

/// Runs `probattn translate <args> FLAGS` on `world` ranks to the end.
fn run_ranks(args: &[&str], world: usize, logs: &Path) -> Result<()> {
    let world = if world == 1 { 0 } else { world };
    run_job(&[&["translate"][..], args, &FLAGS].concat(), world, logs)
}

/// Waits until `path` exists, while `alive` says the run goes on.
fn wait_for(path: &Path, mut alive: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    while !path.exists() {
        ensure!(alive()?, "the run ended before {} appeared", path.display());
        ensure!(start.elapsed() < Duration::from_secs(300), "no {} after 5 minutes", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn temporary_files(dir: &Path) -> Vec<String> {
    walk(dir).into_iter().map(|p| p.to_string_lossy().into_owned()).filter(|n| n.contains(".tmp-")).collect()
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn corpus(tmp: &TempDir) -> Result<String> {
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [400, 20, 20])?;
    Ok(data.to_string_lossy().into_owned())
}

#[test]
fn a_run_resumes_on_another_number_of_ranks() -> Result<()> {
    let tmp = TempDir::new("dist-resume")?;
    let data = corpus(&tmp)?;
    for (first, second) in [(1usize, 2usize), (2, 1)] {
        let out = tmp.path(&format!("run-{first}-{second}"));
        let o = out.to_string_lossy().into_owned();
        std::fs::create_dir_all(&out)?;
        // Started on `first` ranks, killed after its first checkpoint.
        let port = free_port()?;
        let mut children: Vec<Child> = (0..first)
            .map(|r| spawn_rank(&["--data-dir", &data, "--out", &o], r, first, port, &out.join(format!("first{r}.log"))))
            .collect::<Result<_>>()?;
        let ckpt = out.join("seed-1/checkpoint_last.safetensors");
        wait_for(&ckpt, || Ok(children.iter_mut().all(|c| c.try_wait().map(|s| s.is_none()).unwrap_or(false))))?;
        for c in &mut children {
            c.kill()?;
            c.wait()?;
        }
        let before = metrics(&out)?;
        ensure!(!before.is_empty() && before.len() < 4, "{} epochs before the kill: make the run longer", before.len());
        // Resumed on `second` ranks.
        run_ranks(&["--data-dir", &data, "--resume", &o], second, &out)?;
        let log = std::fs::read_to_string(out.join("rank0.log"))?;
        ensure!(log.contains("resuming seed 1 after epoch"), "{first} -> {second} ranks did not resume: {log}");
        let after = metrics(&out)?;
        ensure!(after.len() == 4, "{first} -> {second} ranks: {} epochs in metrics.jsonl", after.len());
        ensure!(after[..before.len()] == before[..], "{first} -> {second} ranks: the resumed run rewrote earlier epochs");
        let results: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("results.json"))?)?;
        ensure!(results["runs"][0]["epochs"] == 4, "{results}");
        match second {
            1 => ensure!(results.get("distributed").is_none(), "a 1-process run recorded a distributed block"),
            n => ensure!(results["distributed"]["world_size"] == n && results["distributed"]["backend"] == "gloo", "{results}"),
        }
        ensure!(temporary_files(&out).is_empty(), "temporary files: {:?}", temporary_files(&out));
    }
    Ok(())
}

#[test]
fn a_killed_rank_ends_the_job_with_a_named_error_and_no_partial_file() -> Result<()> {
    let tmp = TempDir::new("dist-kill")?;
    let data = corpus(&tmp)?;
    let out = tmp.path("run");
    std::fs::create_dir_all(&out)?;
    let o = out.to_string_lossy().into_owned();
    let port = free_port()?;
    let args = ["--data-dir", &data, "--out", &o, "--dist-timeout", "30"];
    let mut survivor = spawn_rank(&args, 0, 2, port, &out.join("rank0.log"))?;
    let mut victim = spawn_rank(&args, 1, 2, port, &out.join("rank1.log"))?;
    wait_for(&out.join("seed-1/checkpoint_last.safetensors"), || Ok(survivor.try_wait()?.is_none()))?;
    victim.kill()?; // SIGKILL, mid-epoch
    victim.wait()?;
    let killed = Instant::now();
    let status = survivor.wait()?;
    let waited = killed.elapsed();
    let log = std::fs::read_to_string(out.join("rank0.log"))?;
    ensure!(status.code() == Some(1), "rank 0 ended with {status:?}: {log}");
    ensure!(log.contains("error: distributed:") && log.contains("on rank 0 of 2"), "{log}");
    ensure!(waited < Duration::from_secs(60), "rank 0 took {waited:?} after the kill (timeout 30 s)");
    ensure!(!out.join("results.json").exists(), "a results file after the failure");
    ensure!(temporary_files(&out).is_empty(), "temporary files: {:?}", temporary_files(&out));
    Ok(())
}

/// torchrun from the set-up's virtualenv.
fn torchrun() -> Result<PathBuf> {
    let python = common::python()?;
    let bin = python.parent().context("PROBATTN_PYTHON has no folder")?.join("torchrun");
    ensure!(bin.is_file(), "{} is missing: run ./download_libtorch.sh", bin.display());
    Ok(bin)
}

/// The pid of the process whose environment has RANK=`rank` and whose command line names `out`.
fn rank_pid(rank: usize, out: &str) -> Result<Option<i32>> {
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let (Ok(cmdline), Ok(environ)) = (std::fs::read(entry.path().join("cmdline")), std::fs::read(entry.path().join("environ"))) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let is_rank = environ.split(|&b| b == 0).any(|v| v == format!("RANK={rank}").as_bytes());
        if is_rank && cmdline.contains(out) && cmdline.contains("translate") && !cmdline.contains("torchrun") {
            return Ok(Some(pid));
        }
    }
    Ok(None)
}

#[test]
fn torchrun_restarts_a_killed_rank_and_ends_as_the_uninterrupted_run() -> Result<()> {
    let torchrun = torchrun()?;
    let tmp = TempDir::new("dist-elastic")?;
    let data = corpus(&tmp)?;
    let launch = |out: &str, log: &Path| -> Result<Child> {
        Ok(Command::new(&torchrun)
            .args(["--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-endpoint", &format!("127.0.0.1:{}", free_port()?)])
            .args(["--rdzv-backend", "c10d", "--no-python", env!("CARGO_BIN_EXE_probattn"), "translate", "--data-dir", &data, "--out", out])
            .args(FLAGS)
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?)
            .spawn()?)
    };
    let whole = tmp.path("whole").to_string_lossy().into_owned();
    let status = launch(&whole, &tmp.path("whole.log"))?.wait()?;
    ensure!(status.success(), "the uninterrupted run failed: {}", std::fs::read_to_string(tmp.path("whole.log"))?);

    let cut = tmp.path("cut");
    let c = cut.to_string_lossy().into_owned();
    let mut job = launch(&c, &tmp.path("cut.log"))?;
    wait_for(&cut.join("seed-1/checkpoint_last.safetensors"), || Ok(job.try_wait()?.is_none()))?;
    let Some(pid) = rank_pid(1, &c)? else { bail!("rank 1's process was not found") };
    // SIGKILL rank 1 mid-epoch; torchrun's agent stops rank 0 and starts both again.
    ensure!(Command::new("kill").args(["-KILL", &pid.to_string()]).status()?.success(), "kill failed");
    let status = job.wait()?;
    let log = std::fs::read_to_string(tmp.path("cut.log"))?;
    ensure!(status.success(), "the restarted job failed: {log}");
    ensure!(log.contains("resuming seed 1 after epoch"), "the job did not resume: {log}");
    ensure!(metrics(&cut)? == metrics(Path::new(&whole))?, "metrics differ:\n{:?}\n{:?}", metrics(&cut)?, metrics(Path::new(&whole))?);
    let hyp = |d: &Path| std::fs::read_to_string(d.join("seed-1/test.hyp"));
    ensure!(hyp(&cut)? == hyp(Path::new(&whole))?, "test translations differ");
    let results: serde_json::Value = serde_json::from_slice(&std::fs::read(cut.join("results.json"))?)?;
    ensure!(results["distributed"]["restarts"] == 1, "{}", results["distributed"]);
    Ok(())
}

/// `probattn vqa` (BAM-WC fusion: sampled attention, so each rank's noise seeding is on the
/// path) as one process, as a one-rank process group (which must train exactly as the process
/// does: rank 0 keeps a single process's seeds, the reducer's mean of one is the gradient), and
/// on two ranks, which share every batch and must end with one results file and its
/// distributed block.
#[test]
fn vqa_trains_on_two_ranks_and_one_rank_is_the_single_process() -> Result<()> {
    let tmp = TempDir::new("dist-vqa")?;
    let (data, det) = tiny_sort_of_clevr(&tmp)?;
    let run = |name: &str, world: usize| -> Result<PathBuf> {
        let out = tmp.path(name);
        std::fs::create_dir_all(&out)?;
        let o = out.join("run").to_string_lossy().into_owned();
        let args = [
            "vqa",
            "--data",
            &data,
            "--detectors",
            &det,
            "--fusion",
            "bam-wc",
            "--seeds",
            "1",
            "--max-epochs",
            "2",
            "--batch",
            "8",
            "--mc-samples",
            "3",
            "--hidden",
            "16",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--out",
            &o,
        ];
        run_job(&args, world, &out)?;
        Ok(out.join("run"))
    };
    let (plain, one, two) = (run("plain", 0)?, run("one-rank", 1)?, run("two-ranks", 2)?);
    let expected = metrics_file(&plain.join("metrics.jsonl"))?;
    ensure!(expected.len() == 2, "{} epochs in the single process's metrics.jsonl", expected.len());
    ensure!(metrics_file(&one.join("metrics.jsonl"))? == expected, "a one-rank group trained differently from one process");
    let m2 = metrics_file(&two.join("metrics.jsonl"))?;
    ensure!(m2.len() == 2 && m2.iter().all(|m| m["train_loss"].as_f64().is_some_and(f64::is_finite)), "two ranks: {m2:?}");
    for (dir, world) in [(&plain, None), (&one, Some(1)), (&two, Some(2))] {
        let results = binary::json(&dir.join("results.json"))?;
        match world {
            None => ensure!(results.get("distributed").is_none(), "one process recorded a distributed block"),
            Some(n) => ensure!(results["distributed"]["world_size"] == n && results["distributed"]["backend"] == "gloo", "{results}"),
        }
        let acc = results["runs"][0]["test_acc"].as_f64().context("no test accuracy")?;
        ensure!((0.0..=1.0).contains(&acc), "test accuracy {acc}");
        ensure!(temporary_files(dir).is_empty(), "temporary files: {:?}", temporary_files(dir));
    }
    Ok(())
}

#[test]
fn distributed_flags_are_checked() -> Result<()> {
    let o = probattn(&["translate", "--dist-backend", "mpi"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("mpi"), "{}", text(&o));
    let o = probattn(&["translate", "--dist-backend", "gloo", "--quick", "--data-dir", "/nonexistent"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("torchrun"), "{}", text(&o));
    let o = probattn(&["translate", "--help"])?;
    ensure!(text(&o).contains("--dist-backend") && text(&o).contains("--dist-timeout"), "{}", text(&o));
    Ok(())
}
