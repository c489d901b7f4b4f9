//! The contextual prior of BAM-WC and BAM-LC (Fan et al. 2020, §3.3): `ψ = softmax(F2(ReLU(F1(k))))`
//! over the keys, one small network per head, and the choice of keys that softmax runs over when
//! attention is a graph ([`PriorScope`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

use super::Support;
use crate::param::param;
use crate::precision::statistics_kind;
use crate::{Error, Result};

/// Which keys the contextual prior's softmax runs over when attention is an edge list (a graph).
///
/// The paper's `Ψ` is one distribution over the keys of one attention. In a graph every node `i`
/// attends its own keys, its neighbourhood `N(i)`, so the faithful reading normalizes per node:
/// `ψ_ij = softmax_{j ∈ N(i)} F2(ReLU(F1(k_j)))`, and each node's prior sums to one over the nodes
/// it attends. The authors' GAT code instead takes one softmax over every node that is some
/// edge's key (with self-loops: all `N` nodes), so `ψ_j ≈ 1/N`. Dense attention has one reading,
/// the paper's (one `Ψ` per example and head over the keys some query may attend), whatever this
/// says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PriorScope {
    /// Per query node, over its neighbourhood `N(i)` (the paper's `Ψ` for an attention whose keys
    /// are `N(i)`).
    Neighbourhood,
    /// One softmax over all key nodes, shared by every query node (the authors' GAT code).
    #[default]
    AllNodes,
}

impl PriorScope {
    pub const ALL: [PriorScope; 2] = [Self::Neighbourhood, Self::AllNodes];

    /// The name the CLI and config files use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Neighbourhood => "neighbourhood",
            Self::AllNodes => "all-nodes",
        }
    }
}

impl fmt::Display for PriorScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PriorScope {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| Error::Config(format!("unknown prior scope {s:?} (expected neighbourhood or all-nodes)")))
    }
}

/// The contextual prior network of one attention layer: per head,
/// `ψ_j = softmax_j(F2(ReLU(F1(k_j))))` over the keys some query may attend, with
/// `F1: d_k → hidden` and `F2: hidden → 1`, initialised as the authors' code (He-normal weights,
/// zero biases). Over dense scores the softmax runs over the keys some query of the example may
/// attend. Over an edge list, `scope` decides: per query node over its neighbourhood (the paper's
/// reading for graphs) or over all key nodes at once (the authors' GAT code); see [`PriorScope`].
#[derive(Debug)]
pub struct ContextualPrior {
    scope: PriorScope,
    heads: i64,
    hidden: i64,
    key_dim: i64,
    /// `(H, hidden, d_k)`
    f1_weight: Tensor,
    /// `(H, hidden)`
    f1_bias: Tensor,
    /// `(H, hidden)`
    f2_weight: Tensor,
    /// `(H,)`
    f2_bias: Tensor,
}

impl ContextualPrior {
    /// Parameters `f1.weight`, `f1.bias`, `f2.weight`, `f2.bias` under `p` (or the tensors already
    /// there: [`crate::param`]).
    pub fn new(p: &nn::Path, heads: i64, key_dim: i64, hidden: i64, scope: PriorScope) -> Result<Self> {
        let he = |fan_in: i64| nn::Init::Randn { mean: 0.0, stdev: (2.0 / fan_in as f64).sqrt() };
        let (f1, f2) = (p / "f1", p / "f2");
        Ok(Self {
            scope,
            heads,
            hidden,
            key_dim,
            f1_weight: param(&f1, "weight", &[heads, hidden, key_dim], he(key_dim))?,
            f1_bias: param(&f1, "bias", &[heads, hidden], nn::Init::Const(0.0))?,
            f2_weight: param(&f2, "weight", &[heads, hidden], he(hidden))?,
            f2_bias: param(&f2, "bias", &[heads], nn::Init::Const(0.0))?,
        })
    }

    /// `log ψ` broadcastable to the scores (`(B, H, 1, S_k)` dense, `(H, E)` over edges: one value
    /// per edge, which varies with the query node under the neighbourhood scope), from keys
    /// `(B, H, S_k, d_k)` (`(1, H, N, d_k)` over edges); keys no query may attend get 0. Grouped
    /// keys `(B, H_kv, S_k, d_k)`, `H_kv` a divisor of `H` (grouped-query attention), are read by
    /// the networks of their query heads in one product, without a copy. The network runs in the
    /// statistics' dtype (float32 for bfloat16 or float16 keys).
    pub fn log_psi(&self, keys: &Tensor, support: &Support) -> Result<Tensor> {
        let (heads, hidden, key_dim) = (self.heads, self.hidden, self.key_dim);
        let size = keys.size();
        if size.len() != 4 || size[1] == 0 || heads % size[1] != 0 || size[3] != key_dim {
            return Err(Error::Shape(format!("the contextual prior takes keys (B, {heads}, S_k, {key_dim}), got {size:?}")));
        }
        let ([batch, kv, len, _], group) = ([size[0], size[1], size[2], size[3]], heads / size[1]);
        let kind = statistics_kind(keys.kind());
        // The first layers of the G = H / H_kv query heads that read a key head side by side,
        // (1, H_kv, d_k, G · hidden): query head kv · G + g reads key head kv, as in
        // grouped-query attention.
        let w1 = self.f1_weight.to_kind(kind).reshape([kv, group, hidden, key_dim]);
        let w1 = w1.permute([0, 3, 1, 2]).reshape([1, kv, key_dim, group * hidden]);
        // Bfloat16 or float16 keys are taken in float32, as the scores are, without autograd
        // keeping a float32 copy of them (twice their size) for the first weight's gradient.
        let first = if keys.kind() == kind { keys.matmul(&w1) } else { crate::cxx::widened_matmul(keys, &w1)? };
        let first = first.view([batch, kv, len, group, hidden]).permute([0, 1, 3, 2, 4]).reshape([batch, heads, len, hidden]);
        let b1 = self.f1_bias.to_kind(kind).view([1, heads, 1, hidden]);
        let h = (first + b1).relu(); // (B, H, S_k, hidden)
        let w2 = self.f2_weight.to_kind(kind).view([1, heads, hidden, 1]);
        let b2 = self.f2_bias.to_kind(kind).view([1, heads, 1, 1]);
        let logits = (h.matmul(&w2) + b2).transpose(2, 3); // (B, H, 1, S_k)
        Ok(support.key_log_softmax(&logits, self.scope))
    }
}
