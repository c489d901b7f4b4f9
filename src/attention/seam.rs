//! The attention core on heads-first tensors: scores `z = q·kᵀ / sqrt(d)`, a [`Normalizer`] turns
//! them into weights over the allowed entries, and the weights mix the values.
//!
//! Shapes: `q (B, H, S_q, d)`, `k (B, H, S_k, d)`, `v (B, H, S_k, d_v)`; weights
//! `(B, H, S_q, S_k)`; output `(B, H, S_q, d_v)`. [`crate::MultiHeadAttention`] projects and splits
//! heads around this; `probattn attend` calls it directly.

use tch::{Kind, Tensor};

use crate::backend::{self, Backend, Choice, Route, DEFAULT_TILE};
use crate::call::{check_qkv, check_scale, mix, try_scores};
pub use crate::call::{scaled_dot_product_scores, AttendOptions, Attended, Mode};
use crate::cxx::TiledSpec;
use crate::fused_cuda;
use crate::mask::Masks;
use crate::mask::ScoreShape;
use crate::normalize::{NormalizeInput, Normalizer, Support};
use crate::precision::{autocast_kind, widen, with_autocast_off};
use crate::tiled::{attend_tiled_shaped, TiledOptions, TiledRoute};
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
    attend_with_choice(q, k, v, masks, normalizer, opts).map(|(out, _)| out)
}

/// [`attend`], and the route that served the call with the reason it was taken
/// ([`crate::backend`]).
pub fn attend_with_choice(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: AttendOptions,
) -> Result<(Attended, Choice)> {
    let (out, choice) = attend_any_layout(q, k, v, masks, normalizer, opts)?;
    let out = Attended {
        output: out.output.contiguous(),
        weights: out.weights.map(|w| w.contiguous()),
        received_mass: out.received_mass.map(|m| m.contiguous()),
        kl: out.kl,
    };
    Ok((out, choice))
}

/// [`attend_with_choice`] with the output in whatever layout its route produced (a fused kernel's
/// may be heads-second in memory): for the layers, which merge the heads at once and would
/// otherwise copy twice.
pub(crate) fn attend_any_layout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: AttendOptions,
) -> Result<(Attended, Choice)> {
    match autocast_kind(q.device())? {
        None => dispatch(q, k, v, masks, normalizer, opts),
        Some(lower) => {
            let cast = |t: &Tensor| if t.kind() == Kind::Float { t.to_kind(lower) } else { t.shallow_clone() };
            let (q, k, v) = (cast(q), cast(k), cast(v));
            with_autocast_off(q.device(), || dispatch(&q, &k, &v, masks, normalizer, opts))
        }
    }
}

/// Checks what every route needs, then [`route`]s the call.
fn dispatch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: AttendOptions,
) -> Result<(Attended, Choice)> {
    let shape = check_qkv(q, k, v, opts.enable_gqa)?;
    check_options(shape, masks, normalizer, &opts)?;
    // A pattern that excludes the same keys for every query and head is key padding, which the
    // fused routes serve (a padded batch's mask from transformers is one).
    let padding = masks.per_key_padding(shape, q.device());
    let folded = padding.as_ref().map(|p| Masks { key_padding: Some(p), attn_mask: None, ..*masks });
    route(shape, q, k, v, folded.as_ref().unwrap_or(masks), normalizer, opts)
}

