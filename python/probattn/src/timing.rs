//! The Rust side of the package's overhead benchmark: the same call timed from Rust in the
//! caller's process.

use probattn::{attend, AttendOptions, Masks, NormalizerConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tch::{nn, Tensor};

use crate::{guarded, to_py};

/// The Rust side of the package's overhead benchmark (`python/probattn/benchmarks/bench.py`), run
/// in the caller's process and thread so that both sides share one libtorch, one allocator and
/// one CPU state: `probattn::attend` called from Rust on `randn (batch, heads, seq, dim)` float32
/// inputs (from `seed`) with the normalizer built once, forward alone (under no_grad) and forward
/// + backward (`output.sum().backward()`), each `repeats` times after two warm-up calls. With
/// `baseline`, libtorch's own `scaled_dot_product_attention` instead of `attend`: the floor any
/// caller from Rust pays. Returns the milliseconds of each call, `(forward, forward_backward)`;
/// on CUDA each call is timed to its completion.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (variant, seq, *, memory_efficient=false, repeats=20, batch=1, heads=8, dim=64, seed=0, device="cpu", baseline=false))]
pub fn rust_timing(
    py: Python<'_>,
    variant: &str,
    seq: i64,
    memory_efficient: bool,
    repeats: usize,
    batch: i64,
    heads: i64,
    dim: i64,
    seed: i64,
    device: &str,
    baseline: bool,
) -> PyResult<(Vec<f64>, Vec<f64>)> {
    let variant = crate::variant(variant)?;
    let device = match device {
        "cpu" => tch::Device::Cpu,
        "cuda" if tch::Cuda::is_available() => tch::Device::Cuda(0),
        other => return Err(PyValueError::new_err(format!("device must be cpu or cuda (with CUDA available), got '{other}'"))),
    };
    py.allow_threads(move || {
        guarded(|| {
            let sync = || {
                if let tch::Device::Cuda(i) = device {
                    tch::Cuda::synchronize(i as i64);
                }
            };
            tch::manual_seed(seed);
            let options = (tch::Kind::Float, device);
            let [q, k, v] = [0; 3].map(|_| Tensor::randn([batch, heads, seq, dim], options));
            let vs = nn::VarStore::new(device);
            let normalizer = variant.build(&vs.root(), heads, dim, &NormalizerConfig::default()).map_err(to_py)?;
            let call = |q: &Tensor, k: &Tensor, v: &Tensor| -> PyResult<Tensor> {
                if baseline {
                    return Ok(Tensor::scaled_dot_product_attention(q, k, v, None::<&Tensor>, 0.0, false, None, false));
                }
                let opts = AttendOptions { need_weights: false, tile: memory_efficient.then_some(256), ..Default::default() };
                Ok(attend(q, k, v, &Masks::default(), normalizer.as_ref(), opts).map_err(to_py)?.output)
            };
            let (mut forward, mut both) = (Vec::with_capacity(repeats), Vec::with_capacity(repeats));
            let grads = [q.detach().set_requires_grad(true), k.detach().set_requires_grad(true), v.detach().set_requires_grad(true)];
            for round in 0..repeats + 2 {
                sync();
                let start = std::time::Instant::now();
                let _ = tch::no_grad(|| call(&q, &k, &v))?;
                sync();
                let f = start.elapsed().as_secs_f64() * 1e3;
                let start = std::time::Instant::now();
                call(&grads[0], &grads[1], &grads[2])?.sum(tch::Kind::Float).backward();
                sync();
                let fb = start.elapsed().as_secs_f64() * 1e3;
                for mut t in grads.iter().map(Tensor::grad) {
                    if t.defined() {
                        let _ = t.zero_();
                    }
                }
                if round >= 2 {
                    forward.push(f);
                    both.push(fb);
                }
            }
            Ok((forward, both))
        })
    })
}
