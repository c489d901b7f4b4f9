//! A Transformer translation model as fairseq's `transformer` architecture builds it (Vaswani et
//! al. 2017; Ott et al. 2019): token embeddings scaled by `sqrt(E)`, fairseq's sinusoidal
//! positions (first half sines, second half cosines, positions counted from `pad + 1`), dropout,
//! the post-norm [`Transformer`] stack, and an output layer tied to the embeddings. With a joint
//! vocabulary, `share_all_embeddings` ties source, target and output embeddings in one matrix
//! (`--share-all-embeddings`, as the repulsive-attention authors ran IWSLT14).
//!
//! Initialisation as fairseq: embeddings `N(0, E^-1/2)` with the padding row zero, FFN layers
//! Xavier-uniform with zero biases; attention projections keep PyTorch's `nn.MultiheadAttention`
//! initialisation (Xavier-uniform, zero biases), which fairseq 0.6 also used.
//!
//! Decoding caches each layer's keys and values ([`DecoderState`]), so a step costs O(current
//! length): see [`Seq2Seq::start`] and [`Seq2Seq::step`].

use probattn::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init};
use tch::{Kind, Tensor};

use crate::transformer::{DecoderState, Transformer, TransformerConfig};

/// The name of one of our parameters in the PyTorch baseline (python/baselines/translate.py): the
/// same, except the shared embedding matrix, which is `embed` there. `None` for the decoder's own
/// embeddings (the baseline always shares them).
pub fn baseline_name(ours: &str) -> Option<String> {
    match ours {
        "encoder.embed_tokens.weight" => Some("embed".into()),
        "decoder.embed_tokens.weight" => None,
        other => Some(other.into()),
    }
}

/// The model's sizes and vocabulary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Seq2SeqConfig {
    pub transformer: TransformerConfig,
    /// Vocabulary size (joint when `share_all_embeddings`).
    pub vocab: i64,
    /// The padding token's id.
    pub pad: i64,
    /// One embedding matrix for source, target and output (requires a joint vocabulary).
    pub share_all_embeddings: bool,
    /// The longest sequence the positions cover (fairseq's `max_source_positions`).
    pub max_positions: i64,
}

/// Embeddings, the stack and the output layer.
#[derive(Debug)]
pub struct Seq2Seq {
    cfg: Seq2SeqConfig,
    /// `(V, E)` source embeddings (and target and output ones when shared).
    src_embed: Tensor,
    /// `(V, E)` target embeddings, also the output layer; the source's when shared.
    tgt_embed: Tensor,
    /// `(max_positions + pad + 1, E)` fixed sinusoids.
    positions: Tensor,
    pub stack: Transformer,
}

/// fairseq's `SinusoidalPositionalEmbedding.get_embedding`: row `p` is
/// `[sin(p·f_0) .. sin(p·f_{h−1}), cos(p·f_0) .. cos(p·f_{h−1})]` with `f_i = exp(−i·ln(10000)/(h−1))`,
/// `h = E/2`; the padding row is zero.
pub fn sinusoids(rows: i64, dim: i64, pad: i64, device: tch::Device) -> Tensor {
    let half = dim / 2;
    let step = (10000f64).ln() / (half - 1).max(1) as f64;
    let freqs = (Tensor::arange(half, (Kind::Float, device)) * -step).exp(); // (h,)
    let angles = Tensor::arange(rows, (Kind::Float, device)).unsqueeze(1) * freqs.unsqueeze(0); // (rows, h)
    let mut table = Tensor::cat(&[angles.sin(), angles.cos()], 1);
    if dim % 2 == 1 {
        table = Tensor::cat(&[table, Tensor::zeros([rows, 1], (Kind::Float, device))], 1);
    }
    let _ = table.get(pad).zero_();
    table
}

