//! Where attention is allowed, and the reductions over it that every normalizer is built from.
//!
//! Two layouts of the same idea:
//! - [`Support::Dense`]: scores `(B, H, S_q, S_k)` and a boolean mask broadcastable to them;
//! - [`Support::Edges`]: scores `(H, E)`, one per edge `(query i ← key j)` of a graph, so memory
//!   is O(E) (GAT's neighbourhoods). A query's row is the edges into it, a key's column the edges
//!   out of it; reductions are scatter operations over those segments.

use tch::{Kind, Tensor};

use super::{mask_value, PriorScope};
use crate::{Error, Result};

/// An edge list: edge `e` lets query node `dst[e]` attend key node `src[e]`.
#[derive(Debug)]
pub struct EdgeList {
    /// `(E,)` int64 query (destination) node of each edge.
    pub dst: Tensor,
    /// `(E,)` int64 key (source) node of each edge.
    pub src: Tensor,
    /// Number of query nodes.
    pub queries: i64,
    /// Number of key nodes.
    pub keys: i64,
}

impl EdgeList {
    /// Checks the indices (1-d, int64, equal length, in range) once, here.
    pub fn new(dst: Tensor, src: Tensor, queries: i64, keys: i64) -> Result<Self> {
        if dst.dim() != 1 || dst.size() != src.size() || dst.kind() != Kind::Int64 || src.kind() != Kind::Int64 {
            return Err(Error::Shape(format!(
                "edge lists need two int64 vectors of one length, got dst {:?} {:?} and src {:?} {:?}",
                dst.size(),
                dst.kind(),
                src.size(),
                src.kind()
            )));
        }
        for (name, idx, n) in [("dst", &dst, queries), ("src", &src, keys)] {
            if idx.numel() > 0 {
                let (lo, hi) = (i64::try_from(idx.min())?, i64::try_from(idx.max())?);
                if lo < 0 || hi >= n {
                    return Err(Error::Shape(format!("edge {name} indices span {lo}..={hi}, outside 0..{n}")));
                }
            }
        }
        Ok(Self { dst, src, queries, keys })
    }

    pub fn len(&self) -> i64 {
        self.dst.size()[0]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// logsumexp of `z (H, E)` over the segments `index` defines, gathered back to `(H, E)`.
    fn segment_lse(z: &Tensor, index: &Tensor, segments: i64) -> Tensor {
        let heads = z.size()[0];
        let idx = index.unsqueeze(0).expand([heads, -1], false); // (H, E)
        let opts = (z.kind(), z.device());
        // The shift only stabilizes the exponentials; logsumexp's gradient does not depend on it.
        let max = Tensor::full([heads, segments], f64::NEG_INFINITY, opts).internal_scatter_reduce(1, &idx, &z.detach(), "amax", true);
        let shift = max.gather(1, &idx, false); // (H, E), finite: every gathered segment has an edge
        let sum = Tensor::zeros([heads, segments], opts).scatter_add(1, &idx, &(z - &shift).exp());
        sum.gather(1, &idx, false).log() + shift
    }
}

/// Where attention is allowed; see the module documentation.
#[derive(Debug)]
pub enum Support {
    /// `excluded` (`true` = excluded) broadcasts to `(B, H, S_q, S_k)`; `None`: nothing excluded.
    Dense { excluded: Option<Tensor> },
    /// Scores `(H, E)` over the edges.
    Edges(EdgeList),
}

impl Support {
    /// Dense scores and a boolean `allowed` mask broadcastable to them (`true` = may attend), as
    /// [`crate::Masks::allowed`] returns it; `None`: everything allowed.
    pub fn dense(allowed: Option<Tensor>) -> Self {
        Self::Dense { excluded: allowed.map(|a| a.logical_not()) }
    }

    /// The edge list, for the edge layout.
    pub fn edges(&self) -> Option<&EdgeList> {
        match self {
            Self::Edges(e) => Some(e),
            Self::Dense { .. } => None,
        }
    }

