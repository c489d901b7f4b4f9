//! The attentional LSTM encoder–decoder of Deng et al. 2018 ("Latent Alignment and Variational
//! Attention", code harvardnlp/var-attn, a fork of OpenNMT-py), the model of the BAM paper's
//! translation table (Fan et al. 2020, Table 4):
//!
//! - a bidirectional LSTM encoder (`encoder_layers` layers, `encoder_hidden` units each way; the
//!   two directions' states concatenated give the memory, `M = 2 · encoder_hidden` wide);
//! - an LSTM decoder (`decoder_layers` layers, `decoder_hidden` units) started from zero states,
//!   as var-attn's `init_decoder_state` does, with **input feeding**: step t reads the target
//!   embedding of token t − 1 concatenated with the previous step's context `c_{t−1}` (`c_0 = 0`);
//! - one attention of the top decoder state `s_t` over the memory, through [`probattn::attend`],
//!   so every row-wise variant applies (softmax and the BAM variants around softmax); the BAM KL
//!   is returned for the loss as the Transformer returns it;
//! - the output `tanh(W_out [c_t; s_t])`, dropout, and a generator `Linear(decoder_hidden, V)`.
//!
//! What differs from var-attn, and why: its score is OpenNMT's `mlp` (additive) attention,
//! `vᵀ tanh(W_c m_j + W_q s_t)`, which is no dot product and so cannot go through
//! [`probattn::attend`]; this model scores with OpenNMT's `general` form, `s_tᵀ W_a m_j` (the
//! query `W_a s_t` against the memory as keys and values; `attend`'s `1/√M` is absorbed in `W_a`).
//! The output layer has no bias, as OpenNMT's for `general`. Initialisation is OpenNMT's: every
//! parameter uniform in `±init_range` (0.1).
//!
//! DNAS is causal here ([`probattn::normalize::dnas_step`]): each key (source position) is
//! normalized over the decoder steps so far, then the step over the keys. DNAS proper would
//! normalize over every step at once, reading the later target tokens, and one step alone gives
//! uniform weights, as the Transformer's cross-attention explains. The decoder carries each key's
//! running logsumexp from step to step (reordered with the beams). HNAS and Sinkhorn are refused.

use probattn::normalize::dnas_step;
use probattn::{attend, scaled_dot_product_scores, AttendOptions, Error, Masks, Mode, Normalizer, NormalizerConfig, Result, Variant};
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init};
use tch::{Kind, Tensor};

/// Sizes and attention of the attentional LSTM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LstmConfig {
    /// Word embedding width, source and target.
    pub embed_dim: i64,
    pub encoder_layers: i64,
    /// Units of each direction of the encoder; the memory is twice as wide.
    pub encoder_hidden: i64,
    pub decoder_layers: i64,
    pub decoder_hidden: i64,
    /// Dropout on the embeddings, between LSTM layers and on the attention output (OpenNMT's one
    /// `-dropout`).
    pub dropout: f64,
    /// Every parameter starts uniform in `±init_range` (OpenNMT's `-param_init`).
    pub init_range: f64,
    /// The attention's normalizer: softmax, causal DNAS (`dnas`) or a BAM variant around softmax.
    pub variant: Variant,
    #[serde(default)]
    pub normalizer: NormalizerConfig,
    /// The memory-efficient attention path, this many queries per tile (one query a step, so
    /// it saves nothing here; kept for parity with the Transformer's flag). `None`: eager.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile: Option<i64>,
}

impl LstmConfig {
    /// Deng et al.'s IWSLT14 model (var-attn's `va.sh`, `train_soft_b6`): embeddings 512, a
    /// 2-layer bidirectional encoder with a 1,024-wide memory (512 each way), a 2-layer decoder of
    /// 768 units, dropout 0.3 (OpenNMT's default), parameters uniform in ±0.1.
    pub fn deng2018() -> Self {
        Self {
            embed_dim: 512,
            encoder_layers: 2,
            encoder_hidden: 512,
            decoder_layers: 2,
            decoder_hidden: 768,
            dropout: 0.3,
            init_range: 0.1,
            variant: Variant::Softmax,
            normalizer: NormalizerConfig::default(),
            tile: None,
        }
    }

    /// [`Self::deng2018`] scaled to Multi30k (29,000 pairs, a sixth of IWSLT14's): every width
    /// halved (embeddings 256, memory 512, decoder 384), depth and dropout kept, as the
    /// Transformer's small preset halves fairseq's IWSLT widths.
    pub fn deng2018_small() -> Self {
        Self { embed_dim: 256, encoder_hidden: 256, decoder_hidden: 384, ..Self::deng2018() }
    }