/// The one place that decides how a call runs (the rules: [`crate::backend`]); runs it and
/// counts it.
fn route(
    shape: ScoreShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: AttendOptions,
) -> Result<(Attended, Choice)> {
    let requested = match opts.backend {
        Backend::Auto => backend::default(),
        forced => forced,
    };
    // The name only where a message says it: a call that succeeds allocates nothing for it.
    let name = || normalizer.name();
    let chose = |route: Route, why: String| Choice { requested, route, why };
    let no_weights = || {
        Error::Unsupported(format!(
            "{}: the {requested} attention backend forms no weights, and they were asked for: ask for none, or use the eager backend",
            name()
        ))
    };
    let (out, choice) = match requested {
        Backend::Auto => match opts.tile.filter(|_| !opts.need_weights) {
            // On CUDA a kernel of the normalizer's own (softmax's: SDPA's) comes first, as forced.
            Some(_) if fused_cuda::AUTO_TAKES_IT && fused_cuda_serves(shape, q, v, masks, normalizer, &opts).is_ok() => {
                match normalizer.kernel(q, k, v, masks, &opts)? {
                    Some(out) => (
                        out,
                        chose(
                            Route::Kernel,
                            "a tile is set and no weights are asked for: the normalizer's kernel serves it on CUDA".into(),
                        ),
                    ),
                    None => (
                        fused_cuda_route(shape, q, k, v, masks, normalizer, &opts)?,
                        chose(Route::FusedCuda, "a tile is set and no weights are asked for: the plan's fused CUDA kernels".into()),
                    ),
                }
            }
            Some(tile) => {
                let (out, route) = memory_efficient(shape, q, k, v, masks, normalizer, tile, TiledSpec::FUSED_WHERE_APPLIES, &opts)?;
                (out, chose(route, "a tile is set and no weights are asked for: the memory-efficient plan".into()))
            }
            None => match normalizer.kernel(q, k, v, masks, &opts)? {
                Some(out) => {
                    (out, chose(Route::Kernel, "the normalizer's kernel serves this device, dtype and call without weights".into()))
                }
                None => {
                    let why = if opts.need_weights { "the weights are asked for" } else { "no kernel or tile serves this call" };
                    (eager(shape, q, k, v, masks, normalizer, &opts)?, chose(Route::Eager, why.into()))
                }
            },
        },
        Backend::Eager => (eager(shape, q, k, v, masks, normalizer, &opts)?, chose(Route::Eager, "forced".into())),
        Backend::Tiles if opts.need_weights => return Err(no_weights()),
        Backend::Tiles => {
            let tile = opts.tile.unwrap_or(DEFAULT_TILE);
            let (out, route) = memory_efficient(shape, q, k, v, masks, normalizer, tile, TiledSpec::FUSED_NEVER, &opts)?;
            (out, chose(route, format!("forced, {tile} queries a tile")))
        }
        Backend::Fused if opts.need_weights => return Err(no_weights()),
        Backend::Fused => match normalizer.kernel(q, k, v, masks, &opts)? {
            Some(out) => (out, chose(Route::Kernel, format!("forced: {}'s kernel", name()))),
            None if q.device() != tch::Device::Cpu => match fused_cuda_serves(shape, q, v, masks, normalizer, &opts) {
                Ok(()) => (
                    fused_cuda_route(shape, q, k, v, masks, normalizer, &opts)?,
                    chose(Route::FusedCuda, "forced: the plan's fused CUDA kernels".into()),
                ),
                Err(why) => {
                    let name = name();
                    return Err(Error::Unsupported(format!(
                        "{name}: no fused route serves {:?} on {:?}: {name} has no kernel there, and the fused CUDA kernels do not serve it: {why}",
                        q.kind(),
                        q.device()
                    )));
                }
            },
            None => {
                let tile = opts.tile.unwrap_or(DEFAULT_TILE);
                let (out, route) = memory_efficient(shape, q, k, v, masks, normalizer, tile, TiledSpec::FUSED_REQUIRED, &opts)?;
                (out, chose(route, "forced: the fused CPU kernel under the plan".into()))
            }
        },
    };
    backend::record(choice.route);
    Ok((out, choice))
}

/// The call's options checked against its shape and variant, whatever the route: the scale, a
/// causal mask only for a causal-safe variant, the dropout rate, the shape of given draws.
fn check_options(shape: ScoreShape, masks: &Masks, normalizer: &dyn Normalizer, opts: &AttendOptions) -> Result<()> {
    check_scale(opts.scale)?;
    if masks.causal && !normalizer.causal_safe() {
        return Err(Error::causal_leak(&normalizer.name()));
    }
    if !(0.0..1.0).contains(&opts.dropout) {
        return Err(Error::Config(format!("dropout must lie in [0, 1), got {}", opts.dropout)));
    }
    match opts.noise {
        Some(noise) if noise.size() != shape.dims() => {
            Err(Error::Shape(format!("noise has shape {:?}, expected the weights' shape {:?}", noise.size(), shape.dims())))
        }
        _ => Ok(()),
    }
}

/// Whether the fused CUDA route serves this call, or why not.
fn fused_cuda_serves(
    shape: ScoreShape,
    q: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: &AttendOptions,
) -> std::result::Result<(), String> {
    let plan = normalizer.tiled().ok_or_else(|| format!("{} has no plan", normalizer.name()))?;
    fused_cuda::unserved(shape, q, v, masks, &plan, opts).map_or(Ok(()), Err)
}

