//! Memory-efficient attention: the variants computed tile by tile over the queries, forward and
//! backward, without the `(S_q, S_k)` weights (csrc/tiled.cpp, a libtorch autograd function).
//!
//! The eager path ([`crate::attend`]) materialises the weights of every head, and autograd keeps
//! several such tensors for the backward pass: memory grows as S². Here each pass holds one
//! `(tile, S_k)` block of scores at a time and the backward pass recomputes them, so what a step
//! keeps beyond its inputs and output is O(S) per head. The maths (PAPER-NOTES §5, Ding et al.
//! 2020 for DNAS):
//!
//! - softmax: `P = softmax_j(z_ij)`, `z = (q / sqrt(d)) kᵀ`;
//! - DNAS: `P = softmax_j(z_ij − c_j)` with `c_j = logsumexp_i z_ij`, computed in a first pass
//!   over the query tiles; its backward adds the term of `c`: `dZ = dS¹ − Pc ∘ g`,
//!   `g_j = Σ_i dS¹_ij`, `Pc_ij = exp(z_ij − c_j)`, one more pass;
//! - HNAS: `u · O_DNAS + (1 − u) · O_softmax` per head, which is the output of the mixed weights
//!   `u · P_DNAS + (1 − u) · P_softmax` (the output is linear in the weights), so `u`'s gradient
//!   flows through the mix.
//!
//! It returns no weights; it returns instead the mass each key receives (`Σ_i P_ij`), what the
//! explained-away diagnostics read. Masks are the eager path's (`Masks`), with the same results;
//! a causal mask is a `(S_q, S_k)` boolean tensor (one byte per entry, where the eager path keeps
//! several floats per entry). Sinkhorn and BAM are not tiled yet.
//!
//! ```
//! use probattn::tiled::{attend_tiled, Tiled};
//! use probattn::Masks;
//! use tch::{Device, Kind, Tensor};
//!
//! let opts = (Kind::Double, Device::Cpu);
//! let (q, k, v) = (Tensor::randn([2, 4, 100, 16], opts), Tensor::randn([2, 4, 120, 16], opts), Tensor::randn([2, 4, 120, 16], opts));
//! let tiled = attend_tiled(&q, &k, &v, &Masks::default(), Tiled::Dnas, 32)?;
//! let eager = probattn::attend(&q, &k, &v, &Masks::default(), &probattn::normalize::Dnas, Default::default())?;
//! assert!((&tiled.output - &eager.output).abs().max().double_value(&[]) < 1e-12);
//! # Ok::<(), probattn::Error>(())
//! ```

use tch::{Kind, Tensor};

use crate::attention::check_qkv;
use crate::mask::Masks;
use crate::{cxx, Error, Result};

/// The variants with a tiled path.
#[derive(Clone, Copy, Debug)]
pub enum Tiled<'a> {
    Softmax,
    Dnas,
    /// HNAS with its `(H,)` gate logits (`u = sigmoid(logit)`), e.g. `MultiHeadAttention`'s
    /// `hybrid_logit`; differentiable in them.
    Hnas { logit: &'a Tensor },
}

/// What [`attend_tiled`] returns.
#[derive(Debug)]
pub struct TiledAttended {
    /// `(B, H, S_q, d_v)`.
    pub output: Tensor,
    /// `(B, H, S_k)`: the weight each key receives, `Σ_i P_ij` (not differentiable).
    pub received_mass: Tensor,
}

/// Attends `q (B, H, S_q, d)` to `k (B, H, S_k, d)` / `v (B, H, S_k, d_v)` under `masks` with the
/// weights never materialised, `tile` queries at a time; equal to [`crate::attend`] with the same
/// normalizer (to float rounding), gradients included.
pub fn attend_tiled(q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, variant: Tiled, tile: i64) -> Result<TiledAttended> {
    let shape = check_qkv(q, k, v)?;
    if tile < 1 {
        return Err(Error::Config(format!("the tile size must be at least 1, got {tile}")));
    }
    if !matches!(q.kind(), Kind::Float | Kind::Double) {
        return Err(Error::Unsupported(format!("the tiled path runs in float32 and float64, not {:?}", q.kind())));
    }
    if masks.causal && !matches!(variant, Tiled::Softmax) {
        return Err(Error::Unsupported(
            "DNAS and HNAS normalize each key over all queries, so under a causal mask future queries would change the weights of \
             earlier ones (a leak); use softmax for causal attention"
                .into(),
        ));
    }
    let excluded = masks.allowed(shape, q.device())?.map(|a| a.logical_not());
    let run = |dnas| cxx::tiled_attention(q, k, v, excluded.as_ref(), tile, dnas);
    let (output, received_mass) = match variant {
        Tiled::Softmax => run(false)?,
        Tiled::Dnas => run(true)?,
        Tiled::Hnas { logit } => {
            let heads = shape.dims()[1];
            if logit.size() != [heads] {
                return Err(Error::Shape(format!("HNAS logits have shape {:?}, expected ({heads},)", logit.size())));
            }
            let u = logit.to_kind(q.kind()).sigmoid();
            let ((od, md), (os, ms)) = (run(true)?, run(false)?);
            let (u4, u3) = (u.view([1, -1, 1, 1]), u.view([1, -1, 1]).detach());
            (&u4 * od + (1.0 - &u4) * os, &u3 * md + (1.0 - &u3) * ms)
        }
    };
    Ok(TiledAttended { output, received_mass })
}