    /// The memory's width, `2 · encoder_hidden`.
    pub fn memory_dim(&self) -> i64 {
        2 * self.encoder_hidden
    }

    fn validate(&self) -> Result<()> {
        let sizes = [self.embed_dim, self.encoder_layers, self.encoder_hidden, self.decoder_layers, self.decoder_hidden];
        if sizes.iter().any(|&s| s < 1) {
            return Err(Error::Config(format!("every LSTM size must be at least 1, got {self:?}")));
        }
        let valid = (0.0..1.0).contains(&self.dropout) && self.init_range.is_finite() && self.init_range > 0.0;
        if !valid {
            return Err(Error::Config(format!(
                "dropout must lie in [0, 1) and init_range be positive, got {} and {}",
                self.dropout, self.init_range
            )));
        }
        Ok(())
    }
}

/// One LSTM layer's parameters, named as `torch.nn.LSTM`'s layer 0.
#[derive(Debug)]
struct LstmLayer {
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor,
    b_hh: Tensor,
}

impl LstmLayer {
    fn new(p: &nn::Path, input: i64, hidden: i64, init: Init) -> Self {
        Self {
            w_ih: p.var("weight_ih", &[4 * hidden, input], init),
            w_hh: p.var("weight_hh", &[4 * hidden, hidden], init),
            b_ih: p.var("bias_ih", &[4 * hidden], init),
            b_hh: p.var("bias_hh", &[4 * hidden], init),
        }
    }

    /// The whole of `x (B, S, in)` from zero states: `(B, S, hidden)`.
    fn run(&self, x: &Tensor) -> Tensor {
        let hidden = self.w_hh.size()[1];
        let zeros = Tensor::zeros([1, x.size()[0], hidden], (x.kind(), x.device()));
        let params = [&self.w_ih, &self.w_hh, &self.b_ih, &self.b_hh];
        let (out, _, _) = Tensor::lstm(x, &[&zeros, &zeros], &params, true, 1, 0.0, false, false, true);
        out
    }

    /// One step of `x (B, in)` from `(h, c)`.
    fn step(&self, x: &Tensor, h: &Tensor, c: &Tensor) -> (Tensor, Tensor) {
        Tensor::lstm_cell(x, &[h, c], &self.w_ih, &self.w_hh, Some(&self.b_ih), Some(&self.b_hh))
    }
}

/// The decoder's state between steps: each layer's `(h, c)`, the previous context (input
/// feeding), and the memory it attends over.
#[derive(Debug)]
pub struct LstmState {
    h: Vec<Tensor>,
    c: Vec<Tensor>,
    /// `(B, M)`: `c_{t−1}`.
    feed: Tensor,
    /// `(B, S, M)`.
    memory: Tensor,
    /// Causal DNAS: each key's logsumexp of its scores over the steps so far, `(B, S)`; `None`
    /// before the first step and for the other variants.
    carry: Option<Tensor>,
}

impl LstmState {
    /// Keeps the rows `index (B',)`, in that order: beam search's reorder after each step.
    pub fn reorder(&mut self, index: &Tensor) {
        let tensors = self.h.iter_mut().chain(self.c.iter_mut()).chain([&mut self.feed, &mut self.memory]);
        for t in tensors.chain(self.carry.as_mut()) {
            *t = t.index_select(0, index);
        }
    }
}

/// The attentional LSTM: embeddings, encoder, decoder, attention and generator.
#[derive(Debug)]
pub struct AttentionalLstm {
    cfg: LstmConfig,
    vocab: i64,
    pad: i64,
    src_embed: Tensor,
    tgt_embed: Tensor,
    /// Per encoder layer, the forward and the backward direction.
    encoder: Vec<(LstmLayer, LstmLayer)>,
    decoder: Vec<LstmLayer>,
    /// `W_a`: `(M, decoder_hidden)`, the query of `general` attention.
    attn_in: Tensor,
    /// `W_out`: `(decoder_hidden, M + decoder_hidden)`.
    attn_out: Tensor,
    generator: nn::Linear,
    normalizer: Box<dyn Normalizer>,
}

/// Reverses each row of `x (B, S, ·)` within its length `lengths (B,)`, leaving the padding after
/// it in place (an involution): the backward direction then reads each sentence from its last
/// token, with the padding at its end, where it changes nothing that is kept.
fn reverse_within(x: &Tensor, lengths: &Tensor) -> Tensor {
    let (b, s) = (x.size()[0], x.size()[1]);
    let t = Tensor::arange(s, (Kind::Int64, x.device())).unsqueeze(0).expand([b, s], false);
    let len = lengths.unsqueeze(1);
    let index = (&len - 1 - &t).where_self(&t.lt_tensor(&len), &t); // (B, S)
    x.gather(1, &index.unsqueeze(-1).expand_as(x), false)
}

