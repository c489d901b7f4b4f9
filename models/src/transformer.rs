//! The Transformer encoder–decoder stack (Vaswani et al. 2017), post-norm as fairseq's
//! `transformer_iwslt_de_en`: every attention module is a probattn [`MultiHeadAttention`], so any
//! normalizer (softmax, DNAS, BAM, ...) and the repulsive hook apply to it.
//!
//! Encoder layer: `x = LN(x + Drop(SelfAttn(x)))`, `x = LN(x + Drop(FFN(x)))`; decoder layer adds
//! causal self-attention and cross-attention to the encoder output. `FFN(x) = W2 ReLU(W1 x)`.
//! Embeddings, vocabulary and decoding belong to the translation experiment.

use probattn::repulsive::{ModuleKind, RepulsiveHook};
use probattn::{Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention, NormalizerConfig, Result, Variant};
use serde::{Deserialize, Serialize};
use tch::nn::{self, Module};
use tch::Tensor;

/// `torch.nn.Transformer`'s state-dict name of one of our parameters: `encoder.I.` is
/// `encoder.layers.I.`, `encoder_attn` is `multihead_attn`, `fc1`/`fc2` are `linear1`/`linear2`,
/// the layer norms are `norm1`..`norm3` in order, `encoder_norm`/`decoder_norm` are
/// `encoder.norm`/`decoder.norm`. `None` for a parameter nn.Transformer does not have (HNAS's
/// `hybrid_logit`, BAM's prior).
pub fn pytorch_name(ours: &str) -> Option<String> {
    if let Some(rest) = ours.strip_prefix("encoder_norm.") {
        return Some(format!("encoder.norm.{rest}"));
    }
    if let Some(rest) = ours.strip_prefix("decoder_norm.") {
        return Some(format!("decoder.norm.{rest}"));
    }
    let (side, rest) = ours.split_once('.')?;
    let (layer, rest) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (module, param) = rest.split_once('.')?;
    let module = match (side, module) {
        (_, "self_attn") => "self_attn",
        ("decoder", "encoder_attn") => "multihead_attn",
        (_, "fc1") => "linear1",
        (_, "fc2") => "linear2",
        (_, "self_attn_layer_norm") => "norm1",
        ("encoder", "final_layer_norm") => "norm2",
        ("decoder", "encoder_attn_layer_norm") => "norm2",
        ("decoder", "final_layer_norm") => "norm3",
        _ => return None,
    };
    let known = matches!(param, "weight" | "bias" | "in_proj_weight" | "in_proj_bias" | "out_proj.weight" | "out_proj.bias");
    (matches!(side, "encoder" | "decoder") && known).then(|| format!("{side}.layers.{layer}.{module}.{param}"))
}

/// The configuration of a `torch.nn.Transformer` read off its parameters (layers, `d_model`,
/// FFN width, final norms), with `heads` (not recorded in the weights), no dropout and `variant`
/// in the encoder; an error names what is missing when the parameters are not nn.Transformer's.
pub fn config_of_pytorch(params: &[(String, Tensor)], heads: i64, variant: Variant) -> Result<TransformerConfig> {
    let count = |side: &str| (0..).take_while(|i| params.iter().any(|(n, _)| n.starts_with(&format!("{side}.layers.{i}.")))).count();
    let (encoder_layers, decoder_layers) = (count("encoder"), count("decoder"));
    let linear1 = params.iter().find(|(n, _)| n == "encoder.layers.0.linear1.weight").map(|(_, t)| t.size());
    if let Some(size) = linear1.as_ref().filter(|s| s.len() != 2) {
        return Err(probattn::Error::Shape(format!("encoder.layers.0.linear1.weight has shape {size:?}, expected (ffn, d_model)")));
    }
    let Some((ffn_dim, embed_dim)) = linear1.map(|s| (s[0], s[1])) else {
        let some: Vec<&str> = params.iter().take(6).map(|(n, _)| n.as_str()).collect();
        return Err(probattn::Error::Config(format!(
            "no encoder.layers.0.linear1.weight among the parameters ({} ...): not an nn.Transformer",
            some.join(", ")
        )));
    };
    if decoder_layers == 0 {
        return Err(probattn::Error::Config("no decoder.layers.*: an encoder-decoder nn.Transformer is needed".into()));
    }
    if heads < 1 || embed_dim % heads != 0 {
        return Err(probattn::Error::Config(format!("{heads} heads do not divide d_model {embed_dim}")));
    }
    Ok(TransformerConfig {
        encoder_layers,
        decoder_layers,
        embed_dim,
        heads,
        ffn_dim,
        dropout: 0.0,
        attention_dropout: 0.0,
        variant,
        final_norm: params.iter().any(|(n, _)| n == "encoder.norm.weight"),
        ..TransformerConfig::iwslt()
    })
}

