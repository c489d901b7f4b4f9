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
//!
//! The same type holds the other architecture of the translation experiments, the attentional
//! LSTM of Deng et al. 2018 ([`crate::lstm`]), when its config has `lstm` instead of
//! `transformer`: training, decoding and checkpoints take either through the same calls.

use probattn::{Error, Result, Variant};
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init};
use tch::{Kind, Tensor};

use crate::lstm::{AttentionalLstm, LstmConfig, LstmState};
use crate::transformer::{DecoderState, Transformer, TransformerConfig};

/// The name of one of our parameters in the PyTorch baseline (python/probattn_tools/baselines/translate.py): the
/// same, except the shared embedding matrix, which is `embed` there. `None` for the decoder's own
/// embeddings (the baseline always shares them).
pub fn baseline_name(ours: &str) -> Option<String> {
    match ours {
        "encoder.embed_tokens.weight" => Some("embed".into()),
        "decoder.embed_tokens.weight" => None,
        other => Some(other.into()),
    }
}

/// The model's sizes and vocabulary: exactly one of `transformer` and `lstm`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Seq2SeqConfig {
    /// The Transformer's sizes and attention (absent for the LSTM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer: Option<TransformerConfig>,
    /// The attentional LSTM's (absent for the Transformer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lstm: Option<LstmConfig>,
    /// Vocabulary size (joint when `share_all_embeddings`).
    pub vocab: i64,
    /// The padding token's id.
    pub pad: i64,
    /// One embedding matrix for source, target and output (requires a joint vocabulary).
    pub share_all_embeddings: bool,
    /// The longest sequence the positions cover (fairseq's `max_source_positions`).
    pub max_positions: i64,
}

impl Seq2SeqConfig {
    /// The attention variant of the model's main attention (the Transformer's encoder
    /// self-attention, the LSTM's only one).
    pub fn variant(&self) -> Variant {
        match (&self.transformer, &self.lstm) {
            (Some(t), _) => t.variant,
            (None, Some(l)) => l.variant,
            (None, None) => Variant::Softmax,
        }
    }

    /// A line that names the architecture and its sizes, for logs.
    pub fn describe(&self) -> String {
        match (&self.transformer, &self.lstm) {
            (Some(t), _) => format!(
                "Transformer: {} layers, E = {}, {} heads, attention {} (cross-attention {})",
                t.encoder_layers,
                t.embed_dim,
                t.heads,
                t.variant,
                t.cross_variant()
            ),
            (None, Some(l)) => format!(
                "attentional LSTM: {}-layer bidirectional encoder of {} units each way, {}-layer decoder of {}, E = {}, attention {}{}",
                l.encoder_layers,
                l.encoder_hidden,
                l.decoder_layers,
                l.decoder_hidden,
                l.embed_dim,
                l.variant,
                if l.variant == Variant::Dnas { " (causal: each source position normalized over the steps so far)" } else { "" }
            ),
            (None, None) => "no architecture".into(),
        }
    }
}

/// The Transformer's embeddings, stack and output layer.
#[derive(Debug)]
struct TransformerBody {
    /// `(V, E)` source embeddings (and target and output ones when shared).
    src_embed: Tensor,
    /// `(V, E)` target embeddings, also the output layer; the source's when shared.
    tgt_embed: Tensor,
    /// `(max_positions + pad + 1, E)` fixed sinusoids.
    positions: Tensor,
    stack: Transformer,
}

#[derive(Debug)]
enum Body {
    Transformer(TransformerBody),
    Lstm(AttentionalLstm),
}

/// A translation model: the Transformer, or the attentional LSTM.
#[derive(Debug)]
pub struct Seq2Seq {
    cfg: Seq2SeqConfig,
    body: Body,
}

/// The incremental decoding state of either architecture.
#[derive(Debug)]
pub enum DecodingState {
    Transformer(DecoderState),
    Lstm(LstmState),
}

