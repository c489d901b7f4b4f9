//! The attention core on heads-first tensors: scores `z = q·kᵀ / sqrt(d)`, a [`Normalizer`] turns
//! them into weights over the allowed entries, and the weights mix the values.
//!
//! Shapes: `q (B, H, S_q, d)`, `k (B, H, S_k, d)`, `v (B, H, S_k, d_v)`; weights
//! `(B, H, S_q, S_k)`; output `(B, H, S_q, d_v)`. [`crate::MultiHeadAttention`] projects and splits
//! heads around this; `probattn attend` calls it directly.

use tch::{Kind, Tensor};

use crate::call::{check_qkv, mix, try_scores};
pub use crate::call::{scaled_dot_product_scores, AttendOptions, Attended, Mode};
use crate::mask::Masks;
use crate::mask::ScoreShape;
use crate::normalize::{NormalizeInput, Normalizer, Support};
use crate::precision::{autocast_kind, widen, with_autocast_off};
use crate::tiled::{attend_tiled_shaped, TiledOptions};
use crate::{Error, Result};

/// Attends `q` to `k`/`v` under `masks` with `normalizer`, after checking every shape.
///
/// One path for every caller (the layers, `probattn attend`): the memory-efficient path when
/// `opts.tile` is set and no weights are asked for, else the normalizer's own fused form where it
/// has one ([`Normalizer::fused`]), else scores, [`Normalizer::normalize`], dropout and the mix.
///
/// ```
/// use probattn::normalize::Dnas;
/// use probattn::{attend, AttendOptions, Masks};
/// use tch::{Device, Kind, Tensor};
///
/// let opts = (Kind::Double, Device::Cpu);
/// let (q, k, v) = (Tensor::randn([2, 4, 5, 8], opts), Tensor::randn([2, 4, 7, 8], opts), Tensor::randn([2, 4, 7, 16], opts));
/// let out = attend(&q, &k, &v, &Masks::default(), &Dnas, AttendOptions::default())?;
/// assert_eq!(out.output.size(), [2, 4, 5, 16]);
/// // Each query's weights sum to one over the keys.
/// let rows = out.weights()?.sum_dim_intlist(-1, false, Kind::Double);
/// assert!(rows.allclose(&rows.ones_like(), 1e-12, 1e-12, false));
///
/// // The memory-efficient path: no weights, the same output, the mass each key receives.
/// let tiled = attend(&q, &k, &v, &Masks::default(), &Dnas, AttendOptions { need_weights: false, tile: Some(2), ..Default::default() })?;
/// assert!(tiled.output.allclose(&out.output, 1e-12, 1e-12, false));
/// assert_eq!(tiled.received_mass.map(|m| m.size()), Some(vec![2, 4, 7]));
/// # Ok::<(), probattn::Error>(())
/// ```
///
/// Precision: from bfloat16 and float16 inputs the eager path forms its scores in float32, as
/// libtorch's fused kernels do; the weights and every statistic (log-sum-exps, BAM's noise and
/// KL, the received mass) are float32, and the weights mix the values in the values' dtype, the
/// output's. Under autocast ([`crate::precision`]) attention is a lower-precision operation, as
/// `scaled_dot_product_attention` is under `torch.autocast`: float32 inputs run in the autocast
/// dtype.
///
/// Layout: every tensor returned is contiguous (`output`, `weights`, `received_mass`), whichever
/// path ran; a fused kernel's heads-second output is copied once into the documented layout.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, normalizer: &dyn Normalizer, opts: AttendOptions) -> Result<Attended> {
    let out = attend_any_layout(q, k, v, masks, normalizer, opts)?;
    Ok(Attended {
        output: out.output.contiguous(),
        weights: out.weights.map(|w| w.contiguous()),
        received_mass: out.received_mass.map(|m| m.contiguous()),
        kl: out.kl,
    })
}

