//! A normalizer's memory-efficient form, described as data ([`Tiled`]): what [`crate::tiled`]
//! computes tile by tile. A normalizer returns its plan from [`crate::Normalizer::tiled`]; the
//! tiles read nothing else of it, so a variant defined outside this crate has a memory-efficient
//! form whenever its weights are one of the plans' (see `tests/external_variant.rs`).
//!
//! What a plan can say: the scores' scale; how many column/row sweeps of per-key and per-query
//! log-sum-exps the weights take (0: softmax; 1: DNAS; N: Sinkhorn-N), which covers every weight
//! of the form `exp(s·z_ij − C_j − R_i)`; a per-head mix with softmax (HNAS); and, when sampling,
//! a noise term added to those logits with a KL term in one of two closed forms (BAM).

use std::fmt;

use serde::Serialize;
use tch::Tensor;

use crate::Result;

/// How a variant normalizes, as the papers group them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// Each query over its keys (softmax).
    RowWise,
    /// Each key over the queries too (DNAS, Sinkhorn).
    DoublyNormalized,
    /// A learned mix of the two (HNAS).
    Hybrid,
    /// Stochastic weights around a deterministic base (BAM).
    Bayesian,
}

/// The noise a stochastic plan adds to its logits: `scale · log(−log(1 − ε))`, `ε ~ U(0, 1)`
/// (Weibull, scale `1/k`), or `scale · ε`, `ε ~ N(0, 1)` (Lognormal, scale `σ`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoiseKind {
    Weibull,
    Lognormal,
}

impl NoiseKind {
    /// The C++ layer's code for it (`TiledSpec::WEIBULL`, `TiledSpec::LOGNORMAL`).
    pub(crate) fn code(self) -> i32 {
        match self {
            Self::Weibull => crate::cxx::TiledSpec::WEIBULL,
            Self::Lognormal => crate::cxx::TiledSpec::LOGNORMAL,
        }
    }
}

/// The closed form of a stochastic plan's KL term per entry (docs/formulas.md §2, §5).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KlForm {
    /// `KL(Weibull(k, λ_ij) ‖ Gamma(α_j, β))`; the prior's per-key values are `α_j`.
    WeibullGamma { k: f64, beta: f64 },
    /// `KL(LogN(log π_ij − σ²/2, σ) ‖ LogN(μ_p,j, σ_p))`; the per-key values are `μ_p,j + σ²/2`.
    Lognormal { sigma: f64, sigma_p: f64 },
}

impl KlForm {
    /// The C++ layer's code for it (`TiledSpec::KL_WEIBULL`, `TiledSpec::KL_LOGNORMAL`).
    pub(crate) fn code(&self) -> i32 {
        match self {
            Self::WeibullGamma { .. } => crate::cxx::TiledSpec::KL_WEIBULL,
            Self::Lognormal { .. } => crate::cxx::TiledSpec::KL_LOGNORMAL,
        }
    }
}

/// The prior's per-key values from the keys `(B, H, S_k, d_k)`, in the call's dtype, and the
/// allowed entries (boolean, broadcastable to `(B, H, S_q, S_k)`; `None`: all), broadcastable to
/// `(B, H, 1, S_k)`, in the statistics' dtype (float32 for bfloat16 or float16 keys).
pub type PriorFn<'a> = Box<dyn Fn(&Tensor, Option<&Tensor>) -> Result<Tensor> + 'a>;

/// A stochastic plan's KL term.
pub struct Kl<'a> {
    pub form: KlForm,
    pub prior: PriorFn<'a>,
}

/// What a stochastic plan does when sampling.
pub struct Sampling<'a> {
    pub noise: NoiseKind,
    pub scale: f64,
    /// `None`: no KL term (BAM without one).
    pub kl: Option<Kl<'a>>,
}

