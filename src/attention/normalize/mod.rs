//! The normalizer seam: every attention variant turns scores into weights behind [`Normalizer`].
//!
//! Scores `z` have shape `(B, H, S_q, S_k)` (or `(H, E)` over a graph's edges). A normalizer reads
//! them together with a [`Support`] (where attention is allowed, and how to reduce over it) and
//! returns weights `π` of the same shape, zero wherever the support excludes an entry. Everything happens in the log domain
//! (logsumexp), with excluded entries set to a large finite negative and zeroed explicitly at the
//! end, so fully masked rows and columns give zeros and never NaN, in values and in gradients.
//!
//! Stochastic normalizers (BAM) plug into the same trait: they read `sample`, an optional fixed
//! `noise` draw and the keys (for a contextual prior), and return a KL term beside the weights.
//! They perturb the log-weights of a deterministic base normalizer ([`Normalizer::log_weights`]).

mod bam;
mod dnas;
mod hnas;
mod interpret;
mod noise;
mod prior;
pub mod registry;
mod sinkhorn;
mod softmax;
mod support;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

pub use bam::{
    lognormal_kl, lognormal_log_sample, stable_sigmoid, weibull_gamma_kl, weibull_log_sample, Bam, BamConfig, BamKind, KlSchedule,
};
pub use dnas::{dnas_step, Dnas};
pub use hnas::Hnas;
pub use prior::{ContextualPrior, PriorScope};
pub use sinkhorn::Sinkhorn;
pub use softmax::{Softmax, BF16_KERNEL_MIN_KEYS};
pub use support::{EdgeList, Support};

use crate::call::{AttendOptions, Attended};
use crate::mask::Masks;
use crate::{Error, Result};

/// What a normalizer reads.
#[derive(Debug)]
pub struct NormalizeInput<'a> {
    /// `(B, H, S_q, S_k)` attention scores, or `(H, E)` with an edge support.
    pub scores: &'a Tensor,
    /// Where attention is allowed.
    pub support: &'a Support,
    /// `(B, H, S_k, d_k)` key vectors (`(1, H, N, d_k)` with an edge support), for normalizers with
    /// a contextual prior (BAM); under grouped-query attention `(B, H_kv, S_k, d_k)`, `H_kv` a
    /// divisor of the scores' heads.
    pub keys: Option<&'a Tensor>,
    /// `(B, H, S_q, S_k)` a fixed noise draw, used instead of sampling by stochastic normalizers.
    pub noise: Option<&'a Tensor>,
    /// Stochastic normalizers sample only when this is set (training, Monte Carlo prediction);
    /// otherwise they return their mean, the deterministic weights.
    pub sample: bool,
}

/// What a normalizer returns.
#[derive(Debug)]
pub struct Normalized {
    /// `(B, H, S_q, S_k)` weights; zero on excluded entries.
    pub weights: Tensor,
    /// A scalar KL term for the training loss (stochastic normalizers with a prior, when sampling).
    pub kl: Option<Tensor>,
}

/// Turns attention scores into attention weights.
pub trait Normalizer: fmt::Debug + Send {
    /// The variant's name as the CLI spells it (`softmax`, `dnas`, `sinkhorn-3`, ...).
    fn name(&self) -> String;

    /// Normalizes `input.scores` over `input.support`. By default, the eager interpreter of the
    /// deterministic plan ([`Self::tiled`]): a variant defined by its plan needs nothing else.
    /// Normalizers outside the plans (or that sample, as BAM) write their own.
    fn normalize(&self, input: &NormalizeInput) -> Result<Normalized> {
        match self.tiled() {
            Some(plan) => Ok(Normalized { weights: interpret::weights(&plan, input)?, kl: None }),
            None => Err(Error::Unsupported(format!("{} has neither a plan nor a normalize of its own", self.name()))),
        }
    }