/// [`attend`] with the output in whatever layout its path produced (a fused kernel's may be
/// heads-second in memory): for the layers, which merge the heads at once and would otherwise
/// copy twice.
pub(crate) fn attend_any_layout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: AttendOptions,
) -> Result<Attended> {
    match autocast_kind(q.device())? {
        None => attend_as_given(q, k, v, masks, normalizer, opts),
        Some(lower) => {
            let cast = |t: &Tensor| if t.kind() == Kind::Float { t.to_kind(lower) } else { t.shallow_clone() };
            let (q, k, v) = (cast(q), cast(k), cast(v));
            with_autocast_off(q.device(), || attend_as_given(&q, &k, &v, masks, normalizer, opts))
        }
    }
}

/// [`attend`] in the dtypes given, autocast off.
fn attend_as_given(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: AttendOptions,
) -> Result<Attended> {
    let shape = check_qkv(q, k, v)?;
    if masks.causal && !normalizer.causal_safe() {
        return Err(Error::causal_leak(&normalizer.name()));
    }
    if !(0.0..1.0).contains(&opts.dropout) {
        return Err(Error::Config(format!("dropout must lie in [0, 1), got {}", opts.dropout)));
    }
    if let Some(noise) = opts.noise {
        if noise.size() != shape.dims() {
            return Err(Error::Shape(format!("noise has shape {:?}, expected the weights' shape {:?}", noise.size(), shape.dims())));
        }
    }
    if let Some(tile) = opts.tile.filter(|_| !opts.need_weights) {
        return attend_memory_efficient(shape, q, k, v, masks, normalizer, tile, &opts);
    }
    // The eager path holds several (B, H, S_q, S_k) tensors: one that cannot be allocated is an
    // error that says so (and which path needs O(S) memory), not a panic inside tch.
    let [b, h, sq, sk] = shape.dims();
    let what = format!("eager {} attention over ({b}, {h}, {sq}, {sk}) weights", normalizer.name());
    let hint = normalizer.tiled().is_some().then_some(
        "the memory-efficient path holds no (S_q, S_k) tensor (AttendOptions::tile with need_weights false; --memory-efficient on the command line)",
    );
    crate::catch_out_of_memory(&what, hint, || {
        if let Some(attended) = normalizer.fused(q, k, v, masks, &opts)? {
            return Ok(attended);
        }
        let support = Support::dense(masks.allowed(shape, q.device())?);
        // (B, H, S_q, S_k) in float32, formed from bfloat16 or float16 inputs in float32 as the
        // CPU's tiles and libtorch's fused kernels form them: scores rounded to bfloat16 would be off by
        // up to 2⁻⁹ of their size (0.03 at 16), and every weight by as much, relatively.
        let keys = widen(k);
        let scores = try_scores(&widen(q), &keys).map_err(|e| Error::from_torch(e, &what, hint))?;
        let normalized = normalizer.normalize(&NormalizeInput {
            scores: &scores,
            support: &support,
            keys: Some(&keys),
            noise: opts.noise,
            sample: opts.mode.sample,
        })?;
        Ok(mix(normalized.weights, v, normalized.kl, &opts))
    })
}

/// The normalizer's tiled form ([`crate::tiled`]); what it cannot do is refused by name rather
/// than run eagerly, where a long input would not fit.
#[allow(clippy::too_many_arguments)]
fn attend_memory_efficient(
    shape: ScoreShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    tile: i64,
    opts: &AttendOptions,
) -> Result<Attended> {
    let name = normalizer.name();
    let tiled =
        normalizer.tiled().ok_or_else(|| Error::Unsupported(format!("{name} has no memory-efficient path: drop the tile setting")))?;
    if opts.dropout_active() {
        return Err(Error::Unsupported(format!(
            "the memory-efficient path has no attention dropout (the weights are never formed): set the attention dropout to 0, got {}",
            opts.dropout
        )));
    }
    let out = attend_tiled_shaped(
        shape,
        q,
        k,
        v,
        masks,
        &tiled,
        TiledOptions { sample: opts.mode.sample, noise: opts.noise, seed: opts.seed, ..TiledOptions::new(tile) },
    )?;
    Ok(Attended { output: out.output, weights: None, received_mass: Some(out.received_mass), kl: out.kl })
}