    /// Checks that `scores` have this support's layout.
    pub fn check_scores(&self, scores: &Tensor) -> Result<()> {
        match self {
            Self::Dense { .. } if scores.dim() != 4 => {
                Err(Error::Shape(format!("dense scores must be (B, H, S_q, S_k), got {:?}", scores.size())))
            }
            Self::Edges(e) if scores.dim() != 2 || scores.size()[1] != e.len() => {
                Err(Error::Shape(format!("edge scores must be (H, {}), got {:?}", e.len(), scores.size())))
            }
            _ => Ok(()),
        }
    }

    /// `t` with excluded entries set to `value`.
    pub fn fill_value(&self, t: &Tensor, value: f64) -> Tensor {
        match self {
            Self::Dense { excluded: Some(m) } => t.masked_fill(m, value),
            _ => t.shallow_clone(),
        }
    }

    /// Log-scores with excluded entries replaced by a large finite negative (see [`mask_value`]).
    pub fn fill(&self, z: &Tensor) -> Tensor {
        self.fill_value(z, mask_value(z.kind()))
    }

    /// Masks freshly computed scores that nothing else reads in place, for a row softmax: one
    /// full-size allocation fewer than [`Self::fill`]. Excluded entries get the mask value
    /// *added* (a plain broadcast add, cheaper than a masked write; PyTorch adds its float mask
    /// the same way), which leaves their weights exactly 0 as filling does: `exp(z + value − max)`
    /// underflows for any score below 1e29 in magnitude. Half precision, whose mask value is small,
    /// is filled as [`Self::fill`] does.
    pub fn mask_scores_(&self, z: &mut Tensor) {
        if let Self::Dense { excluded: Some(m) } = self {
            let value = mask_value(z.kind());
            if z.kind() == Kind::Half {
                let _ = z.masked_fill_(m, value);
            } else {
                let _ = z.g_add_(&(m.to_kind(z.kind()) * value));
            }
        }
    }

    /// Zeroes excluded entries of weights.
    pub fn zero(&self, w: &Tensor) -> Tensor {
        self.fill_value(w, 0.0)
    }

    /// `logsumexp` over each query's keys of filled log-scores, broadcastable to the scores.
    pub fn row_lse(&self, z_filled: &Tensor) -> Tensor {
        match self {
            Self::Dense { .. } => z_filled.logsumexp([-1], true), // (B, H, S_q, 1)
            Self::Edges(e) => EdgeList::segment_lse(z_filled, &e.dst, e.queries),
        }
    }

    /// `logsumexp` over each key's queries of filled log-scores, broadcastable to the scores.
    pub fn col_lse(&self, z_filled: &Tensor) -> Tensor {
        match self {
            Self::Dense { .. } => z_filled.logsumexp([-2], true), // (B, H, 1, S_k)
            Self::Edges(e) => EdgeList::segment_lse(z_filled, &e.src, e.keys),
        }
    }

    /// Softmax over each query's keys of filled log-scores, zero on excluded entries (so a fully
    /// excluded row is all zeros rather than uniform).
    ///
    /// Dense scores are zeroed again only when some row has no allowed key: elsewhere the fill
    /// value (far below any score) already gives excluded entries an exact 0, so the extra
    /// full-size pass is skipped (the check runs on the small, broadcast mask; on the CPU only,
    /// since on a GPU reading its answer would stall the stream).
    pub fn row_softmax(&self, z_filled: &Tensor) -> Tensor {
        match self {
            Self::Dense { excluded: Some(m) } => {
                let w = z_filled.softmax(-1, z_filled.kind());
                let empty_row = m.device() != tch::Device::Cpu || bool::try_from(m.all_dim(-1, false).any()).unwrap_or(true);
                if empty_row {
                    self.zero(&w)
                } else {
                    w
                }
            }
            Self::Dense { excluded: None } => z_filled.softmax(-1, z_filled.kind()),
            Self::Edges(_) => (z_filled - self.row_lse(z_filled)).exp(),
        }
    }

