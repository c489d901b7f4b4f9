//! Memory-efficient attention: the variants computed tile by tile over the queries, forward and
//! backward, without the `(S_q, S_k)` weights (probattn-sys/csrc/tiled.cpp, a libtorch autograd function).
//!
//! The eager path ([`crate::attend`]) materialises the weights of every head, and autograd keeps
//! several such tensors for the backward pass: memory grows as S². Here each pass works on one
//! tile's `(tile, S_k)` scores at a time (about three such blocks alive at once, counting what
//! it derives from them; tests/tiled_memory.rs) and the backward pass recomputes them, so what a
//! step keeps beyond its inputs and output is O(S) per head. The maths (docs/formulas.md §5, Ding et al.
//! 2020 for DNAS):
//!
//! - softmax: `P = softmax_j(z_ij)`, `z = (q / sqrt(d)) kᵀ`;
//! - DNAS: `P = softmax_j(z_ij − c_j)` with `c_j = logsumexp_i z_ij`, computed in a first pass
//!   over the query tiles; its backward adds the term of `c`: `dZ = dS¹ − Pc ∘ g`,
//!   `g_j = Σ_i dS¹_ij`, `Pc_ij = exp(z_ij − c_j)`, one more pass;
//! - Sinkhorn-N: N column/row sweeps telescope into one per-key and one per-query statistic,
//!   `log w_ij = z_ij − C_j − R_i`, each sweep one more pass (forward and backward); DNAS is N = 1;
//! - HNAS: `u · O_DNAS + (1 − u) · O_softmax` per head, which is the output of the mixed weights
//!   `u · P_DNAS + (1 − u) · P_softmax` (the output is linear in the weights), so `u`'s gradient
//!   flows through the mix;
//! - BAM (Fan et al. 2020) over a softmax, DNAS, Sinkhorn or HNAS base: the sampled weights are
//!   `softmax_j(log π_ij + n_ij)`, the base's logits plus a noise term, `(1/k) log(−log(1 − ε))`
//!   (Weibull) or `σ ε` (Lognormal). The draws `ε` come from a counter-based generator keyed by
//!   `(seed, b, h, i, j)` and are regenerated tile by tile, so the backward pass sees the forward
//!   pass's draws ([`counter_noise`] gives the same draws for a whole score tensor, for checks);
//!   a given `ε` is honoured instead. The KL term is assembled from per-key and per-row sums, the
//!   only score-dependent part (`Σ α_j log π_ij`, or `Σ (log π_ij − μ_j)²`) accumulated tile by
//!   tile with its gradient. Without sampling, BAM is its base. Over HNAS the base's log-weights
//!   are `log(u π_DNAS + (1 − u) π_softmax)`, formed per tile once one more pass has both
//!   branches' row statistics (csrc/tiled.cpp).
//!
//! The tiles know no variant: they run a plan ([`Tiled`], from [`crate::Normalizer::tiled`]), the
//! data above (a score scale, the sweeps, a mix with softmax, noise and a KL form with per-key
//! prior values), so a normalizer defined outside the crate whose weights are of these forms has
//! a memory-efficient path too.
//!
//! Keys and values may have fewer heads than the queries ([`TiledOptions::enable_gqa`]); an
//! additive mask ([`Masks::bias`]) is added to each tile's scores and receives its gradient from
//! the tiles' `dZ`; a score scale ([`TiledOptions::scale`]) is folded into the queries. Inputs in
//! float32, float64, bfloat16 or float16 (the last two with float32 statistics).
//!
//! It returns no weights; it returns instead the mass each key receives (`Σ_i P_ij`), what the
//! explained-away diagnostics read. Masks are the eager path's (`Masks`), with the same results;
//! a causal mask is a `(S_q, S_k)` boolean tensor (one byte per entry, where the eager path keeps
//! several floats per entry). Not tiled: attention dropout (the weights are never formed).
//!
//! ```
//! use probattn::tiled::{attend_tiled, Tiled, TiledOptions};
//! use probattn::Masks;
//! use tch::{Device, Kind, Tensor};
//!
//! let opts = (Kind::Double, Device::Cpu);
//! let (q, k, v) = (Tensor::randn([2, 4, 100, 16], opts), Tensor::randn([2, 4, 120, 16], opts), Tensor::randn([2, 4, 120, 16], opts));
//! let tiled = attend_tiled(&q, &k, &v, &Masks::default(), &Tiled::dnas(), TiledOptions::new(32))?;
//! let eager = probattn::attend(&q, &k, &v, &Masks::default(), &probattn::normalize::Dnas, Default::default())?;
//! assert!((&tiled.output - &eager.output).abs().max().double_value(&[]) < 1e-12);
//! # Ok::<(), probattn::Error>(())
//! ```

