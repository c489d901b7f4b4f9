//! Masks: which (query, key) pairs may attend.
//!
//! Every boolean mask follows PyTorch's `nn.MultiheadAttention` convention: `true` (or a non-zero
//! `uint8`) marks an *excluded* entry. An additive float mask ([`Masks::bias`]) is added to the
//! scores before any normalization, its `-inf` entries excluded. The masks combine into one
//! boolean `allowed` tensor broadcastable to the scores' `(B, H, S_q, S_k)`; see
//! [`crate::normalize::Support`] for how normalizers use it.

use tch::{Device, Kind, Tensor};

use crate::{Error, Result};

/// The sizes of a score tensor `(B, H, S_q, S_k)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScoreShape {
    pub batch: i64,
    pub heads: i64,
    pub queries: i64,
    pub keys: i64,
}

impl ScoreShape {
    pub fn dims(&self) -> [i64; 4] {
        [self.batch, self.heads, self.queries, self.keys]
    }
}

/// The masks of one attention call. All optional; in the boolean ones `true` = excluded.
#[derive(Debug, Default, Clone, Copy)]
pub struct Masks<'a> {
    /// `(B, S_k)`: padded keys, excluded for every query.
    pub key_padding: Option<&'a Tensor>,
    /// `(B, S_q)`: padded queries; their rows of weights are all zero.
    pub query_padding: Option<&'a Tensor>,
    /// Broadcastable to `(B, H, S_q, S_k)`: any boolean pattern (a graph's non-edges, say).
    pub attn_mask: Option<&'a Tensor>,
    /// Query `i` may attend key `j` only when `j <= i` (top-left aligned when `S_q != S_k`, as
    /// in PyTorch's `scaled_dot_product_attention(is_causal=True)`).
    pub causal: bool,
    /// A floating-point tensor broadcastable to `(B, H, S_q, S_k)`, added to the scores `z`
    /// before the normalizer sees them (an additive mask, as a float `attn_mask` of
    /// `scaled_dot_product_attention`: ALiBi, relative position biases, padding as `-inf`); its
    /// `-inf` entries are excluded as a boolean mask's are, and it receives gradients. NaN and
    /// `+inf` are refused.
    pub bias: Option<&'a Tensor>,
}

