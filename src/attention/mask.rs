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