use tch::{Device, Kind, Tensor};

use crate::call::check_qkv;
pub(crate) use crate::cxx::TiledRoute;
use crate::cxx::{self, TiledSpec};
use crate::mask::{Masks, ScoreShape};
use crate::normalize::BamKind;
pub use crate::plan::{Kl, KlForm, NoiseKind, PriorFn, Sampling, Tiled};
use crate::precision::statistics_kind;
use crate::{Error, Result};

/// Euler–Mascheroni constant γ.
const EULER_GAMMA: f64 = 0.577_215_664_901_532_9;

/// How [`attend_tiled`] runs.
#[derive(Clone, Copy, Debug)]
pub struct TiledOptions<'a> {
    /// Queries per tile (>= 1). Memory per pass grows with `tile · S_k`; a tile of 128 to 512
    /// keeps the matrix products efficient.
    pub tile: i64,
    /// Stochastic variants (BAM) sample (training, Monte Carlo prediction); otherwise they return
    /// their mean, the base's weights.
    pub sample: bool,
    /// A fixed draw `ε` broadcastable to `(B, H, S_q, S_k)`, in the eager path's convention
    /// (U(0, 1) for Weibull, N(0, 1) for Lognormal), used instead of the counter-based draws.
    pub noise: Option<&'a Tensor>,
    /// The key of the counter-based draws. `None`: one draw from libtorch's generator, so
    /// `tch::manual_seed` fixes the noise.
    pub seed: Option<u64>,
    /// On the CPU, softmax and DNAS (and so HNAS, and BAM's mean over those bases) without
    /// sampling take libtorch's fused flash-attention kernel where the mask allows it (none, or
    /// key padding only): the same O(S · d) memory without a tile loop, and faster (two kernel
    /// passes forward where DNAS's tiles compute the scores twice in full; probattn-sys/csrc/fused_cpu.cpp has the
    /// algebra). `tile` then does not apply. BAM sampling over a softmax base takes the same
    /// kernel under the same masks, `tile` queries at a time with their noise as the kernel's
    /// mask, and its KL term in closed form. `false` always runs the tiles. Default `true`.
    pub fused_cpu: bool,
    /// The factor of the scores (`None`: `1/sqrt(d)`), as [`crate::AttendOptions::scale`]; it
    /// multiplies the plan's own score scale. It is folded into the queries, as the plan's is: in
    /// bfloat16 and float16 the scaled queries are rounded to their dtype.
    pub scale: Option<f64>,
    /// Keys and values with fewer heads than the queries, as [`crate::AttendOptions::enable_gqa`].
    pub enable_gqa: bool,
}

impl TiledOptions<'_> {
    /// `tile` queries at a time, not sampling, the fused CPU kernel where it applies.
    pub fn new(tile: i64) -> Self {
        Self { tile, sample: false, noise: None, seed: None, fused_cpu: true, scale: None, enable_gqa: false }
    }
}

/// What [`attend_tiled`] returns.
#[derive(Debug)]
pub struct TiledAttended {
    /// `(B, H, S_q, d_v)`.
    pub output: Tensor,
    /// `(B, H, S_k)`: the weight each key receives, `Σ_i P_ij` (not differentiable).
    pub received_mass: Tensor,
    /// BAM's scalar KL term when sampling (variants with a prior), as the eager path's.
    pub kl: Option<Tensor>,
}

