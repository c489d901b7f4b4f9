//! DNAS, doubly-normalized attention (Ding et al. 2020, "Attention that does not Explain Away").
//!
//! Each key is first normalized over the queries, `ξ_ij = exp(z_ij) / Σ_i' exp(z_i'j)`, then each
//! query over the keys, `π_ij = ξ_ij / Σ_j' ξ_ij'`; in the stable log form used here,
//! `π_ij = softmax_j(z_ij − logsumexp_i' z_i'j)`. Both sums run over allowed entries only.
//! Every key with an allowed query receives `Σ_i π_ij ≥ 1/S_k` (the paper's Theorem 2): no key
//! is explained away.

use tch::Tensor;

use super::{NormalizeInput, Normalized, Normalizer, Support};
use crate::Result;

/// Doubly-normalized attention (one column sweep, then one row sweep).
#[derive(Debug, Clone, Copy, Default)]
pub struct Dnas;

/// `log ξ`: filled log-scores normalized per key over the queries, `(B, H, S_q, S_k)`, filled.
fn per_key(z_filled: &Tensor, support: &Support) -> Tensor {
    support.col_log_softmax(z_filled)
}

/// DNAS weights of filled log-scores `(B, H, S_q, S_k)`, zero on excluded entries.
pub(super) fn dnas_weights(z_filled: &Tensor, support: &Support) -> Tensor {
    support.row_softmax(&per_key(z_filled, support))
}

/// DNAS log-weights of filled log-scores, excluded entries filled.
pub(super) fn dnas_log_weights(z_filled: &Tensor, support: &Support) -> Tensor {
    support.row_log_softmax(&per_key(z_filled, support))
}

impl Normalizer for Dnas {
    fn name(&self) -> String {
        "dnas".into()
    }

    fn normalize(&self, input: &NormalizeInput) -> Result<Normalized> {
        let s = input.support;
        Ok(Normalized { weights: dnas_weights(&s.fill(input.scores), s), kl: None })
    }

    fn log_weights(&self, input: &NormalizeInput) -> Result<Tensor> {
        let s = input.support;
        Ok(dnas_log_weights(&s.fill(input.scores), s))
    }

    fn causal_safe(&self) -> bool {
        false
    }

    fn tiled(&self) -> Option<crate::plan::Tiled<'_>> {
        Some(crate::plan::Tiled::dnas())
    }
}