/// A memory-efficient plan.
pub struct Tiled<'a> {
    /// The variant's name, for errors.
    pub name: String,
    /// Column/row sweeps: 0 is softmax over the keys, 1 is DNAS, N is Sinkhorn-N.
    pub sweeps: u32,
    /// Multiplies the scores `q·kᵀ / sqrt(d)` before anything else (an inverse temperature); 1
    /// for the built-in variants.
    pub score_scale: f64,
    /// HNAS: `u = sigmoid(logit)` per head `(H,)` mixes this plan's weights with softmax's,
    /// `u · P + (1 − u) · P_softmax`; differentiable in the logits.
    pub hybrid_logit: Option<&'a Tensor>,
    /// Stochastic variants: the noise and KL when sampling; without sampling the plan is its
    /// deterministic part.
    pub sampling: Option<Sampling<'a>>,
}

impl<'a> Tiled<'a> {
    /// `sweeps` column/row sweeps named `name`, nothing else.
    pub fn sweeps(name: impl Into<String>, sweeps: u32) -> Self {
        Self { name: name.into(), sweeps, score_scale: 1.0, hybrid_logit: None, sampling: None }
    }

    pub fn softmax() -> Self {
        Self::sweeps("softmax", 0)
    }

    pub fn dnas() -> Self {
        Self::sweeps("dnas", 1)
    }

    /// Sinkhorn-N, `n >= 1` (N = 1 is DNAS).
    pub fn sinkhorn(n: u32) -> Self {
        Self::sweeps(format!("sinkhorn-{n}"), n)
    }

    /// HNAS with its `(H,)` gate logits.
    pub fn hnas(logit: &'a Tensor) -> Self {
        Self { hybrid_logit: Some(logit), ..Self::sweeps("hnas", 1) }
    }

    /// Whether the weights of query `i` ignore later queries, so the plan may run under a causal
    /// mask: only without column sweeps (a column sweep normalizes each key over every query).
    pub fn causal_safe(&self) -> bool {
        self.sweeps == 0
    }

    /// How the plan normalizes, as the papers group the variants.
    pub fn family(&self) -> Family {
        match (self.sampling.is_some(), self.hybrid_logit.is_some(), self.sweeps) {
            (true, _, _) => Family::Bayesian,
            (false, true, _) => Family::Hybrid,
            (false, false, 0) => Family::RowWise,
            (false, false, _) => Family::DoublyNormalized,
        }
    }

    /// Whether sampling adds a KL term to the loss.
    pub fn has_kl(&self) -> bool {
        self.sampling.as_ref().is_some_and(|s| s.kl.is_some())
    }

    /// The memory-efficient route the plan takes, in words (`probattn variants`).
    pub fn describe(&self) -> String {
        let mut route = match self.sweeps {
            0 => "one row pass of online log-sum-exps".to_string(),
            1 => "two passes: column log-sum-exps, then rows".to_string(),
            n => format!("{n} column passes, then rows"),
        };
        if self.hybrid_logit.is_some() {
            route.push_str(", mixed per head with softmax's row pass");
        }
        if let Some(sampling) = &self.sampling {
            let noise = match sampling.noise {
                NoiseKind::Weibull => "Weibull",
                NoiseKind::Lognormal => "Lognormal",
            };
            route.push_str(&format!(", sampled with counter-based {noise} draws"));
            if sampling.kl.is_some() {
                route.push_str("; the KL in closed form per tile");
            }
        }
        if self.sampling.is_none() || self.sweeps == 0 {
            route.push_str("; on the CPU, a fused kernel where the masks and lengths allow");
        }
        route
    }
}

impl fmt::Debug for Tiled<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tiled")
            .field("name", &self.name)
            .field("sweeps", &self.sweeps)
            .field("score_scale", &self.score_scale)
            .field("hybrid", &self.hybrid_logit.is_some())
            .field("sampling", &self.sampling.as_ref().map(|s| (s.noise, s.scale, s.kl.as_ref().map(|k| k.form))))
            .finish()
    }
}