/// Attends `q (B, H, S_q, d)` to `k (B, H, S_k, d)` / `v (B, H, S_k, d_v)` under `masks` with the
/// weights never materialised, `opts.tile` queries at a time; equal to [`crate::attend`] with the
/// same normalizer (to float rounding, and for BAM given the same draws), gradients included.
/// The output and the received mass are contiguous, as [`crate::attend`]'s are.
pub fn attend_tiled(q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, plan: &Tiled, opts: TiledOptions) -> Result<TiledAttended> {
    let fused = if opts.fused_cpu { TiledSpec::FUSED_WHERE_APPLIES } else { TiledSpec::FUSED_NEVER };
    crate::call::check_scale(opts.scale)?;
    let (out, _) = attend_tiled_shaped(check_qkv(q, k, v, opts.enable_gqa)?, q, k, v, masks, plan, opts, fused)?;
    Ok(TiledAttended { output: out.output.contiguous(), received_mass: out.received_mass.contiguous(), kl: out.kl })
}

/// [`attend_tiled`] on `q`, `k`, `v` that [`crate::attend`] has validated already (`shape` is
/// what its check returned): one validation per call. `fused` is `TiledSpec::fused_cpu` (never,
/// where it applies, or required: an error where it does not), which `opts.fused_cpu` does not
/// override; the route that ran comes back beside the result.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_tiled_shaped(
    shape: ScoreShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: &Masks,
    plan: &Tiled,
    opts: TiledOptions,
    fused: i32,
) -> Result<(TiledAttended, TiledRoute)> {
    if opts.tile < 1 {
        return Err(Error::Config(format!("the tile size must be at least 1, got {}", opts.tile)));
    }
    // bfloat16 and float16 inputs keep their statistics, the received mass and the KL in float32.
    let stats = statistics_kind(q.kind());
    let allowed = masks.allowed(shape, q.device())?;
    let excluded = allowed.as_ref().map(|a| a.logical_not());
    let bias = masks.bias_as(shape, stats, q.device())?;
    let spec = TiledSpec { tile: opts.tile, sweeps: 0, noise: 0, noise_scale: 0.0, seed: 0, kl: 0, fused_cpu: fused };
    let name = plan.name.as_str();
    if masks.causal && !plan.causal_safe() {
        return Err(Error::causal_leak(name));
    }
    if !(plan.score_scale.is_finite() && plan.score_scale > 0.0) {
        return Err(Error::Config(format!("{name}: the plan's score scale must be positive and finite, got {}", plan.score_scale)));
    }
    // The scales multiply the scores, so the queries (the kernels scale them by 1/sqrt(d)).
    let factor = plan.score_scale * opts.scale.map_or(1.0, |s| s * (q.size()[3] as f64).sqrt());
    let q = &if factor == 1.0 { q.shallow_clone() } else { q * factor };
    let plain = |sweeps: u32| -> Result<(TiledAttended, TiledRoute)> {
        let spec = TiledSpec { sweeps: i64::from(sweeps), ..spec };
        let out = cxx::tiled_attention(q, k, v, excluded.as_ref(), bias.as_ref(), None, None, None, &spec)?;
        Ok((TiledAttended { output: out.output, received_mass: out.received_mass, kl: None }, out.route))
    };
    let sampling = plan.sampling.as_ref().filter(|_| opts.sample);
    check_hybrid_logit(plan, shape)?;
    match (plan.hybrid_logit, sampling) {
        (None, None) => plain(plan.sweeps),
        (Some(logit), None) => {
            let u = logit.to_kind(stats).sigmoid();
            let ((d, route), (s, _)) = (plain(plan.sweeps)?, plain(0)?);
            let (u4, u3) = (u.view([1, -1, 1, 1]), u.view([1, -1, 1]).detach());
            let mixed = TiledAttended {
                output: Tensor::to_kind(&(&u4 * d.output + (1.0 - &u4) * s.output), v.kind()),
                received_mass: &u3 * d.received_mass + (1.0 - &u3) * s.received_mass,
                kl: None,
            };
            Ok((mixed, route))
        }
        (logit, Some(sampling)) => {
            let noise = opts.noise.map(|n| check_noise(n, shape)).transpose()?;
            let (noise_kind, noise_scale) = (sampling.noise.code(), sampling.scale);
            let seed = opts.seed.unwrap_or_else(libtorch_seed);
            let prior = sampling.kl.as_ref().map(|kl| (kl.prior)(k, allowed.as_ref()).map(|a| (kl.form, a))).transpose()?;
            let kl_kind = prior.as_ref().map_or(0, |(form, _)| form.code());
            let spec = TiledSpec { sweeps: i64::from(plan.sweeps), noise: noise_kind, noise_scale, seed, kl: kl_kind, ..spec };
            let a = prior.as_ref().map(|(_, a)| a);
            let out = cxx::tiled_attention(q, k, v, excluded.as_ref(), bias.as_ref(), noise.as_ref(), a, logit, &spec)?;
            let kl = prior
                .as_ref()
                .map(|(form, a)| tiled_kl(*form, &out.kl_part, a, &MaskCounts::new(allowed.as_ref(), shape, opts.tile, stats, q.device())));
            Ok((TiledAttended { output: out.output, received_mass: out.received_mass, kl }, out.route))
        }
    }
}