impl Masks<'_> {
    /// True when nothing is masked.
    pub fn is_empty(&self) -> bool {
        self.key_padding.is_none() && self.query_padding.is_none() && self.attn_mask.is_none() && !self.causal && self.bias.is_none()
    }

    /// The additive mask in `kind` on `device`, of rank 4, its `-inf` entries 0: what the paths add
    /// to their scores. Those entries are excluded by [`Self::allowed`] instead, so no infinity
    /// reaches a score (a row of them would make NaN in a softmax's gradient). Its dtype and shape
    /// are checked here; its values (no NaN, no `+inf`) by [`Self::allowed`], which every route
    /// calls first. `None` without one.
    pub(crate) fn bias_as(&self, shape: ScoreShape, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        let Some(b) = self.bias else { return Ok(None) };
        check_bias(b, shape)?;
        let b = b.to_device(device).to_kind(kind);
        let mut b = b.masked_fill(&b.isneginf(), 0.0);
        while b.dim() < 4 {
            b = b.unsqueeze(0);
        }
        Ok(Some(b))
    }

    /// Checks every mask against `shape` as [`Self::allowed`] does (shapes, dtypes, an additive
    /// mask's values), without combining them: for a route that reads each mask itself, where the
    /// combination (`S_q × S_k` under a causal mask) would be work and memory for nothing.
    pub(crate) fn check(&self, shape: ScoreShape) -> Result<()> {
        let [b, _, sq, sk] = shape.dims();
        if let Some(m) = self.key_padding {
            check_mask("key_padding_mask", m, &[b, sk])?;
        }
        if let Some(m) = self.query_padding {
            check_mask("query_padding_mask", m, &[b, sq])?;
        }
        if let Some(m) = self.attn_mask {
            check_broadcastable("attn_mask", m, &shape.dims())?;
            check_mask("attn_mask", m, &m.size())?;
        }
        if let Some(b) = self.bias {
            check_bias(b, shape)?;
            check_bias_values(b)?;
        }
        Ok(())
    }

    /// The key padding `(B, S_k)` that a boolean `attn_mask` is when it excludes the same keys for
    /// every query and every head (size 1, or stride 0, in both dimensions: a padding mask
    /// broadcast, as transformers builds one for a padded batch), joined with the call's own key
    /// padding, on `device`; `None` when the call has no such mask. Views and one `(B, S_k)` copy:
    /// nothing is read back and no `(S_q, S_k)` tensor is formed, and the routes that serve key
    /// padding but not a pattern (the fused kernels) then serve the call. A mask that fails the
    /// checks is left to them.
    pub(crate) fn per_key_padding(&self, shape: ScoreShape, device: Device) -> Option<Tensor> {
        let m = self.attn_mask?;
        let size = m.size();
        let rank = size.len();
        let dims = shape.dims();
        let [b, _, _, sk] = dims;
        let own_fits = self.key_padding.map_or(true, |own| check_mask("key_padding_mask", own, &[b, sk]).is_ok());
        if !own_fits || !matches!(m.kind(), Kind::Bool | Kind::Uint8) || check_broadcastable("attn_mask", m, &dims).is_err() {
            return None;
        }
        let stride = m.stride();
        // The query dimension (rank - 2) and the head dimension (rank - 3), where the mask has them.
        let alike = |d: usize| size[d] == 1 || stride[d] == 0;
        if (rank >= 2 && !alike(rank - 2)) || (rank >= 3 && !alike(rank - 3)) {
            return None;
        }
        let mut keys = m.shallow_clone();
        for d in [rank.checked_sub(2), rank.checked_sub(3)].into_iter().flatten() {
            keys = keys.select(d as i64, 0);
        }
        // (), (S_k), (1, S_k) or (B, S_k), true = excluded.
        let mut padding = keys.to_device(device).ne(0).expand([b, sk], false);
        if let Some(own) = self.key_padding {
            padding = padding.logical_or(&own.to_device(device).ne(0));
        }
        Some(padding.contiguous())
    }

    /// Checks every mask against `shape` and combines them into one boolean tensor on `device`,
    /// of rank 4 and broadcastable to `(B, H, S_q, S_k)`, `true` = may attend. `None` when nothing is masked.
    pub fn allowed(&self, shape: ScoreShape, device: Device) -> Result<Option<Tensor>> {
        let [b, _, sq, sk] = shape.dims();
        let mut allowed: Option<Tensor> = None;
        let mut and = |t: Tensor| {
            allowed = Some(match allowed.take() {
                Some(a) => a.logical_and(&t),
                None => t,
            })
        };
        // The views below only insert size-1 dimensions into a mask whose shape was just checked:
        // possible in any layout, so they cannot fail whatever strides the caller's mask has.
        if let Some(m) = self.key_padding {
            let m = as_excluded("key_padding_mask", m, &[b, sk])?;
            and(m.logical_not().to_device(device).view([b, 1, 1, sk]));
        }
        if let Some(m) = self.query_padding {
            let m = as_excluded("query_padding_mask", m, &[b, sq])?;
            and(m.logical_not().to_device(device).view([b, 1, sq, 1]));
        }
        if let Some(m) = self.attn_mask {
            check_broadcastable("attn_mask", m, &shape.dims())?;
            let m = as_excluded("attn_mask", m, &m.size())?;
            and(m.logical_not().to_device(device));
        }
        if self.causal {
            and(Tensor::ones([sq, sk], (Kind::Bool, device)).tril(0));
        }
        if let Some(b) = self.bias {
            check_bias(b, shape)?;
            check_bias_values(b)?;
            // The -inf entries; a bias without any adds no mask (and no (S_q, S_k) boolean).
            let excluded = b.isneginf();
            if excluded.any().int64_value(&[]) != 0 {
                and(excluded.logical_not().to_device(device));
            }
        }
        // Always rank 4 (an attn_mask may be (S_k,) or (S_q, S_k)): every consumer reads the query
        // and key dimensions as dims -2 and -1 of a 4-D tensor.
        Ok(allowed.map(|mut a| {
            while a.dim() < 4 {
                a = a.unsqueeze(0);
            }
            a
        }))
    }
}

