//! Data-parallel training across processes and machines through PyTorch's own c10d, launched the
//! way PyTorch users launch DistributedDataParallel: `torchrun`.
//!
//! [`Launch::from_env`] reads torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`, and the elastic agent's `TORCHELASTIC_*`); [`ProcessGroup::join`]
//! joins the job's process group, a `c10d::ProcessGroup` over a `TCPStore` with Gloo (CPU) or NCCL
//! (CUDA) as its backend; [`ProcessGroup::reducer`] builds DDP's gradient engine, the
//! `c10d::Reducer`, over a model's parameters. As in `DistributedDataParallel`, the reducer puts
//! the gradients in buckets and all-reduces each bucket as soon as backward has filled it, so
//! communication overlaps the rest of backward; when `backward()` returns, every rank holds the
//! mean of the ranks' gradients.
//!
//! Every collective runs under the group's timeout: a rank that dies or stops answering ends
//! the others with [`Error::Distributed`] naming the operation, not with a hang.
//!
//! ```no_run
//! use probattn::distributed::{Backend, Launch, ProcessGroup};
//! use std::time::Duration;
//! use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
//!
//! // Under `torchrun --nproc-per-node 2 --no-python ./my-binary`:
//! let launch = Launch::from_env()?.ok_or("not started by torchrun")?;
//! let group = ProcessGroup::join(&launch, Backend::Gloo, Duration::from_secs(300))?;
//! let vs = nn::VarStore::new(Device::Cpu);
//! let linear = nn::linear(vs.root(), 8, 1, Default::default());
//! group.broadcast_vars(&vs)?; // every rank starts from rank 0's parameters
//! let reducer = group.reducer(&vs.trainable_variables(), false)?;
//! let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
//! for _ in 0..10 {
//!     let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu)); // this rank's shard
//!     let loss = x.apply(&linear).square().mean(Kind::Float);
//!     opt.zero_grad();
//!     reducer.backward(&loss)?; // the gradients are the ranks' mean when this returns
//!     opt.step();
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

use crate::cxx::{DistHandle, JoinSpec, ReducerHandle};
use crate::{Error, Result};

/// The collective library under the process group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Gloo: CPU tensors (and CUDA tensors through the host); what torch.distributed uses on CPU.
    Gloo,
    /// NCCL: CUDA tensors; present only in builds that found NCCL's and CUDA's headers
    /// ([`Backend::nccl_available`]).
    Nccl,
}

impl Backend {
    /// torch.distributed's default for a device: NCCL on CUDA, Gloo on the CPU.
    pub fn for_device(device: Device) -> Backend {
        if device.is_cuda() {
            Backend::Nccl
        } else {
            Backend::Gloo
        }
    }

    /// Whether this build has c10d's NCCL process group.
    pub fn nccl_available() -> bool {
        crate::cxx::dist_has_nccl()
    }

    /// Whether this build has c10d's Gloo process group (gloo's headers were found at build time).
    pub fn gloo_available() -> bool {
        crate::cxx::dist_has_gloo()
    }

    /// The backends this build has.
    pub fn available() -> Vec<Backend> {
        [(Backend::Gloo, Self::gloo_available()), (Backend::Nccl, Self::nccl_available())]
            .into_iter()
            .filter_map(|(b, has)| has.then_some(b))
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gloo" => Ok(Backend::Gloo),
            "nccl" => Ok(Backend::Nccl),
            _ => Err(Error::Config(format!("unknown distributed backend '{s}' (gloo or nccl)"))),
        }
    }
}

/// A process's place in a job, as torchrun describes it in the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world_size: usize,
    /// The rank among the processes on this machine (its CUDA device, by convention).
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// How many times the elastic agent has restarted the job's workers (0 on the first start).
    pub restart_count: usize,
    /// Whether the store at `master_addr:master_port` is the elastic agent's, already running
    /// (torchrun's default), so that no rank hosts one.
    pub agent_store: bool,
}