/// Maps nn.Transformer's parameter names to those of the variables of `vs` (a [`Transformer`]);
/// a name with no counterpart passes through unchanged, so an import reports it as unexpected.
pub fn pytorch_renamer(vs: &nn::VarStore) -> impl Fn(&str) -> Option<String> {
    let ours: std::collections::HashMap<String, String> =
        vs.variables().into_keys().filter_map(|n| pytorch_name(&n).map(|p| (p, n))).collect();
    move |pt: &str| Some(ours.get(pt).cloned().unwrap_or_else(|| pt.to_string()))
}

/// Sizes and regularization of the stack.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformerConfig {
    pub encoder_layers: usize,
    pub decoder_layers: usize,
    pub embed_dim: i64,
    pub heads: i64,
    pub ffn_dim: i64,
    /// Dropout after attention and FFN blocks.
    pub dropout: f64,
    /// Dropout on attention weights.
    pub attention_dropout: f64,
    /// The normalizer of the encoder self-attention, and of the cross-attention when it
    /// normalizes each query over the keys alone (see [`Self::cross_variant`]); decoder
    /// self-attention is causal and always softmax.
    pub variant: Variant,
    /// The normalizer of the decoder's causal self-attention: any variant that normalizes each
    /// query over the keys alone (its normalizer is causal-safe: softmax, the default; BAM around
    /// softmax; a row-wise variant registered outside the library); doubly normalized variants are
    /// refused (a key normalized over the queries would let later tokens change earlier weights).
    #[serde(default)]
    pub decoder_self_variant: Variant,
    #[serde(default)]
    pub normalizer: NormalizerConfig,
    /// A LayerNorm after the last encoder layer and one after the last decoder layer, as
    /// `torch.nn.Transformer` has (`encoder.norm`, `decoder.norm`); fairseq's post-norm model
    /// has none (default false, and then left out of the JSON).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub final_norm: bool,
    /// Memory-efficient attention in every attention module, this many queries per tile
    /// ([`MhaConfig::tile`]); `None` (default, and then left out of the JSON): eager.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile: Option<i64>,
}

impl TransformerConfig {
    /// fairseq's `transformer_iwslt_de_en` (the repulsive-attention paper's IWSLT14 model):
    /// 6+6 layers, d = 512, FFN 1024, 4 heads, dropout 0.3.
    pub fn iwslt() -> Self {
        Self {
            encoder_layers: 6,
            decoder_layers: 6,
            embed_dim: 512,
            heads: 4,
            ffn_dim: 1024,
            dropout: 0.3,
            attention_dropout: 0.0,
            variant: Variant::Softmax,
            decoder_self_variant: Variant::Softmax,
            normalizer: NormalizerConfig::default(),
            final_norm: false,
            tile: None,
        }
    }

    /// The cross-attention's normalizer: `variant` when it is row-wise (softmax, or BAM around
    /// softmax), else softmax. DNAS, HNAS and Sinkhorn normalize each key over the *queries*,
    /// which in the cross-attention are the target positions: under teacher forcing the weights
    /// of position t would depend on the target tokens after t (a leak of the answer), and an
    /// incremental decoder, which has one query per step, would normalize over that one query
    /// alone (uniform weights). So they act in the encoder self-attention only.
    ///
    /// Asked of the variant's normalizer ([`row_wise`]), so a variant registered outside the
    /// library answers for itself; one that cannot be built here gets softmax, and the encoder,
    /// which builds the same variant, names the error.
    pub fn cross_variant(&self) -> Variant {
        if row_wise(self.variant, &self.normalizer, self.heads, self.embed_dim / self.heads.max(1)).unwrap_or(false) {
            self.variant
        } else {
            Variant::Softmax
        }
    }

    fn attention(&self, variant: Variant) -> MhaConfig {
        let mut cfg = MhaConfig::new(self.embed_dim, self.heads).with_variant(variant);
        cfg.dropout = self.attention_dropout;
        cfg.normalizer = self.normalizer.clone();
        cfg.tile = self.tile;
        cfg
    }
}