    /// The log-weights `log π`, `(B, H, S_q, S_k)`, computed in the log domain so they stay finite
    /// where `π` underflows; excluded entries hold [`mask_value`]. Deterministic plans provide
    /// them (by default, the eager interpreter's); stochastic normalizers (BAM) sample around them.
    fn log_weights(&self, input: &NormalizeInput) -> Result<Tensor> {
        match self.tiled() {
            Some(plan) => interpret::log_weights(&plan, input),
            None => Err(Error::Unsupported(format!("{} has no closed-form log-weights", self.name()))),
        }
    }

    /// Whether the weights of query `i` depend on queries `i' > i` only through masked entries,
    /// so the normalizer may be used under a causal mask. False for every variant that
    /// normalizes a key over the queries (DNAS, HNAS, Sinkhorn): that leaks the future. By
    /// default, the plan's ([`crate::plan::Tiled::causal_safe`]); true without a plan.
    fn causal_safe(&self) -> bool {
        self.tiled().map_or(true, |plan| plan.causal_safe())
    }

    /// Whether it samples in training (and Monte Carlo prediction). By default, whether its plan
    /// samples; a stochastic normalizer without a plan says so itself.
    fn stochastic(&self) -> bool {
        self.tiled().is_some_and(|plan| plan.sampling.is_some())
    }

    /// The current mixing weight `u` of each head, `(H,)`, for normalizers that mix (HNAS). By
    /// default, the sigmoid of the plan's gate logits.
    fn gate(&self) -> Option<Tensor> {
        self.tiled()?.hybrid_logit.map(Tensor::sigmoid)
    }

    /// A whole attention call in one kernel that forms no `(S_q, S_k)` weights, where this
    /// normalizer has one that applies to `q`'s device and dtype and to `opts` (no weights asked
    /// for): the backend choice ([`crate::backend`]) takes it as the `kernel` route. Softmax takes
    /// libtorch's fused attention on the CPU. The result must equal the eager path's (values, KL
    /// and gradients). `None` (the default): no such kernel here.
    fn kernel(&self, q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, opts: &AttendOptions) -> Result<Option<Attended>> {
        let _ = (q, k, v, masks, opts);
        Ok(None)
    }

    /// The normalizer's own eager form of a whole call, scores to output (softmax masks its fresh
    /// scores in place), taken by the eager route before the general one. The result must equal
    /// the general path's (values, weights when asked for, KL and gradients). `None` (the
    /// default): the general path.
    fn fused(&self, q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, opts: &AttendOptions) -> Result<Option<Attended>> {
        let _ = (q, k, v, masks, opts);
        Ok(None)
    }

    /// This normalizer's memory-efficient form, described as data ([`crate::tiled::Tiled`]: score
    /// scale, column/row sweeps, a mix with softmax, noise and KL when sampling), where its
    /// weights have one: [`crate::attend`] takes it when a tile is set and no weights are asked
    /// for. `None` (the default): eager only.
    fn tiled(&self) -> Option<crate::plan::Tiled<'_>> {
        None
    }
}

/// Builds a layer's normalizer from the layer's parameter path, its number of heads and its key
/// features: how the layers with several normalizers (GAT's two layers, one per secondary view in
/// VQA fusion) take a user's own. [`Variant::factory`] makes one for the built-in variants.
pub type NormalizerFactory<'a> = dyn Fn(&nn::Path, i64, i64) -> Result<Box<dyn Normalizer>> + 'a;

/// The finite stand-in for `-inf` on excluded entries: far below any real score, yet finite, so
/// that a row or column with nothing allowed has a finite logsumexp and finite gradients.
pub fn mask_value(kind: Kind) -> f64 {
    match kind {
        Kind::Half => -6.0e4,
        _ => -1.0e30,
    }
}

/// The attention variants of this seam, named as the CLI and configs spell them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Variant {
    /// `softmax` (UNAS): normalize each query over the keys.
    #[default]
    Softmax,
    /// `dnas`: normalize each key over the queries, then each query over the keys.
    Dnas,
    /// `hnas`: `u * DNAS + (1 - u) * softmax` with a learnable `u` per head.
    Hnas,
    /// `sinkhorn-N`: N alternating column/row normalizations (N = 1 is DNAS).
    Sinkhorn(u32),
    /// `bam-nokl`, `bam-lf`, `bam-lc`, `bam-wf`, `bam-wc`: Bayesian attention (Fan et al. 2020).
    Bam(BamKind),
    /// A variant of the [`registry`] without an arm of its own: its file and its registry entry
    /// are all it takes (docs/adding-a-variant.md). `n` is its parameter (`N` of a `name-N`).
    Registered { spec: &'static registry::VariantSpec, n: u32 },
}