/// The fused CUDA route, for a call [`fused_cuda_serves`] accepted.
fn fused_cuda_route(
    shape: ScoreShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: &AttendOptions,
) -> Result<Attended> {
    let plan = normalizer.tiled().ok_or_else(|| Error::Unsupported(format!("{} has no plan", normalizer.name())))?;
    let fused = fused_cuda::attend(shape, q, k, v, masks, &plan, opts)?;
    Ok(Attended { output: fused.output, weights: None, received_mass: fused.received_mass, kl: fused.kl })
}

/// The eager route: the normalizer's own eager form where it has one ([`Normalizer::fused`]),
/// else scores, [`Normalizer::normalize`], dropout and the mix.
#[allow(clippy::too_many_arguments)]
fn eager(
    shape: ScoreShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    opts: &AttendOptions,
) -> Result<Attended> {
    // The eager path holds several (B, H, S_q, S_k) tensors: one that cannot be allocated is an
    // error that says so (and which path needs O(S) memory), not a panic inside tch.
    let [b, h, sq, sk] = shape.dims();
    let what = format!("eager {} attention over ({b}, {h}, {sq}, {sk}) weights", normalizer.name());
    let hint = normalizer.tiled().is_some().then_some(
        "the memory-efficient path holds no (S_q, S_k) tensor (AttendOptions::tile with need_weights false; --memory-efficient on the command line)",
    );
    crate::catch_out_of_memory(&what, hint, || {
        if let Some(attended) = normalizer.fused(q, k, v, masks, opts)? {
            return Ok(attended);
        }
        let support = Support::dense(masks.allowed(shape, q.device())?);
        // (B, H, S_q, S_k) in float32, formed from bfloat16 or float16 inputs in float32 as the
        // CPU's tiles and libtorch's fused kernels form them: scores rounded to bfloat16 would be off by
        // up to 2⁻⁹ of their size (0.03 at 16), and every weight by as much, relatively.
        let keys = widen(k);
        let mut scores = try_scores(&widen(q), &keys, opts.scale).map_err(|e| Error::from_torch(e, &what, hint))?;
        if let Some(bias) = masks.bias_as(shape, scores.kind(), q.device())? {
            scores += bias;
        }
        let normalized = normalizer.normalize(&NormalizeInput {
            scores: &scores,
            support: &support,
            keys: Some(&keys),
            noise: opts.noise,
            sample: opts.mode.sample,
        })?;
        Ok(mix(normalized.weights, v, normalized.kl, opts))
    })
}

/// The normalizer's plan ([`crate::tiled`]), through the fused CPU kernel as `fused` allows; what
/// it cannot do is refused by name rather than run eagerly, where a long input would not fit.
#[allow(clippy::too_many_arguments)]
fn memory_efficient(
    shape: ScoreShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    normalizer: &dyn Normalizer,
    tile: i64,
    fused: i32,
    opts: &AttendOptions,
) -> Result<(Attended, Route)> {
    let name = normalizer.name();
    let tiled = normalizer.tiled().ok_or_else(|| {
        Error::Unsupported(format!("{name} has no memory-efficient path: drop the tile setting, or use the eager attention backend"))
    })?;
    if opts.dropout_active() {
        return Err(Error::Unsupported(format!(
            "the memory-efficient path has no attention dropout (the weights are never formed): set the attention dropout to 0, got {}",
            opts.dropout
        )));
    }
    let (out, route) = attend_tiled_shaped(
        shape,
        q,
        k,
        v,
        masks,
        &tiled,
        TiledOptions {
            sample: opts.mode.sample,
            noise: opts.noise,
            seed: opts.seed,
            scale: opts.scale,
            enable_gqa: opts.enable_gqa,
            ..TiledOptions::new(tile)
        },
        fused,
    )
    .map_err(|e| match e {
        Error::Unsupported(why) if fused == TiledSpec::FUSED_REQUIRED => Error::Unsupported(format!("{name}: {why}")),
        e => e,
    })?;
    let route = if route == TiledRoute::Tiles { Route::Tiles } else { Route::FusedCpu };
    Ok((Attended { output: out.output, weights: None, received_mass: Some(out.received_mass), kl: out.kl }, route))
}