impl Launch {
    /// The launch that torchrun's environment describes; `None` when neither `RANK` nor
    /// `WORLD_SIZE` is set (a plain single-process run). A partial or malformed environment is an
    /// error that names the variable.
    pub fn from_env() -> Result<Option<Launch>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`Self::from_env`], reading the variables through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        if var("RANK").is_none() && var("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let required = |name: &str| {
            var(name).ok_or_else(|| Error::Config(format!("{name} is not set, but RANK or WORLD_SIZE is: start the job with torchrun")))
        };
        let number = |name: &str, text: String| {
            text.trim().parse::<usize>().map_err(|_| Error::Config(format!("{name}={text:?} is not a non-negative integer")))
        };
        let rank = number("RANK", required("RANK")?)?;
        let world_size = number("WORLD_SIZE", required("WORLD_SIZE")?)?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!("RANK={rank} is not below WORLD_SIZE={world_size}")));
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(text) => number("LOCAL_RANK", text)?,
            None => 0,
        };
        let master_addr = required("MASTER_ADDR")?;
        let port_text = required("MASTER_PORT")?;
        let master_port = port_text
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| Error::Config(format!("MASTER_PORT={port_text:?} is not a TCP port")))?;
        let restart_count = match var("TORCHELASTIC_RESTART_COUNT") {
            Some(text) => number("TORCHELASTIC_RESTART_COUNT", text)?,
            None => 0,
        };
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        Ok(Some(Launch { rank, world_size, local_rank, master_addr, master_port, restart_count, agent_store }))
    }

    /// A one-process launch on a fresh local store at `port` (tests, and world size 1 checks).
    pub fn single(port: u16) -> Launch {
        Launch {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            restart_count: 0,
            agent_store: false,
        }
    }
}

/// Default bucket size of the reducer, as DistributedDataParallel's `bucket_cap_mb=25`.
pub const DEFAULT_BUCKET_BYTES: i64 = 25 * 1024 * 1024;

/// A joined c10d process group.
#[derive(Debug)]
pub struct ProcessGroup {
    handle: DistHandle,
    rank: usize,
    world_size: usize,
    backend: Backend,
    timeout: Duration,
}

impl ProcessGroup {
    /// Joins the job's process group (blocks until every rank has joined, or `timeout`). Rank 0
    /// hosts the TCPStore unless torchrun's agent already does; under the agent's store, each
    /// restart of the job gets its own key prefix, as torch.distributed's `env://` does.
    pub fn join(launch: &Launch, backend: Backend, timeout: Duration) -> Result<ProcessGroup> {
        if timeout.is_zero() {
            return Err(Error::Config("the distributed timeout must be positive".into()));
        }
        let prefix = format!("/probattn/attempt_{}", launch.restart_count);
        let spec = JoinSpec {
            backend: backend.name(),
            host: &launch.master_addr,
            port: launch.master_port,
            is_server: launch.rank == 0 && !launch.agent_store,
            prefix: &prefix,
            rank: launch.rank,
            world_size: launch.world_size,
            timeout_ms: i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX),
        };
        let handle = DistHandle::join(&spec).map_err(|m| {
            Error::Distributed(format!(
                "rank {} of {} could not join the {backend} process group at {}:{}: {m}",
                launch.rank, launch.world_size, launch.master_addr, launch.master_port
            ))
        })?;
        Ok(ProcessGroup { handle, rank: launch.rank, world_size: launch.world_size, backend, timeout })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether this is rank 0, the one that writes a job's files.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    fn failed(&self, what: &str) -> impl FnOnce(String) -> Error + '_ {
        let what = what.to_string();
        move |m| {
            Error::Distributed(format!(
                "{what} failed on rank {} of {} (a rank died, or did not reach it within {} s): {m}",
                self.rank,
                self.world_size,
                self.timeout.as_secs()
            ))
        }
    }

    /// Overwrites each tensor with rank `root`'s.
    pub fn broadcast(&self, tensors: &[&Tensor], root: usize) -> Result<()> {
        tch::no_grad(|| self.handle.broadcast(tensors, root)).map_err(self.failed("broadcast"))
    }