/// HNAS's gate logits, when the plan mixes, must be one per query head.
pub(crate) fn check_hybrid_logit(plan: &Tiled, shape: ScoreShape) -> Result<()> {
    let heads = shape.dims()[1];
    match plan.hybrid_logit.filter(|l| l.size() != [heads]) {
        Some(logit) => Err(Error::Shape(format!("HNAS logits have shape {:?}, expected ({heads},)", logit.size()))),
        None => Ok(()),
    }
}

/// The KL term (as BAM's eager one: averaged over the allowed entries of each head, then over
/// heads) from the tiles' score-dependent part `part (B, H)`, the prior's per-key values `a`,
/// and the mask's counts.
pub(crate) fn tiled_kl(form: KlForm, part: &Tensor, a: &Tensor, counts: &MaskCounts) -> Tensor {
    let kind = part.kind();
    let per_head = |t: &Tensor| t.sum_dim_intlist(&[0i64][..], false, kind); // (B, H) -> (H,)
    let total = match form {
        KlForm::WeibullGamma { k, beta } => {
            // KL_ij = A(α_j) − α_j log π_ij + β π_ij; Σ_j π_ij = 1 on every row with an allowed key.
            let lgamma_1p_inv = f64::try_from(Tensor::from(1.0 + 1.0 / k).lgamma()).unwrap_or(0.0);
            let big_a = a * (EULER_GAMMA / k + lgamma_1p_inv - beta.ln()) + a.lgamma() + (k.ln() - EULER_GAMMA - 1.0);
            let keys = (big_a * &counts.per_key).sum_dim_intlist(&[0i64, 2, 3][..], false, kind);
            keys - per_head(part) + &counts.rows * beta
        }
        KlForm::Lognormal { sigma, sigma_p } => {
            // KL_ij = (log π_ij − μ_p − σ²/2)² / (2σ_p²) + log(σ_p/σ) + σ²/(2σ_p²) − 1/2.
            let constant = (sigma_p / sigma).ln() + sigma * sigma / (2.0 * sigma_p * sigma_p) - 0.5;
            per_head(part) / (2.0 * sigma_p * sigma_p) + &counts.entries * constant
        }
    };
    (total / counts.entries.clamp_min(1.0)).mean(kind)
}

/// A noise draw checked against the scores' shape.
fn check_noise(noise: &Tensor, shape: ScoreShape) -> Result<Tensor> {
    let dims = shape.dims();
    let size = noise.size();
    let fits = size.len() <= 4 && size.iter().rev().zip(dims.iter().rev()).all(|(&n, &d)| n == d || n == 1);
    if !fits {
        return Err(Error::Shape(format!("the noise has shape {size:?}, not broadcastable to the scores {dims:?}")));
    }
    if !matches!(noise.kind(), Kind::Float | Kind::Double) {
        return Err(Error::Unsupported(format!("the noise must be float32 or float64, not {:?}", noise.kind())));
    }
    Ok(noise.shallow_clone())
}