impl Variant {
    /// Its entry in the [`registry`].
    pub fn spec(self) -> &'static registry::VariantSpec {
        registry::spec_of(self)
    }

    /// Builds the normalizer for `heads` heads of keys with `key_dim` features. Learnable
    /// parameters (HNAS's gate logits, BAM's contextual prior) live under `p`.
    /// The registry entry's `build` does it.
    pub fn build(self, p: &nn::Path, heads: i64, key_dim: i64, cfg: &NormalizerConfig) -> Result<Box<dyn Normalizer>> {
        (self.spec().build)(p, heads, key_dim, cfg, self.param())
    }

    /// Its parameter: `N` of `sinkhorn-N` (or of a registered `name-N`), else 0.
    pub fn param(self) -> u32 {
        match self {
            Self::Sinkhorn(n) | Self::Registered { n, .. } => n,
            _ => 0,
        }
    }

    /// [`Self::build`] with `cfg` bound, as a [`NormalizerFactory`].
    pub fn factory(self, cfg: &NormalizerConfig) -> impl Fn(&nn::Path, i64, i64) -> Result<Box<dyn Normalizer>> + '_ {
        move |p, heads, key_dim| self.build(p, heads, key_dim, cfg)
    }

    /// Whether the variant samples in training mode (its registry entry's
    /// [`registry::Properties`]; false for an entry whose example cannot be built).
    pub fn is_stochastic(self) -> bool {
        self.spec().properties().is_ok_and(|p| p.stochastic)
    }
}

impl FromStr for Variant {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        registry::lookup(s).map(|(_, v)| v).ok_or_else(|| Error::UnknownVariant { name: s.to_string(), known: registry::known() })
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Softmax => write!(f, "softmax"),
            Self::Dnas => write!(f, "dnas"),
            Self::Hnas => write!(f, "hnas"),
            Self::Sinkhorn(n) => write!(f, "sinkhorn-{n}"),
            Self::Bam(kind) => write!(f, "{}", kind.name()),
            Self::Registered { spec, n } => match spec.name.strip_suffix("-N") {
                Some(prefix) => write!(f, "{prefix}-{n}"),
                None => f.write_str(spec.name),
            },
        }
    }
}

impl TryFrom<String> for Variant {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<Variant> for String {
    fn from(v: Variant) -> String {
        v.to_string()
    }
}

/// Settings of the normalizers that have any.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NormalizerConfig {
    /// HNAS: the initial mixing weight `u` of every head, in (0, 1). 0.5 as the DNAS paper's
    /// VQA model (Ding et al. 2020, Sec. 5); they used 0.1 for headline generation.
    pub hybrid_init_u: f64,
    /// BAM: distribution, prior and base-normalizer settings.
    pub bam: BamConfig,
}

impl Default for NormalizerConfig {
    fn default() -> Self {
        Self { hybrid_init_u: 0.5, bam: BamConfig::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_names_round_trip() {
        for name in ["softmax", "dnas", "hnas", "sinkhorn-1", "sinkhorn-20", "bam-nokl", "bam-lf", "bam-lc", "bam-wf", "bam-wc"] {
            assert_eq!(name.parse::<Variant>().unwrap().to_string(), name);
        }
        assert_eq!("unas".parse::<Variant>().unwrap(), Variant::Softmax);
    }

    #[test]
    fn unknown_variants_name_the_known_ones() {
        for bad in ["sinkhorn", "sinkhorn-0", "sinkhorn-x", "soft", "DNAS", "", "bam", "bam-wx"] {
            let err = bad.parse::<Variant>().unwrap_err().to_string();
            assert!(err.contains(&format!("'{bad}'")) && err.contains("sinkhorn-N"), "{err}");
        }
    }
}