    /// Every variable of `vs` (parameters and buffers) set to rank 0's, as DDP does when it
    /// wraps a module.
    pub fn broadcast_vars(&self, vs: &nn::VarStore) -> Result<()> {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let tensors: Vec<&Tensor> = named.iter().map(|(_, t)| t).collect();
        self.broadcast(&tensors, 0)
    }

    /// Sums each tensor over the ranks, in place.
    pub fn all_reduce_sum(&self, tensors: &[&Tensor]) -> Result<()> {
        tch::no_grad(|| self.handle.all_reduce(tensors, false)).map_err(self.failed("all-reduce (sum)"))
    }

    /// Takes each tensor's elementwise maximum over the ranks, in place.
    pub fn all_reduce_max(&self, tensors: &[&Tensor]) -> Result<()> {
        tch::no_grad(|| self.handle.all_reduce(tensors, true)).map_err(self.failed("all-reduce (max)"))
    }

    /// Every rank's `tensor` (the same shape and dtype on every rank), in rank order.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        tch::no_grad(|| self.handle.all_gather(tensor)).map_err(self.failed("all-gather"))
    }

    /// Every rank's list of token sequences (any lengths), in rank order: what each rank
    /// decoded of a split corpus, say.
    pub fn all_gather_sequences(&self, sequences: &[Vec<i64>]) -> Result<Vec<Vec<Vec<i64>>>> {
        // One flat int64 row: [count, len_1, ..., len_n, tokens...], padded to the longest rank's.
        let mut flat: Vec<i64> = vec![sequences.len() as i64];
        flat.extend(sequences.iter().map(|s| s.len() as i64));
        flat.extend(sequences.iter().flatten());
        let length = Tensor::from_slice(&[flat.len() as i64]);
        self.all_reduce_max(&[&length])?;
        let longest = i64::try_from(&length)? as usize;
        flat.resize(longest, 0);
        let gathered = self.all_gather(&Tensor::from_slice(&flat))?;
        let mut out = Vec::with_capacity(gathered.len());
        for (rank, t) in gathered.iter().enumerate() {
            let row: Vec<i64> = Vec::try_from(t)?;
            let bad = || Error::Distributed(format!("rank {rank} sent a malformed sequence list"));
            let n = usize::try_from(*row.first().ok_or_else(bad)?).map_err(|_| bad())?;
            let lengths = row.get(1..1 + n).ok_or_else(bad)?;
            let mut at = 1 + n;
            let mut seqs = Vec::with_capacity(n);
            for &len in lengths {
                let len = usize::try_from(len).map_err(|_| bad())?;
                seqs.push(row.get(at..at + len).ok_or_else(bad)?.to_vec());
                at += len;
            }
            out.push(seqs);
        }
        Ok(out)
    }

    /// Rank 0's bytes on every rank (`bytes` is read on rank 0 only): a tokenizer or a training
    /// state that only rank 0 has read from disk, say.
    pub fn broadcast_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        let length = Tensor::from_slice(&[bytes.len() as i64]);
        self.broadcast(&[&length], 0)?;
        let n = i64::try_from(&length)?;
        let data = if self.rank == 0 { Tensor::from_slice(bytes) } else { Tensor::zeros([n], (Kind::Uint8, Device::Cpu)) };
        self.broadcast(&[&data], 0)?;
        Ok(Vec::try_from(&data)?)
    }

    /// Every rank's `value`, in rank order.
    pub fn all_gather_f64(&self, value: f64) -> Result<Vec<f64>> {
        let gathered = self.all_gather(&Tensor::from_slice(&[value]))?;
        gathered.iter().map(|t| Ok(f64::try_from(t)?)).collect()
    }

    /// Waits for every rank.
    pub fn barrier(&self) -> Result<()> {
        self.handle.barrier().map_err(self.failed("barrier"))
    }

    /// DDP's gradient engine over `params` (every one must get a gradient in every backward
    /// unless `find_unused`, which costs a graph traversal per step), with DDP's default 25 MiB
    /// buckets. The parameters must already be equal on every rank ([`Self::broadcast_vars`]).
    pub fn reducer(&self, params: &[Tensor], find_unused: bool) -> Result<Reducer> {
        self.reducer_with_buckets(params, find_unused, DEFAULT_BUCKET_BYTES)
    }

    /// [`Self::reducer`] with buckets of `bucket_bytes`.
    pub fn reducer_with_buckets(&self, params: &[Tensor], find_unused: bool, bucket_bytes: i64) -> Result<Reducer> {
        if params.is_empty() {
            return Err(Error::Config("the reducer needs at least one parameter".into()));
        }
        if let Some(p) = params.iter().find(|p| !p.requires_grad()) {
            return Err(Error::Config(format!("a parameter of shape {:?} does not require a gradient", p.size())));
        }
        let refs: Vec<&Tensor> = params.iter().collect();
        let handle = self.handle.reducer(&refs, bucket_bytes.max(1), find_unused).map_err(self.failed("creating the reducer"))?;
        Ok(Reducer { handle, rank: self.rank, world_size: self.world_size })
    }

    /// A float64 scalar summed over the ranks.
    pub fn sum_f64(&self, value: f64) -> Result<f64> {
        let t = Tensor::from_slice(&[value]).to_kind(Kind::Double);
        self.all_reduce_sum(&[&t])?;
        Ok(f64::try_from(&t)?)
    }
}

