//! What one attention call takes and returns ([`Mode`], [`AttendOptions`], [`Attended`]), the
//! score formula, the value mix and the validation of `q`, `k`, `v`: the leaf module that
//! [`crate::attention`], the normalizers and [`crate::tiled`] all import, so that none of them
//! imports another for its types.

use tch::{Kind, Tensor};

use crate::mask::ScoreShape;
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
#[derive(Debug, Clone, Copy)]
pub struct AttendOptions<'a> {
    /// What is random (default: nothing, the eval path).
    pub mode: Mode,
    /// Dropout probability on the weights, applied when `mode.dropout` is set.
    pub dropout: f64,
    /// A fixed noise draw `(B, H, S_q, S_k)` for stochastic normalizers.
    pub noise: Option<&'a Tensor>,
    /// Return the weights (default true). Without them a normalizer may take a kernel that never
    /// forms them ([`crate::Normalizer::fused`]: softmax takes libtorch's fused attention), and `tile`
    /// takes the memory-efficient path.
    pub need_weights: bool,
    /// Ask the routes that spend a pass of their own on the received mass to form it (default
    /// false): the fused CUDA kernels, one key pass per branch after the forward (for BAM's draws,
    /// of the sampled weights, its noise drawn again). The tiles and the fused CPU kernel form
    /// it as a by-product and return it either way; the eager path returns the weights instead
    /// ([`crate::diagnostics::received_mass`] sums them). It never changes the route.
    pub need_mass: bool,
    /// `Some(t)`: when no weights are asked for, the memory-efficient path ([`crate::tiled`]), `t`
    /// queries at a time, which keeps nothing `(S_q, S_k)` for the backward pass and returns
    /// [`Attended::received_mass`] instead of the weights. A normalizer without a tiled form, or
    /// active attention dropout, is refused by name rather than run eagerly. `None` (default):
    /// the eager path.
    pub tile: Option<i64>,
    /// The key of the memory-efficient path's counter-based draws (BAM sampling without a fixed
    /// `noise`), so that a draw can be reproduced ([`crate::tiled::counter_noise`]). `None`
    /// (default): one draw from libtorch's generator, so `tch::manual_seed` fixes the noise. The
    /// eager path samples from libtorch's generator and ignores it.
    pub seed: Option<u64>,
    /// How the call runs ([`crate::backend`]): `Auto` (default) takes the process default
    /// ([`crate::backend::set_default`]), itself `auto` unless set; a forced backend that cannot
    /// serve the call is an error.
    pub backend: crate::backend::Backend,
    /// The factor of the scores, `z = scale · q·kᵀ` (default `None`: `1/sqrt(d)`), as
    /// `scaled_dot_product_attention`'s `scale`. It must be finite.
    pub scale: Option<f64>,
    /// Grouped-query attention, as `scaled_dot_product_attention`'s `enable_gqa`: `k` and `v` may
    /// have fewer heads than `q`, a divisor of them, query head `h` reading key/value head
    /// `h / (H / H_kv)`. The key/value heads are read by index, never copied. Off (default):
    /// equal heads are required.
    pub enable_gqa: bool,
}

impl Default for AttendOptions<'_> {
    fn default() -> Self {
        Self {
            mode: Mode::EVAL,
            dropout: 0.0,
            noise: None,
            need_weights: true,
            need_mass: false,
            tile: None,
            seed: None,
            backend: Default::default(),
            scale: None,
            enable_gqa: false,
        }
    }
}

impl AttendOptions<'_> {
    /// Whether dropout applies to the weights in this call.
    pub fn dropout_active(&self) -> bool {
        self.mode.dropout && self.dropout > 0.0
    }
}

/// What [`crate::attend`] returns.
#[derive(Debug)]
pub struct Attended {
    /// `(B, H, S_q, d_v)`.
    pub output: Tensor,
    /// `(B, H, S_q, S_k)`, before dropout: the distribution the normalizer produced. `None` when
    /// [`AttendOptions::need_weights`] is off.
    pub weights: Option<Tensor>,
    /// `(B, H, S_k)`, the weight each key receives (`Σ_i π_ij`, not differentiable), from the
    /// memory-efficient path, which forms no weights; `None` elsewhere (the weights have it:
    /// [`crate::diagnostics::received_mass`]).
    pub received_mass: Option<Tensor>,
    /// The normalizer's KL term, if it has one.
    pub kl: Option<Tensor>,
}

impl Attended {
    /// The weights, or an error saying they were not asked for.
    pub fn weights(&self) -> Result<&Tensor> {
        self.weights.as_ref().ok_or_else(|| Error::Config("the attention weights were not asked for (need_weights is off)".into()))
    }

    /// [`Self::weights`], by value.
    pub fn into_weights(self) -> Result<Tensor> {
        self.weights.ok_or_else(|| Error::Config("the attention weights were not asked for (need_weights is off)".into()))
    }
}

/// Scaled dot-product scores `q·kᵀ / sqrt(d)`, `(B, H, S_q, S_k)`. The queries are scaled before
/// the product, and by `sqrt(1 / d)`, exactly as `torch.nn.MultiheadAttention` does (so the
/// scores agree with it bit for bit at any `d`): `S_q × d` multiplications instead of a full pass
/// over the `S_q × S_k` scores, forward and backward.
pub fn scaled_dot_product_scores(q: &Tensor, k: &Tensor) -> Tensor {
    match try_scores(q, k, None) {
        Ok(scores) => scores,
        Err(e) => panic!("{e}"), // as tch's own operators do
    }
}

