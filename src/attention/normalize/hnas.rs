//! HNAS, hybrid normalized attention (Ding et al. 2020, Sec. 4):
//! `π = u · π_DNAS + (1 − u) · π_UNAS`, with one learnable `u = sigmoid(logit)` per head.
//! The paper leaves the parameterization of `u ∈ [0, 1]` open; the sigmoid keeps it in range
//! without clipping. The logits are the parameter `hybrid_logit`, shape `(H,)`.

use tch::{nn, Tensor};

use super::dnas::{dnas_log_weights, dnas_weights};
use super::{NormalizeInput, Normalized, Normalizer};
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

    /// The logits shaped to broadcast against the scores, in their dtype, after checking the
    /// head count.
    fn logit_for(&self, input: &NormalizeInput) -> Result<Tensor> {
        let heads = self.logit.size()[0];
        let scores = input.scores;
        input.support.check_scores(scores)?;
        if input.support.heads(scores) != heads {
            return Err(Error::Shape(format!("HNAS has {heads} head gate(s) but the scores have shape {:?}", scores.size())));
        }
        Ok(input.support.per_head(&self.logit.to_kind(scores.kind())))
    }
}

impl Normalizer for Hnas {
    fn name(&self) -> String {
        "hnas".into()
    }

    fn normalize(&self, input: &NormalizeInput) -> Result<Normalized> {
        let logit = self.logit_for(input)?;
        let s = input.support;
        let z = s.fill(input.scores);
        let u = logit.sigmoid();
        // u·π_DNAS + (1 − u)·π_UNAS as one fused lerp (one pass instead of three).
        let mixed = s.row_softmax(&z).lerp_tensor(&dnas_weights(&z, s), &u);
        Ok(Normalized { weights: mixed, kl: None })
    }

    /// `log(u·π_DNAS + (1−u)·π_UNAS) = logaddexp(log u + log π_DNAS, log(1−u) + log π_UNAS)`.
    fn log_weights(&self, input: &NormalizeInput) -> Result<Tensor> {
        let logit = self.logit_for(input)?;
        let s = input.support;
        let z = s.fill(input.scores);
        let dnas = logit.log_sigmoid() + dnas_log_weights(&z, s);
        let unas = (-&logit).log_sigmoid() + s.row_log_softmax(&z);
        Ok(s.fill(&dnas.logaddexp(&unas)))
    }

    fn causal_safe(&self) -> bool {
        false
    }

    fn gate(&self) -> Option<Tensor> {
        Some(self.logit.sigmoid())
    }

    fn tiled(&self) -> Option<crate::plan::Tiled<'_>> {
        Some(crate::plan::Tiled::hnas(&self.logit))
    }
}
