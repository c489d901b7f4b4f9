//! UNAS, the standard attention normalizer: each query's weights are a softmax over the keys,
//! `π_ij = exp(z_ij) / Σ_j' exp(z_ij')` (Bahdanau et al. 2015; Vaswani et al. 2017).

use tch::Tensor;

use super::{NormalizeInput, Normalized, Normalizer};
use crate::Result;

/// Softmax over the keys (UNAS).
#[derive(Debug, Clone, Copy, Default)]
pub struct Softmax;

impl Normalizer for Softmax {
    fn name(&self) -> String {
        "softmax".into()
    }

    fn normalize(&self, input: &NormalizeInput) -> Result<Normalized> {
        let s = input.support;
        Ok(Normalized { weights: s.row_softmax(&s.fill(input.scores)), kl: None })
    }

    fn log_weights(&self, input: &NormalizeInput) -> Result<Tensor> {
        let s = input.support;
        Ok(s.row_log_softmax(&s.fill(input.scores)))
    }

    fn tiled(&self) -> Option<crate::tiled::Tiled<'_>> {
        Some(crate::tiled::Tiled::Softmax)
    }
}