impl AttentionalLstm {
    /// Parameters under `p`: `encoder.embed_tokens`, `encoder.layers.{l}.{forward,backward}`,
    /// `decoder.embed_tokens`, `decoder.layers.{l}`, `decoder.attention.{linear_in,linear_out}`,
    /// the normalizer's under `decoder.attention.normalizer`, and `generator`.
    pub fn new(p: &nn::Path, cfg: LstmConfig, vocab: i64, pad: i64) -> Result<Self> {
        cfg.validate()?;
        if vocab <= pad || pad < 0 {
            return Err(Error::Config(format!("vocab {vocab} must exceed pad {pad} >= 0")));
        }
        let init = Init::Uniform { lo: -cfg.init_range, up: cfg.init_range };
        let (e, m, hd) = (cfg.embed_dim, cfg.memory_dim(), cfg.decoder_hidden);
        let embedding = |p: nn::Path| {
            let w = p.var("weight", &[vocab, e], init);
            tch::no_grad(|| {
                let _ = w.get(pad).zero_();
            });
            w
        };
        let src_embed = embedding(p / "encoder" / "embed_tokens");
        let tgt_embed = embedding(p / "decoder" / "embed_tokens");
        let encoder = (0..cfg.encoder_layers)
            .map(|l| {
                let input = if l == 0 { e } else { m };
                let p = p / "encoder" / "layers" / l;
                (
                    LstmLayer::new(&(&p / "forward"), input, cfg.encoder_hidden, init),
                    LstmLayer::new(&(&p / "backward"), input, cfg.encoder_hidden, init),
                )
            })
            .collect();
        let decoder = (0..cfg.decoder_layers)
            .map(|l| LstmLayer::new(&(p / "decoder" / "layers" / l), if l == 0 { e + m } else { hd }, hd, init))
            .collect();
        let a = p / "decoder" / "attention";
        let attn_in = (&a / "linear_in").var("weight", &[m, hd], init);
        let attn_out = (&a / "linear_out").var("weight", &[hd, m + hd], init);
        let generator = nn::linear(p / "generator", hd, vocab, nn::LinearConfig { ws_init: init, bs_init: Some(init), bias: true });
        let normalizer = cfg.variant.build(&(&a / "normalizer"), 1, m, &cfg.normalizer)?;
        if !normalizer.causal_safe() && cfg.variant != Variant::Dnas {
            return Err(Error::Unsupported(format!(
                "the attentional LSTM attends with one decoder state at a time: {} normalizes each key over the \
                 queries, which over one query gives uniform weights (and over all steps at once would read the \
                 later target tokens); use softmax, dnas (each key normalized over the steps so far) or a BAM \
                 variant around softmax",
                normalizer.name()
            )));
        }
        Ok(Self { cfg, vocab, pad, src_embed, tgt_embed, encoder, decoder, attn_in, attn_out, generator, normalizer })
    }

    pub fn config(&self) -> &LstmConfig {
        &self.cfg
    }

    /// `dnas`: the steps carry each key's logsumexp ([`dnas_step`]) instead of calling the
    /// normalizer.
    fn causal_dnas(&self) -> bool {
        self.cfg.variant == Variant::Dnas
    }

    /// `src (B, S)` → the memory `(B, S, M)`; padded positions hold what the LSTMs computed past
    /// the sentence's end, which the attention masks out.
    pub fn encode(&self, src: &Tensor, train: bool) -> Result<Tensor> {
        let lengths = src.ne(self.pad).sum_dim_intlist(&[1i64][..], false, Kind::Int64); // (B,)
        let mut x = Tensor::embedding(&self.src_embed, src, self.pad, false, false).dropout(self.cfg.dropout, train);
        for (l, (forward, backward)) in self.encoder.iter().enumerate() {
            if l > 0 {
                x = x.dropout(self.cfg.dropout, train);
            }
            let back = reverse_within(&backward.run(&reverse_within(&x, &lengths)), &lengths);
            x = Tensor::cat(&[forward.run(&x), back], 2);
        }
        Ok(x)
    }

    /// The decoder's state before the first step: zero LSTM states and context.
    pub fn start_decoding(&self, memory: Tensor) -> LstmState {
        let (b, opts) = (memory.size()[0], (memory.kind(), memory.device()));
        let zeros = || Tensor::zeros([b, self.cfg.decoder_hidden], opts);
        LstmState {
            h: (0..self.cfg.decoder_layers).map(|_| zeros()).collect(),
            c: (0..self.cfg.decoder_layers).map(|_| zeros()).collect(),
            feed: Tensor::zeros([b, self.cfg.memory_dim()], opts),
            memory,
            carry: None,
        }
    }