    /// Row-normalized log-weights of filled log-scores, excluded entries filled again.
    ///
    /// Dense scores use the fused `log_softmax` kernel: one full-size result forward and one
    /// backward, where `z − logsumexp(z)` allocates four (the reason DNAS, Sinkhorn and BAM cost
    /// what they do on CPU, where each fresh full-size tensor is paid in page faults).
    pub fn row_log_softmax(&self, z_filled: &Tensor) -> Tensor {
        match self {
            Self::Dense { .. } => self.fill(&z_filled.log_softmax(-1, z_filled.kind())),
            Self::Edges(_) => self.fill(&(z_filled - self.row_lse(z_filled))),
        }
    }

    /// Column-normalized log-weights (each key over its queries) of filled log-scores, excluded
    /// entries filled again: `z − logsumexp_i z`, fused as [`Self::row_log_softmax`] is.
    pub fn col_log_softmax(&self, z_filled: &Tensor) -> Tensor {
        match self {
            Self::Dense { .. } => self.fill(&z_filled.log_softmax(-2, z_filled.kind())),
            Self::Edges(_) => self.fill(&(z_filled - self.col_lse(z_filled))),
        }
    }

    /// The number of heads of `scores`.
    pub fn heads(&self, scores: &Tensor) -> i64 {
        match self {
            Self::Dense { .. } => scores.size()[1],
            Self::Edges(_) => scores.size()[0],
        }
    }

    /// A per-head `(H,)` tensor shaped to broadcast against the scores.
    pub fn per_head(&self, t: &Tensor) -> Tensor {
        match self {
            Self::Dense { .. } => t.view([1, -1, 1, 1]),
            Self::Edges(_) => t.view([-1, 1]),
        }
    }

    /// Sums a scores-shaped tensor within each head, `(H,)`.
    pub fn sum_per_head(&self, t: &Tensor) -> Tensor {
        match self {
            Self::Dense { .. } => t.sum_dim_intlist(&[0i64, 2, 3][..], false, t.kind()),
            Self::Edges(_) => t.sum_dim_intlist(&[1i64][..], false, t.kind()),
        }
    }

    /// The number of allowed entries of each head, `(H,)`, for `scores`.
    pub fn count_per_head(&self, scores: &Tensor) -> Tensor {
        let (kind, device) = (scores.kind(), scores.device());
        match self {
            Self::Dense { excluded: Some(e) } => {
                e.logical_not().expand(scores.size(), false).sum_dim_intlist(&[0i64, 2, 3][..], false, kind)
            }
            Self::Dense { excluded: None } => {
                let s = scores.size();
                Tensor::full([s[1]], (s[0] * s[2] * s[3]) as f64, (kind, device))
            }
            Self::Edges(e) => Tensor::full([scores.size()[0]], e.len() as f64, (kind, device)),
        }
    }

    /// Per head, `Σ t_ij` over the allowed entries, for `t` constant along the queries: per key
    /// `(B|1, H|1, 1, S_k)` or a scalar (dense), per edge `(H, E)` or a scalar (edges). Costs a
    /// pass over the keys, not over the scores.
    pub fn sum_per_key(&self, t: &Tensor, scores: &Tensor) -> Tensor {
        let size = scores.size();
        match self {
            Self::Dense { excluded } => {
                let (b, h, sq, sk) = (size[0], size[1], size[2], size[3]);
                let t = t.expand([b, h, 1, sk], false);
                let weighted = match excluded {
                    // Allowed entries per key: (B, H, 1, S_k).
                    Some(e) => &t * e.logical_not().expand(&size, false).sum_dim_intlist(&[-2i64][..], true, t.kind()),
                    None => &t * sq as f64,
                };
                weighted.sum_dim_intlist(&[0i64, 2, 3][..], false, t.kind())
            }
            Self::Edges(_) => t.expand([size[0], size[1]], false).sum_dim_intlist(&[1i64][..], false, t.kind()),
        }
    }