impl DecodingState {
    /// Keeps the rows `index (B',)`, in that order: beam search's reorder after each step.
    pub fn reorder(&mut self, index: &Tensor) {
        match self {
            Self::Transformer(s) => s.reorder(index),
            Self::Lstm(s) => s.reorder(index),
        }
    }
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
    /// The Transformer's parameters under `p`: `encoder.embed_tokens.weight` (shared) or also
    /// `decoder.embed_tokens.weight`, then the stack's; or the LSTM's ([`AttentionalLstm::new`]).
    pub fn new(p: &nn::Path, cfg: Seq2SeqConfig) -> Result<Self> {
        if cfg.vocab <= cfg.pad || cfg.pad < 0 || cfg.max_positions < 1 {
            return Err(Error::Config(format!(
                "vocab {} must exceed pad {} >= 0; max_positions {} >= 1",
                cfg.vocab, cfg.pad, cfg.max_positions
            )));
        }
        let body = match (&cfg.transformer, &cfg.lstm) {
            (Some(t), None) => {
                let e = t.embed_dim;
                let embedding = |side: &str| {
                    let w =
                        (p / side / "embed_tokens").var("weight", &[cfg.vocab, e], Init::Randn { mean: 0.0, stdev: (e as f64).powf(-0.5) });
                    tch::no_grad(|| {
                        let _ = w.get(cfg.pad).zero_();
                    });
                    w
                };
                let src_embed = embedding("encoder");
                let tgt_embed = if cfg.share_all_embeddings { src_embed.shallow_clone() } else { embedding("decoder") };
                let stack = Transformer::new(p, t.clone())?;
                let positions = sinusoids(cfg.max_positions + cfg.pad + 1, e, cfg.pad, p.device());
                Body::Transformer(TransformerBody { src_embed, tgt_embed, positions, stack })
            }
            (None, Some(l)) => {
                if cfg.share_all_embeddings {
                    return Err(Error::Config(
                        "the attentional LSTM has its own source and target embeddings and generator: share_all_embeddings must be false"
                            .into(),
                    ));
                }
                Body::Lstm(AttentionalLstm::new(p, l.clone(), cfg.vocab, cfg.pad)?)
            }
            _ => return Err(Error::Config("a translation model's config has exactly one of `transformer` and `lstm`".into())),
        };
        Ok(Self { cfg, body })
    }

    pub fn config(&self) -> &Seq2SeqConfig {
        &self.cfg
    }

    /// The Transformer stack (`None` for the LSTM): its modules, for the repulsive hook and the
    /// encoder's diagnostics.
    pub fn transformer(&self) -> Option<&Transformer> {
        match &self.body {
            Body::Transformer(t) => Some(&t.stack),
            Body::Lstm(_) => None,
        }
    }

    /// `tokens (B, S)` int64 → `(B, S, E)`: `sqrt(E)·embed + position`, positions counted from
    /// `pad + 1 + offset` for non-padding tokens (padding gets the zero row), then dropout.
    fn embed(&self, t: &TransformerBody, table: &Tensor, tokens: &Tensor, offset: i64, train: bool) -> Result<Tensor> {
        let cfg = t.stack.config();
        let (len, e) = (tokens.size()[1], cfg.embed_dim);
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
            + Tensor::embedding(&t.positions, &pos, self.cfg.pad, false, false); // (B, S, E)
        Ok(x.dropout(cfg.dropout, train))
    }

    /// Teacher-forced logits `(B, T, V)` of `prev_tokens (B, T)` (the target shifted right, starting
    /// with the begin token) given `src (B, S)`; and the KL term of stochastic attention.
    pub fn forward_t(&self, src: &Tensor, prev_tokens: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        self.check_tokens("src", src)?;
        self.check_tokens("prev_tokens", prev_tokens)?;
        if src.size()[0] != prev_tokens.size()[0] {
            return Err(Error::Shape(format!("src {:?} and prev_tokens {:?} differ in batch size", src.size(), prev_tokens.size())));
        }
        let t = match &self.body {
            Body::Transformer(t) => t,
            Body::Lstm(l) => return l.forward_t(src, prev_tokens, train),
        };
        let src_pad = src.eq(self.cfg.pad);
        let tgt_pad = prev_tokens.eq(self.cfg.pad);
        let x = self.embed(t, &t.src_embed, src, 0, train)?;
        let y = self.embed(t, &t.tgt_embed, prev_tokens, 0, train)?;
        let out = t.stack.forward_t(&x, Some(&src_pad), &y, Some(&tgt_pad), train)?;
        Ok((out.output.matmul(&t.tgt_embed.transpose(0, 1)), out.kl)) // (B, T, V)
    }

