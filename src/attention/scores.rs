//! Attention scores beside the scaled dot product ([`crate::scaled_dot_product_scores`]):
//! additive (MLP) scores, as in Bahdanau et al. 2015 and Lin et al. 2017.
//! Both return `(B, H, S_q, S_k)` scores for any [`crate::normalize::Normalizer`].

use tch::{nn, Tensor};

use crate::{Error, Result};

/// Bahdanau's additive score `z_ij = vᵀ tanh(W_q q_i + W_k k_j + b)`, one head.
#[derive(Debug)]
pub struct AdditiveScore {
    w_q: nn::Linear,
    w_k: nn::Linear,
    v: nn::Linear,
    query_dim: i64,
    key_dim: i64,
}

impl AdditiveScore {
    /// `w_q (hidden, d_q)` without bias, `w_k (hidden, d_k)` with the bias `b`, `v (1, hidden)`.
    pub fn new(p: &nn::Path, query_dim: i64, key_dim: i64, hidden: i64) -> Self {
        let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
        Self {
            w_q: nn::linear(p / "w_q", query_dim, hidden, no_bias),
            w_k: nn::linear(p / "w_k", key_dim, hidden, Default::default()),
            v: nn::linear(p / "v", hidden, 1, no_bias),
            query_dim,
            key_dim,
        }
    }

    /// `query (B, S_q, d_q)`, `key (B, S_k, d_k)` to scores `(B, 1, S_q, S_k)`.
    pub fn forward(&self, query: &Tensor, key: &Tensor) -> Result<Tensor> {
        let (q, k) = (query.size(), key.size());
        if q.len() != 3 || k.len() != 3 || q[2] != self.query_dim || k[2] != self.key_dim || q[0] != k[0] {
            return Err(Error::Shape(format!(
                "additive score: query {q:?} and key {k:?} must be (B, S_q, {}) and (B, S_k, {})",
                self.query_dim, self.key_dim
            )));
        }
        let hq = query.apply(&self.w_q).unsqueeze(2); // (B, S_q, 1, hidden)
        let hk = key.apply(&self.w_k).unsqueeze(1); // (B, 1, S_k, hidden)
        let z = (hq + hk).tanh().apply(&self.v).squeeze_dim(-1); // (B, S_q, S_k)
        Ok(z.unsqueeze(1)) // (B, 1, S_q, S_k)
    }
}

/// Lin et al. 2017's self-attentive sentence embedding: `A = normalize(W_s2 tanh(W_s1 Hᵀ))`, where
/// the `r` rows of `W_s2 (r, d_a)` are the "hops", each a learned query over the `S` tokens.
/// The rows of `W_s2` are what repulsive attention treats as particles.
#[derive(Debug)]
pub struct SelfAttentiveScore {
    w_s1: nn::Linear,
    w_s2: nn::Linear,
    input_dim: i64,
}

impl SelfAttentiveScore {
    /// `w_s1 (d_a, input_dim)` and `w_s2 (hops, d_a)`, both without bias, as in the paper.
    pub fn new(p: &nn::Path, input_dim: i64, hidden: i64, hops: i64) -> Self {
        let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
        Self { w_s1: nn::linear(p / "w_s1", input_dim, hidden, no_bias), w_s2: nn::linear(p / "w_s2", hidden, hops, no_bias), input_dim }
    }

    /// The hop matrix `W_s2`, `(r, d_a)`.
    pub fn hops(&self) -> &Tensor {
        &self.w_s2.ws
    }

    /// Token states `h (B, S, input_dim)` to scores `(B, 1, r, S)`: `r` hop-queries over `S` keys.
    pub fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let size = h.size();
        if size.len() != 3 || size[2] != self.input_dim {
            return Err(Error::Shape(format!("self-attentive score: input has shape {size:?}, expected (B, S, {})", self.input_dim)));
        }
        let z = h.apply(&self.w_s1).tanh().apply(&self.w_s2); // (B, S, r)
        Ok(z.transpose(1, 2).unsqueeze(1)) // (B, 1, r, S)
    }
}
