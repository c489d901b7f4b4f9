//! HNAS, hybrid normalized attention (Ding et al. 2020, Sec. 4):
//! `π = u · π_DNAS + (1 − u) · π_UNAS`, with one learnable `u = sigmoid(logit)` per head.
//! The paper leaves the parameterization of `u ∈ [0, 1]` open; the sigmoid keeps it in range
//! without clipping. The logits are the parameter `hybrid_logit`, shape `(H,)`.

use tch::{nn, Tensor};

use super::Normalizer;
use crate::{Error, Result};

/// Per-head mixture of DNAS and softmax weights.
#[derive(Debug)]
pub struct Hnas {
    /// `(H,)` gate logits, `u = sigmoid(logit)`.
    logit: Tensor,
}

impl Hnas {
    /// One gate per head under `p` as `hybrid_logit`, initialised so that `u = init_u` (or the
    /// tensor already there: [`crate::param`]).
    pub fn new(p: &nn::Path, heads: i64, init_u: f64) -> Result<Self> {
        if !(init_u > 0.0 && init_u < 1.0) {
            return Err(Error::Config(format!("the initial HNAS mixing weight must lie strictly between 0 and 1, got {init_u}")));
        }
        if heads < 1 {
            return Err(Error::Config(format!("HNAS needs at least one head, got {heads}")));
        }
        let logit = crate::param::param(p, "hybrid_logit", &[heads], nn::Init::Const((init_u / (1.0 - init_u)).ln()))?;
        Ok(Self { logit })
    }

    /// The gate logits, `(H,)` (a handle to the parameter, for loading or inspection).
    pub fn logit(&self) -> &Tensor {
        &self.logit
    }
}

impl Normalizer for Hnas {
    fn name(&self) -> String {
        "hnas".into()
    }

    fn tiled(&self) -> Option<crate::plan::Tiled<'_>> {
        Some(crate::plan::Tiled::hnas(&self.logit))
    }
}