    /// One decoder step for `token (B,)`: advances `state` and returns the attention output
    /// `(B, decoder_hidden)` (the generator's input) and the step's KL (stochastic attention
    /// while training). `live (B,)`, when given, marks the
    /// sentences whose step this is (false past a sentence's end): their attention row is left
    /// out of the KL.
    pub fn step_t(
        &self,
        token: &Tensor,
        state: &mut LstmState,
        src_pad: &Tensor,
        live: Option<&Tensor>,
        train: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let emb = Tensor::embedding(&self.tgt_embed, token, self.pad, false, false).dropout(self.cfg.dropout, train);
        let mut x = Tensor::cat(&[emb, state.feed.shallow_clone()], 1);
        for (l, layer) in self.decoder.iter().enumerate() {
            if l > 0 {
                x = x.dropout(self.cfg.dropout, train);
            }
            let (h, c) = layer.step(&x, &state.h[l], &state.c[l]);
            (state.h[l], state.c[l]) = (h.shallow_clone(), c);
            x = h;
        }
        let b = x.size()[0];
        let q = x.matmul(&self.attn_in.tr()).view([b, 1, 1, -1]); // (B, 1, 1, M)
        let kv = state.memory.unsqueeze(1); // (B, 1, S, M)
        let dead = live.map(|l| l.logical_not().view([b, 1]));
        let (context, kl) = if self.causal_dnas() {
            // The scores as `attend` scales them, then one causal DNAS step over the unpadded keys.
            let scores = scaled_dot_product_scores(&q, &kv).view([b, -1]); // (B, S)
            let (weights, carry) = dnas_step(&scores, Some(&src_pad.logical_not()), state.carry.as_ref());
            state.carry = Some(carry);
            let weights = match &dead {
                Some(d) => weights.masked_fill(d, 0.0),
                None => weights,
            };
            (weights.to_kind(kv.kind()).unsqueeze(1).bmm(&state.memory).view([b, -1]), None)
        } else {
            let masks = Masks { key_padding: Some(src_pad), query_padding: dead.as_ref(), ..Default::default() };
            // No weights asked for: softmax takes libtorch's fused kernel, and a tile the memory-efficient path.
            let opts = AttendOptions { mode: Mode::train(train), need_weights: false, tile: self.cfg.tile, ..Default::default() };
            let attended = attend(&q, &kv, &kv, &masks, self.normalizer.as_ref(), opts)?;
            (attended.output.view([b, -1]), attended.kl) // (B, M)
        };
        let out = Tensor::cat(&[context.shallow_clone(), x], 1).matmul(&self.attn_out.tr()).tanh().dropout(self.cfg.dropout, train);
        state.feed = context;
        Ok((out, kl))
    }

    /// Teacher-forced logits `(B, T, V)` of `prev_tokens (B, T)` given `src (B, S)`, and the KL of
    /// stochastic attention: the steps' KL terms weighed by their live sentences (each step's a
    /// mean over its live attention entries).
    pub fn forward_t(&self, src: &Tensor, prev_tokens: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        let src_pad = src.eq(self.pad);
        let mut state = self.start_decoding(self.encode(src, train)?);
        let live = prev_tokens.ne(self.pad); // (B, T)
        let (mut outputs, mut kls) = (vec![], vec![]);
        for t in 0..prev_tokens.size()[1] {
            let live_t = live.select(1, t);
            let (out, kl) = self.step_t(&prev_tokens.select(1, t), &mut state, &src_pad, Some(&live_t), train)?;
            outputs.push(out);
            if let Some(kl) = kl {
                kls.push(kl * live_t.sum(Kind::Float));
            }
        }
        let kl = (!kls.is_empty()).then(|| Tensor::stack(&kls, 0).sum(Kind::Float) / live.sum(Kind::Float).clamp_min(1.0));
        // One generator product over every step rather than one a step.
        Ok((Tensor::stack(&outputs, 1).apply(&self.generator), kl))
    }

    /// Encodes `src (B, S)` in eval mode: the decoding state and the source padding.
    pub fn start(&self, src: &Tensor) -> Result<(LstmState, Tensor)> {
        Ok((self.start_decoding(self.encode(src, false)?), src.eq(self.pad)))
    }

    /// Log-probabilities `(B, V)` of the next token after `token (B,)`, extending `state`.
    pub fn step(&self, token: &Tensor, state: &mut LstmState, src_pad: &Tensor) -> Result<Tensor> {
        let (out, _) = self.step_t(token, state, src_pad, None, false)?;
        let logits = out.apply(&self.generator);
        Ok(logits.log_softmax(-1, probattn::precision::statistics_kind(logits.kind())))
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> i64 {
        self.vocab
    }
}
