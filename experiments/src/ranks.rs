//! What a data-parallel experiment needs from [`probattn::distributed`]: the `--dist-*` flags,
//! the process group joined from torchrun's environment (or none: one process), and the few
//! collectives an experiment's loop uses beyond the gradient all-reduce (sharing what rank 0
//! read, splitting a corpus's decoding and gathering it back, summing metrics).
//!
//! The rules every distributed experiment follows: every rank builds the same seeded batches and
//! takes its share of each; rank 0 alone reads checkpoints and writes files (atomically, as in a
//! single-process run) and shares what it read; the ranks' progress bars and lines are rank 0's.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use probattn::distributed::{shard_range, Backend, Launch, ProcessGroup};
use serde::Serialize;
use tch::Device;

/// Flags of a data-parallel run (used only under torchrun).
#[derive(Args, Debug, Clone)]
pub struct DistArgs {
    /// Collective backend under torchrun: gloo or nccl (default: nccl on CUDA, gloo on the CPU,
    /// as torch.distributed).
    #[arg(long, value_parser = parse_backend)]
    pub dist_backend: Option<Backend>,
    /// Seconds any collective (or joining the group) may wait for the other ranks before the run
    /// ends with an error naming it: a dead rank ends the others instead of hanging them.
    #[arg(long, default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..))]
    pub dist_timeout: u64,
}

fn parse_backend(s: &str) -> std::result::Result<Backend, String> {
    s.parse().map_err(|e: probattn::Error| e.to_string())
}

/// Set on every rank but 0: progress bars are drawn hidden.
static QUIET: AtomicBool = AtomicBool::new(false);

/// Whether this process is a rank other than 0 of a distributed run (its bars are hidden).
pub fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// This process's place in the job: one process, or a rank of a process group.
#[derive(Debug)]
pub struct Ranks {
    group: Option<ProcessGroup>,
    restart_count: usize,
}

/// What results.json records of a distributed run.
#[derive(Clone, Debug, Serialize)]
pub struct DistInfo {
    pub world_size: usize,
    pub backend: Backend,
    /// How many times torchrun's agent restarted the workers before this result.
    pub restarts: usize,
}

impl Ranks {
    /// One process, no group.
    pub fn single() -> Ranks {
        Ranks { group: None, restart_count: 0 }
    }

    /// Joins the process group that torchrun's environment describes, or none without one; on
    /// CUDA, each rank takes the device of its `LOCAL_RANK`. Returns the ranks and the device.
    pub fn join(args: &DistArgs, device: Device) -> Result<(Ranks, Device)> {
        let Some(launch) = Launch::from_env()? else {
            anyhow::ensure!(args.dist_backend.is_none(), "--dist-backend is for runs under torchrun (RANK and WORLD_SIZE are not set)");
            return Ok((Ranks::single(), device));
        };
        let device = match device {
            Device::Cuda(_) => Device::Cuda(launch.local_rank),
            other => other,
        };
        let backend = args.dist_backend.unwrap_or_else(|| Backend::for_device(device));
        if backend == Backend::Nccl && !device.is_cuda() {
            anyhow::bail!("--dist-backend nccl needs CUDA tensors; this run is on the CPU (use gloo)");
        }
        let group = ProcessGroup::join(&launch, backend, Duration::from_secs(args.dist_timeout))?;
        QUIET.store(launch.rank != 0, Ordering::Relaxed);
        if launch.rank == 0 {
            eprintln!(
                "distributed: {} ranks, {backend} backend{}",
                launch.world_size,
                if launch.restart_count > 0 { format!(", restart {}", launch.restart_count) } else { String::new() }
            );
        }
        Ok((Ranks { group: Some(group), restart_count: launch.restart_count }, device))
    }

    pub fn group(&self) -> Option<&ProcessGroup> {
        self.group.as_ref()
    }

    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, ProcessGroup::rank)
    }

    pub fn world_size(&self) -> usize {
        self.group.as_ref().map_or(1, ProcessGroup::world_size)
    }

    /// Rank 0 (or the only process): the one that reads checkpoints and writes files.
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// Whether torchrun's agent restarted this job's workers: the run then resumes from its
    /// last checkpoint, as `--resume` would.
    pub fn restarted(&self) -> bool {
        self.restart_count > 0
    }

    pub fn info(&self) -> Option<DistInfo> {
        self.group.as_ref().map(|g| DistInfo { world_size: g.world_size(), backend: g.backend(), restarts: self.restart_count })
    }

    /// This rank's contiguous share of `n` items.
    pub fn shard(&self, n: usize) -> Range<usize> {
        shard_range(n, self.rank(), self.world_size())
    }

    /// Rank 0's value of `value` on every rank (sent as JSON; one process keeps its own).
    pub fn share<T: Serialize + serde::de::DeserializeOwned + Clone>(&self, value: &T) -> Result<T> {
        let Some(group) = &self.group else { return Ok(value.clone()) };
        let bytes = group.broadcast_bytes(&serde_json::to_vec(value)?)?;
        serde_json::from_slice(&bytes).context("rank 0's shared value does not parse")
    }

    /// Rank 0's bytes on every rank.
    pub fn share_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        match &self.group {
            Some(group) => Ok(group.broadcast_bytes(bytes)?),
            None => Ok(bytes.to_vec()),
        }
    }

    /// Waits for every rank (nothing to wait for in one process).
    pub fn barrier(&self) -> Result<()> {
        match &self.group {
            Some(group) => Ok(group.barrier()?),
            None => Ok(()),
        }
    }

    /// Each value summed over the ranks.
    pub fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        let Some(group) = &self.group else { return Ok(values.to_vec()) };
        let t = tch::Tensor::from_slice(values);
        group.all_reduce_sum(&[&t])?;
        Ok(Vec::try_from(&t)?)
    }

    /// Every rank's `value`, in rank order.
    pub fn gather(&self, value: f64) -> Result<Vec<f64>> {
        match &self.group {
            Some(group) => Ok(group.all_gather_f64(value)?),
            None => Ok(vec![value]),
        }
    }

    /// Runs `work` on this rank's share of `n` items and returns every rank's results in item
    /// order (`work` returns one token sequence per item of its range): a corpus decoded by all
    /// ranks at once.
    pub fn split_sequences(&self, n: usize, work: impl FnOnce(Range<usize>) -> Result<Vec<Vec<i64>>>) -> Result<Vec<Vec<i64>>> {
        let range = self.shard(n);
        let expected = range.len();
        let mine = work(range)?;
        anyhow::ensure!(mine.len() == expected, "a shard of {expected} items gave {} results", mine.len());
        let Some(group) = &self.group else { return Ok(mine) };
        let all: Vec<Vec<i64>> = group.all_gather_sequences(&mine)?.into_iter().flatten().collect();
        anyhow::ensure!(all.len() == n, "the ranks returned {} results for {n} items", all.len());
        Ok(all)
    }
}