/// One draw from libtorch's generator, the key of the counter-based noise.
pub(crate) fn libtorch_seed() -> u64 {
    Tensor::randint(i64::MAX, [1], (Kind::Int64, Device::Cpu)).int64_value(&[0]) as u64
}

/// The tiled path's counter-based draws for a whole `(B, H, S_q, S_k)` score tensor, keyed by
/// `seed`: `ε ~ U(0, 1)` for the Weibull variants, `N(0, 1)` for the Lognormal ones, in the eager
/// path's convention, so that `attend` given these draws equals `attend_tiled` given `seed`.
/// 32 random bits per float64 draw (23 per float32 one, so that it stays below 1 in float32): the
/// Exp(1) variates reach 22 (float32: 16.6) and the normal ones 6.3σ (5.3σ). A normal draw is the
/// standard normal's quantile of the uniform one: in float64 `sqrt(2)·erfinv(2u − 1)`, in float32
/// a fixed sequence of float32 operations within 3.3e-7 of it, the same bits on the CPU, on the
/// tiles of any device and in the fused kernels (docs/kernels.md, "The draws, bit for bit").
pub fn counter_noise(kind: BamKind, shape: [i64; 4], seed: u64, options: (Kind, Device)) -> Result<Tensor> {
    let like = Tensor::zeros([1], options);
    let noise = if kind.is_weibull() { TiledSpec::WEIBULL } else { TiledSpec::LOGNORMAL };
    Ok(cxx::counter_noise(&like, shape, noise, seed, 0..shape[2], false)?)
}

/// The rows `rows` of [`counter_noise`], computed by the CPU's loop or (`by_ops`) by ATen's integer
/// ops as on CUDA, whatever the device: the same bits, for the tests.
#[doc(hidden)]
pub fn counter_noise_rows(
    kind: BamKind,
    shape: [i64; 4],
    seed: u64,
    options: (Kind, Device),
    rows: std::ops::Range<i64>,
    by_ops: bool,
) -> Result<Tensor> {
    let like = Tensor::zeros([1], options);
    let noise = if kind.is_weibull() { TiledSpec::WEIBULL } else { TiledSpec::LOGNORMAL };
    Ok(cxx::counter_noise(&like, shape, noise, seed, rows, by_ops)?)
}

/// Counts of allowed entries, per key and per head, taken tile by tile so that a broadcast mask is
/// never expanded to `(B, H, S_q, S_k)` floats.
#[derive(Debug)]
pub(crate) struct MaskCounts {
    /// `(B, H, 1, S_k)`: the allowed queries of each key.
    pub per_key: Tensor,
    /// `(H,)`: queries with at least one allowed key, over the batch.
    pub rows: Tensor,
    /// `(H,)`: allowed entries, over the batch.
    pub entries: Tensor,
}

impl MaskCounts {
    pub(crate) fn new(allowed: Option<&Tensor>, shape: ScoreShape, tile: i64, kind: Kind, device: Device) -> Self {
        let [b, h, sq, sk] = shape.dims();
        let Some(allowed) = allowed else {
            return Self {
                per_key: Tensor::full([b, h, 1, sk], sq as f64, (kind, device)),
                rows: Tensor::full([h], (b * sq) as f64, (kind, device)),
                entries: Tensor::full([h], (b * sq * sk) as f64, (kind, device)),
            };
        };
        let full = allowed.expand([b, h, sq, sk], false); // a view
        let mut per_key = Tensor::zeros([b, h, 1, sk], (kind, device));
        let mut rows = Tensor::zeros([h], (kind, device));
        let mut start = 0;
        while start < sq {
            let len = tile.min(sq - start);
            let block = full.narrow(2, start, len);
            per_key += block.sum_dim_intlist(&[2i64][..], true, kind);
            rows += block.any_dim(-1, false).sum_dim_intlist(&[0i64, 2][..], false, kind);
            start += len;
        }
        let entries = per_key.sum_dim_intlist(&[0i64, 2, 3][..], false, kind);
        Self { per_key, rows, entries }
    }
}
