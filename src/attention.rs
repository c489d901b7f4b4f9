//! The attention core on heads-first tensors: scores `z = q·kᵀ / sqrt(d)`, a [`Normalizer`] turns
//! them into weights over the allowed entries, and the weights mix the values.
//!
//! Shapes: `q (B, H, S_q, d)`, `k (B, H, S_k, d)`, `v (B, H, S_k, d_v)`; weights
//! `(B, H, S_q, S_k)`; output `(B, H, S_q, d_v)`. [`crate::MultiHeadAttention`] projects and splits
//! heads around this; `probattn attend` calls it directly.

use tch::{Kind, Tensor};

use crate::mask::{Masks, ScoreShape};
use crate::normalize::{NormalizeInput, Normalizer, Support};
use crate::{Error, Result};

/// What is random in a forward pass. `train` is the usual switch ([`Mode::train`]); Monte Carlo
/// prediction samples the attention without dropout ([`Mode::MONTE_CARLO`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    /// Apply dropout to the weights.
    pub dropout: bool,
    /// Let stochastic normalizers (BAM) sample; otherwise they return their mean.
    pub sample: bool,
}

impl Mode {
    pub const EVAL: Mode = Mode { dropout: false, sample: false };
    pub const TRAIN: Mode = Mode { dropout: true, sample: true };
    /// Stochastic attention without dropout, for Monte Carlo prediction.
    pub const MONTE_CARLO: Mode = Mode { dropout: false, sample: true };

    /// [`Mode::TRAIN`] or [`Mode::EVAL`].
    pub fn train(train: bool) -> Self {
        if train {
            Self::TRAIN
        } else {
            Self::EVAL
        }
    }
}

/// Options of one attention call beside its tensors.
#[derive(Debug, Default, Clone, Copy)]
pub struct AttendOptions<'a> {
    /// What is random (default: nothing, the eval path).
    pub mode: Mode,
    /// Dropout probability on the weights, applied when `mode.dropout` is set.
    pub dropout: f64,
    /// A fixed noise draw `(B, H, S_q, S_k)` for stochastic normalizers.
    pub noise: Option<&'a Tensor>,
}

/// What [`attend`] returns.
#[derive(Debug)]
pub struct Attended {
    /// `(B, H, S_q, d_v)`.
    pub output: Tensor,
    /// `(B, H, S_q, S_k)`, before dropout: the distribution the normalizer produced.
    pub weights: Tensor,
    /// The normalizer's KL term, if it has one.
    pub kl: Option<Tensor>,
}

/// Scaled dot-product scores `q·kᵀ / sqrt(d)`, `(B, H, S_q, S_k)`. The queries are scaled before
/// the product, and by `sqrt(1 / d)`, exactly as `torch.nn.MultiheadAttention` does (so the
/// scores agree with it bit for bit at any `d`): `S_q × d` multiplications instead of a full pass
/// over the `S_q × S_k` scores, forward and backward.
pub fn scaled_dot_product_scores(q: &Tensor, k: &Tensor) -> Tensor {
    let d = *q.size().last().unwrap_or(&1) as f64;
    (q * (1.0 / d).sqrt()).matmul(&k.transpose(-2, -1))
}

/// Attends `q` to `k`/`v` under `masks` with `normalizer`, after checking every shape.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, normalizer: &dyn Normalizer, opts: AttendOptions) -> Result<Attended> {
    let shape = check_qkv(q, k, v)?;
    if masks.causal && !normalizer.causal_safe() {
        return Err(Error::Unsupported(format!(
            "{} normalizes each key over all queries, so under a causal mask future queries would \
             change the weights of earlier ones (a leak); use softmax for causal attention",
            normalizer.name()
        )));
    }
    if !(0.0..1.0).contains(&opts.dropout) {
        return Err(Error::Config(format!("dropout must lie in [0, 1), got {}", opts.dropout)));
    }
    if let Some(noise) = opts.noise {
        if noise.size() != shape.dims() {
            return Err(Error::Shape(format!("noise has shape {:?}, expected the weights' shape {:?}", noise.size(), shape.dims())));
        }
    }
    let support = Support::dense(masks.allowed(shape, q.device())?);
    let scores = scaled_dot_product_scores(q, k); // (B, H, S_q, S_k)
    let normalized = normalizer.normalize(&NormalizeInput {
        scores: &scores,
        support: &support,
        keys: Some(k),
        noise: opts.noise,
        sample: opts.mode.sample,
    })?;
    let mixing = if opts.mode.dropout && opts.dropout > 0.0 {
        normalized.weights.dropout(opts.dropout, true)
    } else {
        normalized.weights.shallow_clone()
    };
    let output = mixing.matmul(v); // (B, H, S_q, d_v)
    Ok(Attended { output, weights: normalized.weights, kl: normalized.kl })
}

/// Checks the ranks, sizes, dtypes and devices of heads-first `q`, `k`, `v`.
pub(crate) fn check_qkv(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<ScoreShape> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.dim() != 4 {
            return Err(Error::Shape(format!("{name} has shape {:?}; expected rank 4 (B, H, S, d)", t.size())));
        }
        if !matches!(t.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) {
            return Err(Error::Shape(format!("{name} has dtype {:?}; expected a floating dtype", t.kind())));
        }
    }
    let (qs, ks, vs) = (q.size(), k.size(), v.size());
    if qs[0] != ks[0] || qs[0] != vs[0] || qs[1] != ks[1] || qs[1] != vs[1] {
        return Err(Error::Shape(format!("q {qs:?}, k {ks:?} and v {vs:?} must agree on batch and heads (dims 0 and 1)")));
    }
    if qs[3] != ks[3] {
        return Err(Error::Shape(format!("q {qs:?} and k {ks:?} must have the same head size (dim 3)")));
    }
    if ks[2] != vs[2] {
        return Err(Error::Shape(format!("k {ks:?} and v {vs:?} must have the same number of keys (dim 2)")));
    }
    if q.kind() != k.kind() || q.kind() != v.kind() {
        return Err(Error::Shape(format!("q, k and v must share one dtype, got {:?}, {:?}, {:?}", q.kind(), k.kind(), v.kind())));
    }
    if q.device() != k.device() || q.device() != v.device() {
        return Err(Error::Shape("q, k and v must be on one device".into()));
    }
    Ok(ScoreShape { batch: qs[0], heads: qs[1], queries: qs[2], keys: ks[2] })
}