/// `t` with every dimension it repeats through a zero stride (an `expand`ed view) narrowed to
/// size 1: the same values under broadcasting, so that an element-wise operation on it (inverting
/// a mask of the other convention) forms one copy of what repeats, and [`crate::attend`] still
/// sees a mask that is alike for every query (which it takes as key padding).
pub fn unexpanded(t: &Tensor) -> Tensor {
    let (size, stride) = (t.size(), t.stride());
    (0..size.len()).filter(|&d| stride[d] == 0 && size[d] > 1).fold(t.shallow_clone(), |t, d| t.narrow(d as i64, 0, 1))
}

/// Checks an additive mask's dtype and shape: floating, broadcastable to the scores.
fn check_bias(b: &Tensor, shape: ScoreShape) -> Result<()> {
    if !matches!(b.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) {
        return Err(Error::Shape(format!(
            "the additive mask (bias) has dtype {:?}; it must be floating-point (a boolean mask goes in attn_mask)",
            b.kind()
        )));
    }
    check_broadcastable("the additive mask (bias)", b, &shape.dims())
}

/// Checks an additive mask's values: finite or `-inf` (one reduction when they are), else an error
/// naming NaN or `+inf`.
fn check_bias_values(b: &Tensor) -> Result<()> {
    if b.isfinite().logical_or(&b.isneginf()).all().int64_value(&[]) != 0 {
        return Ok(());
    }
    if b.isnan().any().int64_value(&[]) != 0 {
        return Err(Error::NonFinite("the additive mask (bias) holds NaN".into()));
    }
    Err(Error::NonFinite("the additive mask (bias) holds +inf (only -inf, which excludes an entry, is allowed)".into()))
}

/// Checks a mask's dtype and shape: bool or uint8, of exactly `shape`.
fn check_mask(name: &str, mask: &Tensor, shape: &[i64]) -> Result<()> {
    if mask.size() != shape {
        return Err(Error::Shape(format!("{name} has shape {:?}, expected {shape:?}", mask.size())));
    }
    match mask.kind() {
        Kind::Bool | Kind::Uint8 => Ok(()),
        other => Err(Error::Shape(format!(
            "{name} has dtype {other:?}; masks must be bool or uint8 (true = excluded, as in \
             PyTorch's nn.MultiheadAttention)"
        ))),
    }
}

/// Checks a mask's dtype and shape and returns it as a boolean tensor (`true` = excluded).
fn as_excluded(name: &str, mask: &Tensor, shape: &[i64]) -> Result<Tensor> {
    check_mask(name, mask, shape)?;
    Ok(if mask.kind() == Kind::Bool { mask.shallow_clone() } else { mask.ne(0) })
}