/// DDP's gradient engine (`c10d::Reducer`) over a model's parameters.
#[derive(Debug)]
pub struct Reducer {
    handle: ReducerHandle,
    rank: usize,
    world_size: usize,
}

impl Reducer {
    /// Call after the forward pass and before `backward()`, every step (as DDP's forward does):
    /// the backward that follows averages the gradients over the ranks. `outputs` are the
    /// tensors backward starts from; they are read only when the reducer finds unused parameters.
    pub fn prepare_for_backward(&self, outputs: &[&Tensor]) -> Result<()> {
        self.handle
            .prepare(outputs)
            .map_err(|m| Error::Distributed(format!("preparing the gradient all-reduce on rank {} of {}: {m}", self.rank, self.world_size)))
    }

    /// [`Self::prepare_for_backward`] then `loss.backward()`: when it returns, every rank holds
    /// the ranks' mean gradient. A peer that dies during the all-reduce is an
    /// [`Error::Distributed`] here, not a panic.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        self.prepare_for_backward(&[loss])?;
        loss.f_backward().map_err(|e| {
            Error::Distributed(format!("backward (with the gradient all-reduce) failed on rank {} of {}: {e}", self.rank, self.world_size))
        })
    }
}

/// The contiguous share of `n` items that rank `rank` of `world_size` takes: the items
/// `[n·r/W, n·(r+1)/W)`, so the shares differ in size by at most one and their concatenation in
/// rank order is the whole.
pub fn shard_range(n: usize, rank: usize, world_size: usize) -> std::ops::Range<usize> {
    let world_size = world_size.max(1);
    (n * rank / world_size)..(n * (rank + 1) / world_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| owned.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn launch_reads_torchruns_environment() {
        assert_eq!(Launch::from_vars(vars(&[])).unwrap(), None);
        let launch = Launch::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RESTART_COUNT", "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((launch.rank, launch.world_size, launch.local_rank, launch.restart_count), (1, 2, 1, 1));
        assert!(launch.agent_store);
        let err = Launch::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err().to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
        let err = Launch::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("RANK=2"), "{err}");
        let err = Launch::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "x")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("MASTER_PORT"), "{err}");
    }

    #[test]
    fn shards_cover_everything_once() {
        for n in [0, 1, 5, 64, 101] {
            for w in 1..5 {
                let all: Vec<usize> = (0..w).flat_map(|r| shard_range(n, r, w)).collect();
                assert_eq!(all, (0..n).collect::<Vec<_>>());
            }
        }
    }
}