    /// Per head, `Σ t_j x_ij` over the allowed entries, for `t` as in [`Self::sum_per_key`] and
    /// `x` shaped like the scores and zero on excluded entries. One reduction over `x`.
    pub fn sum_per_key_times(&self, t: &Tensor, x: &Tensor) -> Tensor {
        match self {
            Self::Dense { .. } => {
                let column = x.sum_dim_intlist(&[-2i64][..], true, x.kind()); // (B, H, 1, S_k)
                (t * column).sum_dim_intlist(&[0i64, 2, 3][..], false, x.kind())
            }
            Self::Edges(_) => (t * x).sum_dim_intlist(&[1i64][..], false, x.kind()),
        }
    }

    /// Per head, the number of queries with at least one allowed key (over the batch).
    pub fn rows_per_head(&self, scores: &Tensor) -> Tensor {
        let (kind, device, size) = (scores.kind(), scores.device(), scores.size());
        match self {
            Self::Dense { excluded: Some(e) } => {
                e.logical_not().expand(&size, false).any_dim(-1, false).sum_dim_intlist(&[0i64, 2][..], false, kind)
            }
            Self::Dense { excluded: None } => Tensor::full([size[1]], (size[0] * size[2]) as f64, (kind, device)),
            Self::Edges(e) => {
                let rows = Tensor::zeros([e.queries], (kind, device)).index_fill(0, &e.dst, 1.0).sum(kind);
                rows.expand([size[0]], false)
            }
        }
    }

    /// Log-softmax over the keys of per-key logits `(B|1, H, 1, S_k)` (dense) or `(1, H, 1, N)`
    /// (edges), shaped to broadcast against the scores. Dense: one softmax per example and head
    /// over the keys some query may attend; keys no query may attend get 0, a harmless value:
    /// their entries are excluded. Edges, `(H, E)`: under [`PriorScope::Neighbourhood`] a softmax
    /// per query node over the keys of its edges, `logit_j − logsumexp_{j' ∈ N(i)} logit_j'`;
    /// under [`PriorScope::AllNodes`] one softmax over every node that is some edge's key, shared
    /// by all query nodes (the authors' GAT code).
    pub fn key_log_softmax(&self, logits: &Tensor, scope: PriorScope) -> Tensor {
        let kind = logits.kind();
        match self {
            Self::Dense { excluded: Some(e) } => {
                let unseen = e.logical_not().any_dim(-2, true).logical_not(); // (B|1, H|1, 1, S_k)
                logits.masked_fill(&unseen, mask_value(kind)).log_softmax(-1, kind).masked_fill(&unseen, 0.0)
            }
            Self::Dense { excluded: None } => logits.log_softmax(-1, kind),
            Self::Edges(e) => {
                let heads = logits.size()[1];
                match scope {
                    PriorScope::Neighbourhood => {
                        let per_edge = logits.view([heads, -1]).index_select(1, &e.src); // (H, E)

                        // Every edge's query has at least that edge, so each segment is finite.
                        &per_edge - EdgeList::segment_lse(&per_edge, &e.dst, e.queries)
                    }
                    PriorScope::AllNodes => {
                        // Nodes that are no edge's key are left out of the softmax, as the dense
                        // mask does.
                        let seen = Tensor::zeros([e.keys], (Kind::Bool, logits.device())).index_fill(0, &e.src, 1);
                        let unseen = seen.logical_not().view([1, 1, 1, -1]);
                        let log_psi = logits.masked_fill(&unseen, mask_value(kind)).log_softmax(-1, kind);
                        log_psi.view([heads, -1]).index_select(1, &e.src) // (H, E)
                    }
                }
            }
        }
    }
}