/// Checks that `t` broadcasts to `target` (rank at most that of `target`, each size 1 or equal).
pub(crate) fn check_broadcastable(name: &str, t: &Tensor, target: &[i64]) -> Result<()> {
    let size = t.size();
    let fits = size.len() <= target.len() && size.iter().rev().zip(target.iter().rev()).all(|(&s, &t)| s == 1 || s == t);
    if fits {
        Ok(())
    } else {
        Err(Error::Shape(format!("{name} has shape {size:?}, which does not broadcast to {target:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: ScoreShape = ScoreShape { batch: 3, heads: 2, queries: 4, keys: 5 };

    fn padding() -> Tensor {
        // (B, S_k), true = excluded: one key of the first batch, two of the last.
        Tensor::from_slice(&[0u8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]).view([3, 5]).ne(0)
    }

    fn folded(attn_mask: &Tensor, key_padding: Option<&Tensor>) -> Option<Vec<i64>> {
        let masks = Masks { attn_mask: Some(attn_mask), key_padding, ..Default::default() };
        masks.per_key_padding(SHAPE, Device::Cpu).map(|p| {
            assert_eq!(p.size(), [3, 5]);
            assert_eq!(p.kind(), Kind::Bool);
            Vec::<i64>::try_from(p.to_kind(Kind::Int64).view([-1])).unwrap_or_default()
        })
    }

    #[test]
    fn a_mask_alike_for_every_query_and_head_is_key_padding() {
        let want = Vec::<i64>::try_from(padding().to_kind(Kind::Int64).view([-1])).unwrap_or_default();
        // Broadcast over the queries by a zero stride (transformers' padded batch), or by size 1.
        let expanded = padding().view([3, 1, 1, 5]).expand([3, 1, 4, 5], false);
        assert_eq!(folded(&expanded, None).as_ref(), Some(&want));
        assert_eq!(folded(&padding().view([3, 1, 1, 5]), None).as_ref(), Some(&want));
        // Over the heads too, by a zero stride; as uint8.
        let heads = padding().to_kind(Kind::Uint8).view([3, 1, 1, 5]).expand([3, 2, 4, 5], false);
        assert_eq!(folded(&heads, None).as_ref(), Some(&want));
        // One row for every batch, of rank 1 and 2: the same keys excluded in each.
        let row = Tensor::from_slice(&[false, true, false, false, false]);
        let rows = Vec::<i64>::try_from(row.to_kind(Kind::Int64).repeat([3])).unwrap_or_default();
        assert_eq!(folded(&row, None).as_ref(), Some(&rows));
        assert_eq!(folded(&row.view([1, 5]), None).as_ref(), Some(&rows));
        // Joined with the call's own key padding.
        let both: Vec<i64> = want.iter().zip(&rows).map(|(a, b)| a | b).collect();
        let own = row.view([1, 5]).expand([3, 5], false).contiguous();
        assert_eq!(folded(&padding().view([3, 1, 1, 5]), Some(&own)).as_ref(), Some(&both));
    }

    #[test]
    fn a_mask_that_differs_by_query_or_head_or_does_not_fit_stays_a_pattern() {
        // The same values stored for every query: not read back to find that out.
        let stored = padding().view([3, 1, 1, 5]).expand([3, 1, 4, 5], false).contiguous();
        assert_eq!(folded(&stored, None), None);
        let per_head = Tensor::from_slice(&[false, true]).view([1, 2, 1, 1]).expand([3, 2, 1, 5], false);
        assert_eq!(folded(&per_head, None), None);
        // Wrong shape or dtype, or a key padding of the wrong shape: the checks name them.
        assert_eq!(folded(&padding().view([3, 1, 1, 5]).narrow(3, 0, 4), None), None);
        assert_eq!(folded(&padding().view([3, 1, 1, 5]).to_kind(Kind::Float), None), None);
        assert_eq!(folded(&padding().view([3, 1, 1, 5]), Some(&padding().narrow(1, 0, 4))), None);
    }

    #[test]
    fn unexpanded_narrows_only_what_repeats_by_a_zero_stride() {
        let expanded = padding().view([3, 1, 1, 5]).expand([3, 2, 4, 5], false);
        assert_eq!(unexpanded(&expanded).size(), [3, 1, 1, 5]);
        assert_eq!(unexpanded(&expanded.contiguous()).size(), [3, 2, 4, 5]);
        assert_eq!(unexpanded(&padding()).size(), [3, 5]);
    }
}
