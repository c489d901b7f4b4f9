//! DNAS, doubly-normalized attention (Ding et al. 2020, "Attention that does not Explain Away").
//!
//! Each key is first normalized over the queries, `ξ_ij = exp(z_ij) / Σ_i' exp(z_i'j)`, then each
//! query over the keys, `π_ij = ξ_ij / Σ_j' ξ_ij'`; in the stable log form used here,
//! `π_ij = softmax_j(z_ij − logsumexp_i' z_i'j)`. Both sums run over allowed entries only.
//! Every key with an allowed query receives `Σ_i π_ij ≥ 1/S_k` (the paper's Theorem 2): no key
//! is explained away.
//!
//! [`dnas_step`] is DNAS for a decoder that attends with one state a step, where the later queries
//! do not exist yet: each key normalized over the queries so far.

use tch::Tensor;

use super::{mask_value, Normalizer};
use crate::precision::widen;

/// Doubly-normalized attention (one column sweep, then one row sweep).
#[derive(Debug, Clone, Copy, Default)]
pub struct Dnas;

impl Normalizer for Dnas {
    fn name(&self) -> String {
        "dnas".into()
    }

    fn tiled(&self) -> Option<crate::plan::Tiled<'_>> {
        Some(crate::plan::Tiled::dnas())
    }
}

/// One step of causal DNAS, for a decoder that attends with one query a step (the attentional
/// LSTM): each key is normalized over the queries up to and including this step's, then the query
/// over the keys,
///
/// `π_tj = softmax_j(z_tj − L_tj)`, with `L_tj = logsumexp_{i ≤ t} z_ij = logaddexp(L_{t−1,j}, z_tj)`,
///
/// both over allowed keys only. It reads no later query, so it may run where DNAS proper would
/// read the target sentence's future; at the first step `z − L = 0` and the weights are uniform.
/// A key that earlier steps attended strongly carries a large `L` and weighs less now unless this
/// step's query favours it as much (a coverage of the source, in a decoder's terms).
///
/// `scores (…, S_k)`: this step's scores; `allowed`: a boolean mask broadcastable to them
/// (`None`: every key); `carry`: the `L` that the previous step returned (`None` at the first
/// step). Returns the weights, zero on excluded keys, and this step's `L` for the next, both in
/// the scores' statistics dtype (float32 for bfloat16 scores). Excluded entries enter `L` as
/// [`mask_value`], which keeps a column with no allowed entry finite and out of every sum that
/// matters.
pub fn dnas_step(scores: &Tensor, allowed: Option<&Tensor>, carry: Option<&Tensor>) -> (Tensor, Tensor) {
    let z = widen(scores);
    let fill = mask_value(z.kind());
    let excluded = allowed.map(|a| a.logical_not());
    let z = match &excluded {
        Some(x) => z.masked_fill(x, fill),
        None => z,
    };
    let lse = match carry {
        Some(l) => l.logaddexp(&z),
        None => z.shallow_clone(),
    };
    let logits = &z - &lse;
    let weights = match &excluded {
        Some(x) => logits.masked_fill(x, fill).softmax(-1, z.kind()).masked_fill(x, 0.0),
        None => logits.softmax(-1, z.kind()),
    };
    (weights, lse)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    /// The steps, stacked, equal the formula over the whole score matrix: a cumulative logsumexp
    /// down each key's column, then a row softmax; values and gradients, in float64.
    #[test]
    fn steps_equal_the_column_prefix_formula() {
        tch::manual_seed(3);
        let (b, t, s) = (2, 5, 4);
        let z = (Tensor::randn([b, t, s], (Kind::Double, tch::Device::Cpu)) * 3.0).set_requires_grad(true);
        let allowed = Tensor::from_slice(&[true, true, true, false, true, true, true, true]).view([b, 1, s]);
        let r = Tensor::randn([b, t, s], (Kind::Double, tch::Device::Cpu));

        let mut carry = None;
        let mut steps = vec![];
        for i in 0..t {
            let (w, l) = dnas_step(&z.select(1, i), Some(&allowed.select(1, 0)), carry.as_ref());
            steps.push(w);
            carry = Some(l);
        }
        let ours = Tensor::stack(&steps, 1);
        let g_ours = Tensor::run_backward(&[(&ours * &r).sum(Kind::Double)], &[&z], false, false);

        // The same weights written from the formula with libtorch's logcumsumexp, -inf masking.
        let zm = z.masked_fill(&allowed.logical_not(), f64::NEG_INFINITY);
        let prefix = zm.logcumsumexp(1);
        let logits = (&zm - &prefix).masked_fill(&allowed.logical_not(), f64::NEG_INFINITY);
        let formula = logits.softmax(-1, Kind::Double);
        let g_formula = Tensor::run_backward(&[(&formula * &r).sum(Kind::Double)], &[&z], false, false);

        let err = f64::try_from((&ours - &formula).abs().max()).unwrap();
        assert!(err < 1e-12, "weights differ by {err}");
        let gerr = f64::try_from((&g_ours[0] - g_formula[0].nan_to_num(0.0, None, None)).abs().max()).unwrap();
        assert!(gerr < 1e-12, "gradients differ by {gerr}");
        // The first step is uniform over the allowed keys; excluded keys get nothing.
        let first = ours.select(1, 0);
        assert!(f64::try_from((first.select(0, 0).narrow(0, 0, 3) - 1.0 / 3.0).abs().max()).unwrap() < 1e-15);
        assert_eq!(f64::try_from(ours.select(2, 3).select(0, 0).abs().max()).unwrap(), 0.0);
        // Each row sums to one.
        assert!(f64::try_from((ours.sum_dim_intlist(&[-1i64][..], false, Kind::Double) - 1.0).abs().max()).unwrap() < 1e-12);
    }
}
