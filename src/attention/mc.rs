//! Monte Carlo prediction with stochastic attention (Fan et al. 2020, Sec. 3.4): run N forward
//! passes with sampling on (usually [`crate::Mode::MONTE_CARLO`]: attention sampled, no dropout)
//! and summarize them, for the calibration and uncertainty metrics of the experiments.

use tch::Tensor;

use crate::{Error, Result};

/// The summary of N stochastic predictions of shape `(B, ...)`.
#[derive(Debug)]
pub struct McPrediction {
    /// `(B, ...)`: the mean over samples.
    pub mean: Tensor,
    /// `(B, ...)`: the standard deviation over samples (population, `1/N`).
    pub std: Tensor,
    /// `(B,)`: per example, the standard deviation averaged over the other dimensions.
    pub spread: Tensor,
    pub samples: usize,
}

/// Calls `forward(i)` for `i in 0..samples` (each returning `(B, ...)`, probabilities say) and
/// summarizes the results. Run it under `tch::no_grad` when no gradient is wanted.
pub fn monte_carlo(samples: usize, mut forward: impl FnMut(usize) -> Result<Tensor>) -> Result<McPrediction> {
    if samples == 0 {
        return Err(Error::Config("Monte Carlo prediction needs at least one sample".into()));
    }
    let draws = (0..samples).map(&mut forward).collect::<Result<Vec<_>>>()?;
    let first = draws[0].size();
    if let Some(bad) = draws.iter().find(|d| d.size() != first) {
        return Err(Error::Shape(format!("Monte Carlo samples differ in shape: {first:?} and {:?}", bad.size())));
    }
    if first.is_empty() {
        return Err(Error::Shape("Monte Carlo predictions need a batch dimension".into()));
    }
    let stacked = Tensor::stack(&draws, 0); // (N, B, ...)
    let kind = stacked.kind();
    let mean = stacked.mean_dim(&[0i64][..], false, kind);
    let std = stacked.std_dim(&[0i64][..], false, false);
    let spread = if std.dim() > 1 { std.flatten(1, -1).mean_dim(&[1i64][..], false, kind) } else { std.shallow_clone() };
    Ok(McPrediction { mean, std, spread, samples })
}
