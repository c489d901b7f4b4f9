//! UNAS, the standard attention normalizer: each query's weights are a softmax over the keys,
//! `π_ij = exp(z_ij) / Σ_j' exp(z_ij')` (Bahdanau et al. 2015; Vaswani et al. 2017).

use tch::{Device, Kind, Tensor};

use super::{Normalizer, Support};
use crate::call::{mix, try_scores, AttendOptions, Attended};
use crate::mask::{Masks, ScoreShape};
use crate::precision::widen;
use crate::Result;

/// The fewest keys at which bfloat16 takes libtorch's fused CPU kernel. Below them the kernel is
/// slower than the eager form (computed in float32 from the bfloat16 values) on the CPU, forward
/// and backward: 1.4-3.9× at 16-96 keys, 1.05-1.3× at 128, while from 192 keys the kernel is
/// faster (`python -m probattn_tools.baselines.sdpa_routes`, results/bench/sdpa-routes/). float32
/// keeps the kernel at every length: there the eager form's gain below 64 keys is a few percent of
/// a step.
pub const BF16_KERNEL_MIN_KEYS: i64 = 160;

/// Softmax over the keys (UNAS).
#[derive(Debug, Clone, Copy, Default)]
pub struct Softmax;

impl Normalizer for Softmax {
    fn name(&self) -> String {
        "softmax".into()
    }

    /// Without weights, no active dropout, on the CPU in float32 or float64, and in bfloat16 from
    /// [`BF16_KERNEL_MIN_KEYS`] keys: libtorch's fused `scaled_dot_product_attention` (a blocked
    /// kernel that never forms the `(B, H, S_q, S_k)` weights). Its semantics are ours: a boolean
    /// mask of the allowed entries, and a query with no allowed key gets a zero output and zero
    /// gradients (checked for libtorch 2.11 on the CPU). In bfloat16 below those keys, under the
    /// same conditions, the eager arithmetic in float32 as one autograd function that keeps the
    /// bfloat16 inputs for its backward pass (`pa_widened_softmax` in probattn-sys).
    ///
    /// On CUDA, in any floating dtype, SDPA's kernels (FlashAttention's, the memory-efficient one,
    /// or the math fallback, as libtorch picks) serve the calls in which no query can be left
    /// without a key: no mask, or the causal mask alone (top-left aligned, query `i` keeps key 0),
    /// and at least one key. A mask that can empty a row keeps the eager form there: for such a
    /// row SDPA's math and memory-efficient CUDA kernels return zeros as we do, but cuDNN's, which
    /// libtorch may pick in bfloat16 and float16, returns a nonzero output and gradient under a
    /// boolean mask (`python -m probattn_tools.baselines.sdpa_empty_rows --device cuda`, libtorch
    /// 2.11 on an H200: results/cuda/2026-11-29/).
    fn kernel(&self, q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, opts: &AttendOptions) -> Result<Option<Attended>> {
        let device = q.device();
        if opts.need_weights || opts.dropout_active() || !(device == Device::Cpu || device.is_cuda()) {
            return Ok(None);
        }
        let (qs, ks) = (q.size(), k.size());
        let shape = ScoreShape { batch: qs[0], heads: qs[1], queries: qs[2], keys: ks[2] };
        let grouped = ks[1] != shape.heads;
        let scale = opts.scale.unwrap_or_else(|| (1.0 / qs[3] as f64).sqrt());
        // A causal mask alone is the kernel's is_causal (top-left aligned, as ours), which skips
        // the blocks above the diagonal instead of reading an (S_q, S_k) mask.
        let causal_only = masks.causal
            && masks.key_padding.is_none()
            && masks.query_padding.is_none()
            && masks.attn_mask.is_none()
            && masks.bias.is_none();
        if device.is_cuda() {
            if !(masks.is_empty() || causal_only) || shape.keys == 0 {
                return Ok(None);
            }
            let given = opts.scale.map(|_| scale);
            let output = Tensor::f_scaled_dot_product_attention(q, k, v, None::<&Tensor>, 0.0, causal_only, given, grouped)?;
            return Ok(Some(Attended { output, weights: None, received_mass: None, kl: None }));
        }
        let output = match q.kind() {
            // bfloat16 below the kernel's lengths takes float32 from the bfloat16 values (as the
            // kernel computes inside), keeping the bfloat16 inputs, not float32 copies as autograd
            // over the eager form would, for the backward pass: under a boolean mask, with equal heads.
            Kind::BFloat16 if shape.keys < BF16_KERNEL_MIN_KEYS => {
                if grouped || masks.bias.is_some() {
                    return Ok(None);
                }
                crate::cxx::widened_softmax(q, k, v, masks.allowed(shape, q.device())?.as_ref(), scale)?
            }
            Kind::Float | Kind::Double | Kind::BFloat16 => {
                // The default scale goes in as None: the kernel's own 1/sqrt(d), bit for bit as before.
                let given = opts.scale.map(|_| scale);
                let mask = if causal_only { None } else { kernel_mask(masks, shape, q)? };
                Tensor::f_scaled_dot_product_attention(q, k, v, mask.as_ref(), 0.0, causal_only, given, grouped)?
            }
            _ => return Ok(None),
        };
        Ok(Some(Attended { output, weights: None, received_mass: None, kl: None }))
    }

    /// The eager form with the mask written into the fresh scores in place
    /// ([`Support::mask_scores_`]) instead of a masked copy: the same weights, one
    /// `(B, H, S_q, S_k)` tensor fewer.
    fn fused(&self, q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, opts: &AttendOptions) -> Result<Option<Attended>> {
        let shape = ScoreShape { batch: q.size()[0], heads: q.size()[1], queries: q.size()[2], keys: k.size()[2] };
        let support = Support::dense(masks.allowed(shape, q.device())?);
        // bfloat16 inputs attend in float32 here, as the kernel computes inside: scores rounded to
        // bfloat16 (a score near 10 to 1/16) would move each weight by up to a few percent, and a
        // bfloat16 `dO·vᵀ` cancels in softmax's backward. Below BF16_KERNEL_MIN_KEYS keys the two
        // products are a small part of a step; a call for the weights pays float32 at any length.
        let mut scores = try_scores(&widen(q), &widen(k), opts.scale)?; // (B, H, S_q, S_k)
        if let Some(bias) = masks.bias_as(shape, scores.kind(), q.device())? {
            scores += bias;
        }
        support.mask_scores_(&mut scores);
        let mut attended = mix(support.row_softmax(&scores), &widen(v), None, opts);
        if attended.output.kind() != v.kind() {
            attended.output = attended.output.to_kind(v.kind());
        }
        Ok(Some(attended))
    }

    fn tiled(&self) -> Option<crate::plan::Tiled<'_>> {
        Some(crate::plan::Tiled::softmax())
    }
}

/// The masks as SDPA's kernel takes them: the boolean allowed entries, or, with an additive mask,
/// that mask in q's dtype (the kernel's float masks must be) with the excluded entries -inf.
fn kernel_mask(masks: &Masks, shape: ScoreShape, q: &Tensor) -> Result<Option<Tensor>> {
    let allowed = masks.allowed(shape, q.device())?;
    Ok(match masks.bias_as(shape, q.kind(), q.device())? {
        Some(bias) => Some(match &allowed {
            Some(a) => bias.masked_fill(&a.logical_not(), f64::NEG_INFINITY),
            None => bias,
        }),
        None => allowed,
    })
}