    /// Each encoder layer's self-attention weights `(B, H, S, S)` and per-head outputs
    /// `(B, H, S, d_h)` on `src (B, S)`, in eval mode; empty for the LSTM, whose encoder has no
    /// attention.
    pub fn encoder_attention(&self, src: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
        self.check_tokens("src", src)?;
        let Body::Transformer(t) = &self.body else { return Ok(vec![]) };
        let src_pad = src.eq(self.cfg.pad);
        let x = self.embed(t, &t.src_embed, src, 0, false)?;
        Ok(t.stack.encode_inspect(&x, Some(&src_pad))?.1)
    }

    /// Encodes `src (B, S)` in eval mode and returns the decoding state and the source padding.
    pub fn start(&self, src: &Tensor) -> Result<(DecodingState, Tensor)> {
        self.check_tokens("src", src)?;
        let t = match &self.body {
            Body::Transformer(t) => t,
            Body::Lstm(l) => return l.start(src).map(|(state, pad)| (DecodingState::Lstm(state), pad)),
        };
        let src_pad = src.eq(self.cfg.pad);
        let x = self.embed(t, &t.src_embed, src, 0, false)?;
        let memory = t.stack.encode(&x, Some(&src_pad), false, &mut vec![])?;
        Ok((DecodingState::Transformer(t.stack.start_decoding(&memory)), src_pad))
    }

    /// Token ids as the model takes them: int64 `(B, S)`, each in `0..vocab`. Indexing the
    /// embedding past its end would be libtorch's panic on the CPU. The range is checked on the CPU
    /// only: on CUDA it would cost a device synchronisation every batch, which the training loop
    /// avoids (its ids come from the tokenizer, in range by construction).
    fn check_tokens(&self, name: &str, tokens: &Tensor) -> Result<()> {
        if tokens.kind() != Kind::Int64 || tokens.dim() != 2 {
            return Err(Error::Shape(format!("{name} is {:?}{:?}; token ids are int64 (B, S)", tokens.kind(), tokens.size())));
        }
        if tokens.numel() > 0 && tokens.device() == tch::Device::Cpu {
            let (lo, hi) = (i64::try_from(tokens.min())?, i64::try_from(tokens.max())?);
            if lo < 0 || hi >= self.cfg.vocab {
                return Err(Error::Shape(format!("{name} holds ids {lo}..={hi}, outside the vocabulary of {}", self.cfg.vocab)));
            }
        }
        Ok(())
    }

    /// Log-probabilities `(B, V)` of the next token after `token (B,)` at position `step`
    /// (0 for the begin token), extending `state`. `token` comes from the decoder's own choices
    /// (ids below the vocabulary by construction) and is not checked, to keep each step free of a
    /// device synchronisation.
    pub fn step(&self, token: &Tensor, step: i64, state: &mut DecodingState, src_pad: &Tensor) -> Result<Tensor> {
        match (&self.body, state) {
            (Body::Transformer(t), DecodingState::Transformer(state)) => {
                let y = self.embed(t, &t.tgt_embed, &token.unsqueeze(1), step, false)?; // (B, 1, E)
                let y = t.stack.decode_step(&y, state, Some(src_pad))?;
                let logits = y.squeeze_dim(1).matmul(&t.tgt_embed.transpose(0, 1)); // (B, V)
                Ok(logits.log_softmax(-1, probattn::precision::statistics_kind(logits.kind())))
            }
            (Body::Lstm(l), DecodingState::Lstm(state)) => l.step(token, state, src_pad),
            _ => Err(Error::Config("a decoding state of the other architecture".into())),
        }
    }
}