/// The factor of a call's scores: `scale`, else `sqrt(1 / d)` (d = `q`'s last size).
pub(crate) fn score_scale(q: &Tensor, scale: Option<f64>) -> f64 {
    scale.unwrap_or_else(|| (1.0 / *q.size().last().unwrap_or(&1) as f64).sqrt())
}

/// [`scaled_dot_product_scores`] at the factor `scale` (`None`: `sqrt(1 / d)`), `k` with as many
/// heads as `q` or a divisor of them ([`grouped_matmul`]), with libtorch's error (a failed
/// allocation) returned.
pub(crate) fn try_scores(q: &Tensor, k: &Tensor, scale: Option<f64>) -> std::result::Result<Tensor, tch::TchError> {
    grouped_matmul(&(q * score_scale(q, scale)), &k.transpose(-2, -1))
}

/// `a (B, H, t, x)` times `b (B, H_kv, x, y)`, `(B, H, t, y)`, where `H = g · H_kv` and head `h`
/// of `a` meets head `h / g` of `b` (grouped-query attention, as `scaled_dot_product_attention`'s
/// `enable_gqa`): the `g` heads of a group are one product, and `b` is read as it is, never
/// repeated. With `H = H_kv`, `a.matmul(b)`.
pub(crate) fn grouped_matmul(a: &Tensor, b: &Tensor) -> std::result::Result<Tensor, tch::TchError> {
    let (heads, kv_heads) = (a.size()[1], b.size()[1]);
    if heads == kv_heads {
        return a.f_matmul(b);
    }
    let size = a.size();
    let (batch, t, x) = (size[0], size[2], size[3]);
    let product = a.f_reshape([batch, kv_heads, heads / kv_heads * t, x])?.f_matmul(b)?;
    product.f_view([batch, heads, t, *product.size().last().unwrap_or(&1)])
}

/// The weights `(B, H, S_q, S_k)` mix the values `(B, H, S_k, d_v)`, after dropout when it is
/// active; the weights are kept when asked for.
pub(crate) fn mix(weights: Tensor, v: &Tensor, kl: Option<Tensor>, opts: &AttendOptions) -> Attended {
    let mixing = if opts.dropout_active() { weights.dropout(opts.dropout, true) } else { weights.shallow_clone() };
    // Float32 weights of bfloat16 or float16 values mix in the values' dtype.
    let mixing = if mixing.kind() == v.kind() { mixing } else { mixing.to_kind(v.kind()) };
    let output = match grouped_matmul(&mixing, v) {
        Ok(output) => output, // (B, H, S_q, d_v)
        Err(e) => panic!("{e}"),
    };
    Attended { output, weights: opts.need_weights.then_some(weights), received_mass: None, kl }
}

/// Checks the ranks, sizes, dtypes and devices of heads-first `q`, `k`, `v`; with `enable_gqa`,
/// `k` and `v` may have fewer heads than `q`, a divisor of them.
pub(crate) fn check_qkv(q: &Tensor, k: &Tensor, v: &Tensor, enable_gqa: bool) -> Result<ScoreShape> {
    // Each size, dtype and device is read once: this runs at every call, and each read crosses
    // into libtorch.
    let (qs, ks, vs) = (q.size(), k.size(), v.size());
    let kinds = [q.kind(), k.kind(), v.kind()];
    for ((name, size), kind) in [("q", &qs), ("k", &ks), ("v", &vs)].into_iter().zip(kinds) {
        if size.len() != 4 {
            return Err(Error::Shape(format!("{name} has shape {size:?}; expected rank 4 (B, H, S, d)")));
        }
        if !matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) {
            return Err(Error::Shape(format!("{name} has dtype {kind:?}; expected a floating dtype")));
        }
    }
    if qs[0] != ks[0] || qs[0] != vs[0] || ks[1] != vs[1] {
        return Err(Error::Shape(format!("q {qs:?}, k {ks:?} and v {vs:?} must agree on batch (dim 0), and k and v on heads (dim 1)")));
    }
    if qs[1] != ks[1] {
        if !enable_gqa {
            return Err(Error::Shape(format!(
                "q {qs:?} has {} heads and k {ks:?} {}: equal heads are required unless grouped-query attention is enabled (enable_gqa)",
                qs[1], ks[1]
            )));
        }
        if ks[1] == 0 || qs[1] % ks[1] != 0 {
            return Err(Error::Shape(format!(
                "grouped-query attention needs the key/value heads to divide the query heads: q {qs:?} has {}, k {ks:?} {}",
                qs[1], ks[1]
            )));
        }
    }
    if qs[3] != ks[3] {
        return Err(Error::Shape(format!("q {qs:?} and k {ks:?} must have the same head size (dim 3)")));
    }
    if ks[2] != vs[2] {
        return Err(Error::Shape(format!("k {ks:?} and v {vs:?} must have the same number of keys (dim 2)")));
    }
    if kinds[1] != kinds[0] || kinds[2] != kinds[0] {
        return Err(Error::Shape(format!("q, k and v must share one dtype, got {:?}, {:?}, {:?}", kinds[0], kinds[1], kinds[2])));
    }
    let device = q.device();
    if k.device() != device || v.device() != device {
        return Err(Error::Shape("q, k and v must be on one device".into()));
    }
    Ok(ScoreShape { batch: qs[0], heads: qs[1], queries: qs[2], keys: ks[2] })
}

/// Checks `scale` (finite where given; any sign, as `scaled_dot_product_attention` takes it).
pub(crate) fn check_scale(scale: Option<f64>) -> Result<()> {
    match scale {
        Some(s) if !s.is_finite() => Err(Error::Config(format!("the score scale must be finite, got {s}"))),
        _ => Ok(()),
    }
}
