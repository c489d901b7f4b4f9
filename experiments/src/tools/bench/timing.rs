//! Timing for `probattn bench`: one call, calls in turns with their median and interquartile
//! range, and a libtorch panic caught as an error.

use std::time::Instant;

use anyhow::Result;
use tch::Device;

pub(super) fn sync(device: Device) {
    if let Device::Cuda(d) = device {
        tch::Cuda::synchronize(d as i64);
    }
}

/// Median and interquartile range of timings in ms.
fn median_iqr(mut times: Vec<f64>) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    let q = |p: f64| times[((p * (times.len() - 1) as f64).round() as usize).min(times.len() - 1)];
    (q(0.5), q(0.75) - q(0.25))
}

/// One timed call, in ms.
fn time_once(device: Device, f: &mut impl FnMut() -> Result<()>) -> Result<f64> {
    sync(device);
    let start = Instant::now();
    f()?;
    sync(device);
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// Median and interquartile range of `repeats` timed calls of each of `fs`, after two warm-up
/// rounds. The calls take turns (round-robin), so drift of a shared machine hits every one alike
/// instead of whichever ran during a slow minute.
pub(super) fn time_interleaved(device: Device, repeats: usize, fs: &mut [Box<dyn FnMut() -> Result<()> + '_>]) -> Result<Vec<(f64, f64)>> {
    let mut times = vec![Vec::with_capacity(repeats); fs.len()];
    for round in 0..repeats + 2 {
        for (f, t) in fs.iter_mut().zip(&mut times) {
            let ms = time_once(device, f)?;
            if round >= 2 {
                t.push(ms);
            }
        }
    }
    Ok(times.into_iter().map(median_iqr).collect())
}

/// Runs `f`, turning a panic (tch's operators panic on a libtorch error such as CUDA running out
/// of memory) into an error with the panic's message; the default hook's report is silenced
/// while `f` runs.
pub(super) fn catch_torch_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    out.unwrap_or_else(|payload| {
        Err(anyhow::anyhow!(probattn::panic_message(payload.as_ref()).unwrap_or("a panic without a message").to_string()))
    })
}

/// The first line of a libtorch error, without tch's `Torch("...")` wrapping.
pub(super) fn first_line(e: &anyhow::Error) -> String {
    probattn::libtorch_message(&format!("{e:#}")).to_string()
}