impl Seq2Seq {
    /// Parameters under `p`: `encoder.embed_tokens.weight` (shared) or also
    /// `decoder.embed_tokens.weight`, then the stack's.
    pub fn new(p: &nn::Path, cfg: Seq2SeqConfig) -> Result<Self> {
        let e = cfg.transformer.embed_dim;
        if cfg.vocab <= cfg.pad || cfg.pad < 0 || cfg.max_positions < 1 {
            return Err(Error::Config(format!(
                "vocab {} must exceed pad {} >= 0; max_positions {} >= 1",
                cfg.vocab, cfg.pad, cfg.max_positions
            )));
        }
        let embedding = |side: &str| {
            let w = (p / side / "embed_tokens").var("weight", &[cfg.vocab, e], Init::Randn { mean: 0.0, stdev: (e as f64).powf(-0.5) });
            tch::no_grad(|| {
                let _ = w.get(cfg.pad).zero_();
            });
            w
        };
        let src_embed = embedding("encoder");
        let tgt_embed = if cfg.share_all_embeddings { src_embed.shallow_clone() } else { embedding("decoder") };
        let stack = Transformer::new(p, cfg.transformer.clone())?;
        let positions = sinusoids(cfg.max_positions + cfg.pad + 1, e, cfg.pad, p.device());
        Ok(Self { cfg, src_embed, tgt_embed, positions, stack })
    }

    pub fn config(&self) -> &Seq2SeqConfig {
        &self.cfg
    }

    /// `tokens (B, S)` int64 → `(B, S, E)`: `sqrt(E)·embed + position`, positions counted from
    /// `pad + 1 + offset` for non-padding tokens (padding gets the zero row), then dropout.
    fn embed(&self, table: &Tensor, tokens: &Tensor, offset: i64, train: bool) -> Result<Tensor> {
        let (len, e) = (tokens.size()[1], self.cfg.transformer.embed_dim);
        if offset + len > self.cfg.max_positions {
            return Err(Error::Shape(format!(
                "a sequence of {} tokens exceeds the model's {} positions",
                offset + len,
                self.cfg.max_positions
            )));
        }
        let not_pad = tokens.ne(self.cfg.pad);
        let pos = (not_pad.to_kind(Kind::Int64).cumsum(1, Kind::Int64) + offset) * &not_pad + self.cfg.pad; // (B, S)
        let x = Tensor::embedding(table, tokens, self.cfg.pad, false, false) * (e as f64).sqrt()
            + Tensor::embedding(&self.positions, &pos, self.cfg.pad, false, false); // (B, S, E)
        Ok(x.dropout(self.cfg.transformer.dropout, train))
    }

    /// Teacher-forced logits `(B, T, V)` of `prev_tokens (B, T)` (the target shifted right, starting
    /// with the begin token) given `src (B, S)`; and the KL term of stochastic attention.
    pub fn forward_t(&self, src: &Tensor, prev_tokens: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        let src_pad = src.eq(self.cfg.pad);
        let tgt_pad = prev_tokens.eq(self.cfg.pad);
        let x = self.embed(&self.src_embed, src, 0, train)?;
        let y = self.embed(&self.tgt_embed, prev_tokens, 0, train)?;
        let out = self.stack.forward_t(&x, Some(&src_pad), &y, Some(&tgt_pad), train)?;
        Ok((out.output.matmul(&self.tgt_embed.transpose(0, 1)), out.kl)) // (B, T, V)
    }

    /// Each encoder layer's self-attention weights `(B, H, S, S)` and per-head outputs
    /// `(B, H, S, d_h)` on `src (B, S)`, in eval mode.
    pub fn encoder_attention(&self, src: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
        let src_pad = src.eq(self.cfg.pad);
        let x = self.embed(&self.src_embed, src, 0, false)?;
        Ok(self.stack.encode_inspect(&x, Some(&src_pad))?.1)
    }

    /// Encodes `src (B, S)` in eval mode and returns the decoding state and the source padding.
    pub fn start(&self, src: &Tensor) -> Result<(DecoderState, Tensor)> {
        let src_pad = src.eq(self.cfg.pad);
        let x = self.embed(&self.src_embed, src, 0, false)?;
        let memory = self.stack.encode(&x, Some(&src_pad), false, &mut vec![])?;
        Ok((self.stack.start_decoding(&memory), src_pad))
    }

    /// Log-probabilities `(B, V)` of the next token after `token (B,)` at position `step`
    /// (0 for the begin token), extending `state`.
    pub fn step(&self, token: &Tensor, step: i64, state: &mut DecoderState, src_pad: &Tensor) -> Result<Tensor> {
        let y = self.embed(&self.tgt_embed, &token.unsqueeze(1), step, false)?; // (B, 1, E)
        let y = self.stack.decode_step(&y, state, Some(src_pad))?;
        let logits = y.squeeze_dim(1).matmul(&self.tgt_embed.transpose(0, 1)); // (B, V)
        Ok(logits.log_softmax(-1, logits.kind()))
    }
}