#[derive(Debug)]
struct FeedForward {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl FeedForward {
    /// fairseq's initialisation: Xavier-uniform weights, zero biases.
    fn new(p: &nn::Path, cfg: &TransformerConfig) -> Self {
        let linear = |name: &str, i: i64, o: i64| {
            let bound = (6.0 / (i + o) as f64).sqrt();
            let c =
                nn::LinearConfig { ws_init: nn::Init::Uniform { lo: -bound, up: bound }, bs_init: Some(nn::Init::Const(0.0)), bias: true };
            nn::linear(p / name, i, o, c)
        };
        Self { fc1: linear("fc1", cfg.embed_dim, cfg.ffn_dim), fc2: linear("fc2", cfg.ffn_dim, cfg.embed_dim) }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.fc2.forward(&self.fc1.forward(x).relu())
    }
}

fn layer_norm(p: nn::Path, dim: i64) -> nn::LayerNorm {
    nn::layer_norm(p, vec![dim], Default::default())
}

#[derive(Debug)]
pub struct EncoderLayer {
    pub self_attn: MultiHeadAttention,
    ffn: FeedForward,
    norm1: nn::LayerNorm,
    norm2: nn::LayerNorm,
}

#[derive(Debug)]
pub struct DecoderLayer {
    pub self_attn: MultiHeadAttention,
    pub cross_attn: MultiHeadAttention,
    ffn: FeedForward,
    norm1: nn::LayerNorm,
    norm2: nn::LayerNorm,
    norm3: nn::LayerNorm,
}

/// The encoder–decoder stack.
#[derive(Debug)]
pub struct Transformer {
    cfg: TransformerConfig,
    pub encoder: Vec<EncoderLayer>,
    pub decoder: Vec<DecoderLayer>,
    /// `encoder_norm` and `decoder_norm` with [`TransformerConfig::final_norm`].
    final_norms: Option<(nn::LayerNorm, nn::LayerNorm)>,
}

/// The cached keys and values of incremental decoding, per decoder layer, `(B, H, S, d_h)`.
#[derive(Debug)]
pub struct DecoderState {
    /// Cross-attention keys and values of the source, projected once.
    pub cross: Vec<(Tensor, Tensor)>,
    /// Self-attention keys and values of the target tokens so far.
    pub own: Vec<Option<(Tensor, Tensor)>>,
}

impl DecoderState {
    /// Keeps the rows `index (B',)` of every cached tensor, in that order: beam search's reorder
    /// after each step.
    pub fn reorder(&mut self, index: &Tensor) {
        for (k, v) in self.cross.iter_mut().chain(self.own.iter_mut().flatten()) {
            *k = k.index_select(0, index);
            *v = v.index_select(0, index);
        }
    }
}

/// What [`Transformer::forward_t`] returns.
#[derive(Debug)]
pub struct TransformerOutput {
    /// `(B, T, E)` decoder states.
    pub output: Tensor,
    /// The summed KL terms of stochastic attention (BAM), averaged over modules; `None` otherwise.
    pub kl: Option<Tensor>,
}

/// Whether `variant` (with `cfg`) normalizes each query over the keys alone, as its built
/// normalizer says ([`probattn::Normalizer::causal_safe`]): what a causal self-attention and an
/// incremental cross-attention need. Built on a scratch store, so nothing joins the model's.
pub fn row_wise(variant: Variant, cfg: &NormalizerConfig, heads: i64, head_dim: i64) -> Result<bool> {
    let scratch = nn::VarStore::new(tch::Device::Cpu);
    Ok(variant.build(&scratch.root(), heads, head_dim, cfg)?.causal_safe())
}

impl Transformer {
    pub fn new(p: &nn::Path, cfg: TransformerConfig) -> Result<Self> {
        let e = cfg.embed_dim;
        if !row_wise(cfg.decoder_self_variant, &cfg.normalizer, cfg.heads, e / cfg.heads.max(1))? {
            return Err(probattn::Error::Config(format!(
                "the decoder's causal self-attention takes a variant that normalizes each query over the keys alone \
                 (softmax, a BAM variant around softmax), not {}",
                cfg.decoder_self_variant
            )));
        }
        let encoder = (0..cfg.encoder_layers)
            .map(|i| {
                let p = p / "encoder" / i;
                Ok(EncoderLayer {
                    self_attn: MultiHeadAttention::new(&(&p / "self_attn"), cfg.attention(cfg.variant))?,
                    ffn: FeedForward::new(&p, &cfg),
                    norm1: layer_norm(&p / "self_attn_layer_norm", e),
                    norm2: layer_norm(&p / "final_layer_norm", e),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let decoder = (0..cfg.decoder_layers)
            .map(|i| {
                let p = p / "decoder" / i;
                Ok(DecoderLayer {
                    self_attn: MultiHeadAttention::new(&(&p / "self_attn"), cfg.attention(cfg.decoder_self_variant))?,
                    cross_attn: MultiHeadAttention::new(&(&p / "encoder_attn"), cfg.attention(cfg.cross_variant()))?,
                    ffn: FeedForward::new(&p, &cfg),
                    norm1: layer_norm(&p / "self_attn_layer_norm", e),
                    norm2: layer_norm(&p / "encoder_attn_layer_norm", e),
                    norm3: layer_norm(&p / "final_layer_norm", e),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norms = cfg.final_norm.then(|| (layer_norm(p / "encoder_norm", e), layer_norm(p / "decoder_norm", e)));
        Ok(Self { cfg, encoder, decoder, final_norms })
    }

    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    /// `src (B, S, E)` and `tgt (B, T, E)` embedded sequences, padding masks `(B, S)` / `(B, T)`
    /// with `true` = padding.
    pub fn forward_t(
        &self,
        src: &Tensor,
        src_pad: Option<&Tensor>,
        tgt: &Tensor,
        tgt_pad: Option<&Tensor>,
        train: bool,
    ) -> Result<TransformerOutput> {
        let mut kls = vec![];
        let memory = self.encode(src, src_pad, train, &mut kls)?;
        let output = self.decode(tgt, tgt_pad, &memory, src_pad, train, &mut kls)?;
        let kl = (!kls.is_empty()).then(|| Tensor::stack(&kls, 0).mean(kls[0].kind()));
        Ok(TransformerOutput { output, kl })
    }

    /// The encoder: `src (B, S, E)` → memory `(B, S, E)`; KL terms of stochastic attention are
    /// pushed onto `kls`.
    pub fn encode(&self, src: &Tensor, src_pad: Option<&Tensor>, train: bool, kls: &mut Vec<Tensor>) -> Result<Tensor> {
        self.encode_impl(src, src_pad, train, kls, None)
    }

    /// [`Self::encode`] in eval mode that also returns each encoder layer's self-attention weights
    /// `(B, H, S, S)` and per-head outputs `(B, H, S, d_h)`, for diagnostics.
    pub fn encode_inspect(&self, src: &Tensor, src_pad: Option<&Tensor>) -> Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        let mut seen = vec![];
        let x = self.encode_impl(src, src_pad, false, &mut vec![], Some(&mut seen))?;
        Ok((x, seen))
    }

    fn encode_impl(
        &self,
        src: &Tensor,
        src_pad: Option<&Tensor>,
        train: bool,
        kls: &mut Vec<Tensor>,
        mut inspect: Option<&mut Vec<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        let p = self.cfg.dropout;
        let mut x = src.shallow_clone(); // (B, S, E)
        let src_masks = Masks { key_padding: src_pad, query_padding: src_pad, ..Default::default() };
        for layer in &self.encoder {
            let mut input = MhaInput::self_attention(&x).with_masks(src_masks);
            if inspect.is_some() {
                input = input.with_weights().with_head_outputs();
            }
            let a = layer.self_attn.forward_t(&input, train)?;
            kls.extend(a.kl);
            if let (Some(seen), Some(w), Some(h)) = (inspect.as_deref_mut(), a.weights, a.head_outputs) {
                seen.push((w, h));
            }
            x = (&x + a.context.dropout(p, train)).apply(&layer.norm1);
            x = (&x + layer.ffn.forward(&x).dropout(p, train)).apply(&layer.norm2);
        }
        Ok(match &self.final_norms {
            Some((norm, _)) => x.apply(norm),
            None => x,
        })
    }

    /// The decoder over a whole target prefix (teacher forcing): `tgt (B, T, E)` → `(B, T, E)`.
    pub fn decode(
        &self,
        tgt: &Tensor,
        tgt_pad: Option<&Tensor>,
        memory: &Tensor,
        src_pad: Option<&Tensor>,
        train: bool,
        kls: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        let p = self.cfg.dropout;
        let mut y = tgt.shallow_clone(); // (B, T, E)
        let causal = Masks { key_padding: tgt_pad, causal: true, ..Default::default() };
        let cross = Masks { key_padding: src_pad, query_padding: tgt_pad, ..Default::default() };
        for layer in &self.decoder {
            let a = layer.self_attn.forward_t(&MhaInput::self_attention(&y).with_masks(causal), train)?;
            kls.extend(a.kl);
            y = (&y + a.context.dropout(p, train)).apply(&layer.norm1);
            let c = layer.cross_attn.forward_t(&MhaInput::cross_attention(&y, memory).with_masks(cross), train)?;
            kls.extend(c.kl);
            y = (&y + c.context.dropout(p, train)).apply(&layer.norm2);
            y = (&y + layer.ffn.forward(&y).dropout(p, train)).apply(&layer.norm3);
        }
        Ok(self.decoder_norm(y))
    }

    fn decoder_norm(&self, y: Tensor) -> Tensor {
        match &self.final_norms {
            Some((_, norm)) => y.apply(norm),
            None => y,
        }
    }

    /// An empty incremental-decoding state for `memory (B, S, E)`: the cross-attention keys and
    /// values of every layer, projected once.
    pub fn start_decoding(&self, memory: &Tensor) -> DecoderState {
        let cross = self.decoder.iter().map(|l| l.cross_attn.project_kv(memory, memory)).collect();
        DecoderState { cross, own: (0..self.decoder.len()).map(|_| None).collect() }
    }

    /// One decoding step in eval mode: `y (B, 1, E)`, the embedded newest target token, attends
    /// the cached keys and values of the tokens before it (self-attention: no mask is needed, the
    /// cache holds only the past) and the source; appends its own keys and values to `state`.
    /// Costs O(current length) per layer, not a re-run of the prefix. Equals the last position of
    /// [`Self::decode`] on the whole prefix (tested).
    pub fn decode_step(&self, y: &Tensor, state: &mut DecoderState, src_pad: Option<&Tensor>) -> Result<Tensor> {
        let mut y = y.shallow_clone(); // (B, 1, E)
        let cross = Masks { key_padding: src_pad, ..Default::default() };
        for (i, layer) in self.decoder.iter().enumerate() {
            let (k_new, v_new) = layer.self_attn.project_kv(&y, &y); // (B, H, 1, d_h)
            let (k, v) = match state.own[i].take() {
                Some((k, v)) => (Tensor::cat(&[k, k_new], 2), Tensor::cat(&[v, v_new], 2)),
                None => (k_new, v_new),
            };
            let a = layer.self_attn.forward_projected(&MhaInput::self_attention(&y), &k, &v, Mode::EVAL)?;
            state.own[i] = Some((k, v));
            y = (&y + a.context).apply(&layer.norm1);
            let (ck, cv) = &state.cross[i];
            let c = layer.cross_attn.forward_projected(&MhaInput::cross_attention(&y, &y).with_masks(cross), ck, cv, Mode::EVAL)?;
            y = (&y + c.context).apply(&layer.norm2);
            y = (&y + layer.ffn.forward(&y)).apply(&layer.norm3);
        }
        Ok(self.decoder_norm(y))
    }

    /// Registers every attention module with the repulsive hook (its selection decides which
    /// sets it keeps): encoder self-attention, decoder self-attention and cross-attention, by layer.
    pub fn register_repulsive(&self, hook: &mut RepulsiveHook) {
        for (i, layer) in self.encoder.iter().enumerate() {
            hook.add_attention(&format!("encoder.{i}.self_attn"), &layer.self_attn, ModuleKind::EncoderSelf, i);
        }
        for (i, layer) in self.decoder.iter().enumerate() {
            hook.add_attention(&format!("decoder.{i}.self_attn"), &layer.self_attn, ModuleKind::DecoderSelf, i);
            hook.add_attention(&format!("decoder.{i}.encoder_attn"), &layer.cross_attn, ModuleKind::Cross, i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_has_one_nn_transformer_name() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = TransformerConfig {
            encoder_layers: 2,
            decoder_layers: 3,
            embed_dim: 8,
            heads: 2,
            ffn_dim: 16,
            final_norm: true,
            ..TransformerConfig::iwslt()
        };
        Transformer::new(&vs.root(), cfg).unwrap();
        let names: Vec<String> =
            vs.variables().into_keys().map(|n| pytorch_name(&n).unwrap_or_else(|| panic!("{n} has no PyTorch name"))).collect();
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "two parameters share a PyTorch name: {names:?}");
        assert!(unique.contains(&"decoder.layers.2.multihead_attn.out_proj.bias".to_string()));
        assert!(unique.contains(&"encoder.layers.1.norm2.weight".to_string()));
        assert!(unique.contains(&"decoder.norm.bias".to_string()));
        // 2 encoder layers x 12 + 3 decoder layers x 18 + 2 final norms x 2.
        assert_eq!(names.len(), 2 * 12 + 3 * 18 + 4);
        assert_eq!(pytorch_name("encoder.0.self_attn.hybrid_logit"), None);
    }
}
