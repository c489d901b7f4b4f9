//! The pairs `probattn compare` runs: a PyTorch module (TorchScript or `.pt2`) and our native
//! model with its weights, fed the same inputs, for multi-head attention, `nn.Transformer`, the
//! translation baseline (and its greedy translations) and the GAT baseline.

use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use probattn::normalize::{EdgeList, Support};
use probattn::{check_finite, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention};
use probattn_models::gat::{Features, Gat, GatConfig};
use probattn_models::transformer::{config_of_pytorch, Transformer, TransformerConfig};
use probattn_models::translation::{Seq2Seq, Seq2SeqConfig};
use tch::{nn, Device, IValue, Kind, Tensor};

use super::{BatchFirst, CompareArgs, GreedyReport, Pair, Reference};
use crate::seq2seq::data::{EOS, PAD};
use crate::seq2seq::decode::{self, DecodeConfig};

/// Reads `--inputs` (every name in `known`; `required` ones must be there) or returns `None`.
pub(super) fn read_inputs(
    args: &CompareArgs,
    known: &[&str],
    required: &[&str],
    device: Device,
) -> Result<Option<std::collections::HashMap<String, Tensor>>> {
    let Some(path) = &args.inputs else { return Ok(None) };
    let tensors = probattn::io::read_safetensors(path).with_context(|| format!("--inputs {}", path.display()))?;
    if let Some(other) = tensors.keys().find(|k| !known.contains(&k.as_str())) {
        bail!("--inputs {}: unknown tensor '{other}' (the call takes {})", path.display(), known.join(", "));
    }
    for name in required {
        ensure!(tensors.contains_key(*name), "--inputs {} has no '{name}'", path.display());
    }
    for (name, t) in &tensors {
        if name.ends_with("_mask") {
            ensure!(t.kind() == Kind::Bool, "--inputs: {name} is {:?}; it must be bool (true = ignored)", t.kind());
            ensure!(t.dim() == 2, "--inputs: {name} has shape {:?}, not (N, S)", t.size());
        } else {
            ensure!(t.dim() == 3, "--inputs: {name} has shape {:?}; the module takes (L, N, E) or, batch_first, (N, L, E)", t.size());
            ensure!(t.is_floating_point(), "--inputs: {name} is {:?}, not a floating-point tensor", t.kind());
            check_finite(name, t)?;
        }
    }
    Ok(Some(tensors.into_iter().map(|(n, t)| (n, t.to_device(device))).collect()))
}

/// The shape of the module's parameter `name`, which must be a matrix (a module whose parameter of
/// that name has another rank is named, not indexed past its end); `None` when it has none.
fn matrix_shape(args: &CompareArgs, params: &[(String, Tensor)], name: &str) -> Result<Option<Vec<i64>>> {
    let Some((_, t)) = params.iter().find(|(n, _)| n == name) else { return Ok(None) };
    ensure!(t.dim() == 2, "{}: parameter {name} has shape {:?}, expected a matrix", args.module_path().display(), t.size());
    Ok(Some(t.size()))
}

/// Random `(len, N, E)` (or batch-first) inputs from `--seed`.
pub(super) fn random_input(args: &CompareArgs, len: i64, embed_dim: i64, device: Device) -> Tensor {
    let shape = if args.batch_first == BatchFirst::True { [args.batch, len, embed_dim] } else { [len, args.batch, embed_dim] };
    Tensor::randn(shape, (Kind::Float, device))
}

pub(super) fn layout(t: &Tensor, batch_first: bool) -> Tensor {
    if batch_first {
        t.shallow_clone()
    } else {
        t.transpose(0, 1)
    }
}

pub(super) fn tensor_inputs(xs: &[Tensor], extra: impl IntoIterator<Item = IValue>) -> Vec<IValue> {
    xs.iter().map(|t| IValue::Tensor(t.shallow_clone())).chain(extra).collect()
}

/// `torch.nn.MultiheadAttention` and [`MultiHeadAttention`].
pub(super) struct MhaPair {
    mha: MultiHeadAttention,
    inputs: [Tensor; 3],
    key_padding_mask: Option<Tensor>,
}

impl Pair for MhaPair {
    fn inputs(&self) -> Vec<(&'static str, Tensor)> {
        ["query", "key", "value"].into_iter().zip(self.inputs.iter().map(Tensor::shallow_clone)).collect()
    }

    fn torchscript(&self, ts: &Reference, xs: &[Tensor]) -> Result<Vec<(&'static str, Tensor)>> {
        let outs = ts.forward_tensors(&tensor_inputs(xs, self.key_padding_mask.as_ref().map(|m| IValue::Tensor(m.shallow_clone()))))?;
        Ok(["output", "weights"].into_iter().zip(outs.into_iter().map(|(_, t)| t)).collect())
    }

    fn native(&self, xs: &[Tensor], batch_first: bool) -> Result<Vec<(&'static str, Tensor)>> {
        let (q, k, v) = (layout(&xs[0], batch_first), layout(&xs[1], batch_first), layout(&xs[2], batch_first));
        let masks = Masks { key_padding: self.key_padding_mask.as_ref(), ..Default::default() };
        let out = self.mha.forward_mode(&MhaInput::new(&q, &k, &v).with_masks(masks).with_weights(), Mode::EVAL)?;
        // PyTorch averages the weights over heads (average_attn_weights=True).
        let weights = out.weights.context("the native model returned no weights")?.mean_dim(1, false, None);
        Ok(vec![("output", layout(&out.context, batch_first)), ("weights", weights)])
    }
}

pub(super) fn mha_pair(args: &CompareArgs, params: &[(String, Tensor)], vs: &nn::VarStore, device: Device) -> Result<MhaPair> {
    let shape_of = |name: &str| matrix_shape(args, params, name);
    let (embed_dim, kdim, vdim) =
        match (shape_of("in_proj_weight")?, shape_of("q_proj_weight")?, shape_of("k_proj_weight")?, shape_of("v_proj_weight")?) {
            (Some(w), _, _, _) => (w[1], None, None),
            (None, Some(q), Some(k), Some(v)) => (q[0], Some(k[1]), Some(v[1])),
            _ => bail!(
                "{}: no in_proj_weight (or q/k/v_proj_weight) among its parameters ({}): not an nn.MultiheadAttention",
                args.module_path().display(),
                params.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
            ),
        };
    let heads = args.heads.context("--native mha needs --heads (the head count is not stored in the weights)")?;
    ensure!(heads >= 1 && embed_dim % heads == 0, "--heads {heads} does not divide the module's embed_dim {embed_dim}");
    let mut cfg = MhaConfig::new(embed_dim, heads).with_variant(args.variant);
    cfg.kdim = kdim;
    cfg.vdim = vdim;
    cfg.bias = params.iter().any(|(n, _)| n == "in_proj_bias");
    let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
    let known = ["query", "key", "value", "key_padding_mask"];
    let (inputs, key_padding_mask) = match read_inputs(args, &known, &known[..3], device)? {
        Some(mut t) => {
            let mut take = |n: &str| t.remove(n).context(n.to_string());
            ([take("query")?, take("key")?, take("value")?], t.remove("key_padding_mask"))
        }
        None => {
            let (l, s) = (args.tgt_len, args.src_len);
            (
                [
                    random_input(args, l, embed_dim, device),
                    random_input(args, s, kdim.unwrap_or(embed_dim), device),
                    random_input(args, s, vdim.unwrap_or(embed_dim), device),
                ],
                None,
            )
        }
    };
    ensure!(
        inputs[0].size()[2] == embed_dim,
        "--inputs: query has {} features, the module's embed_dim is {embed_dim}",
        inputs[0].size()[2]
    );
    ensure!(
        inputs[1].size()[..2] == inputs[2].size()[..2],
        "--inputs: key {:?} and value {:?} differ in length or batch",
        inputs[1].size(),
        inputs[2].size()
    );
    Ok(MhaPair { mha, inputs, key_padding_mask })
}

/// `torch.nn.Transformer` (post-norm, ReLU, with its final norms) and the native [`Transformer`]
/// (`final_norm`), called as a sequence-to-sequence model is: `tgt_mask` causal, the source's
/// key padding mask also the memory's. Only the target positions that are not padding are
/// compared (our padded query rows are zero; PyTorch's are whatever they attend to, and nothing
/// flows from them into real positions), and the backward pass weighs only those.
pub(super) struct TransformerPair {
    model: Transformer,
    inputs: [Tensor; 2],
    src_pad: Option<Tensor>,
    tgt_pad: Option<Tensor>,
    /// The reading of the module's call that worked (time-first or batch-first), once known.
    reading: std::cell::Cell<Option<bool>>,
}

impl Pair for TransformerPair {
    /// The target padding mask `(N, T)`, in the module's layout, 1 where the position is real.
    fn keep(&self, batch_first: bool, kind: Kind) -> Option<Tensor> {
        self.tgt_pad.as_ref().map(|p| layout(&p.logical_not().to_kind(kind), batch_first).unsqueeze(-1))
    }

    fn inputs(&self) -> Vec<(&'static str, Tensor)> {
        ["src", "tgt"].into_iter().zip(self.inputs.iter().map(Tensor::shallow_clone)).collect()
    }

    fn torchscript(&self, ts: &Reference, xs: &[Tensor]) -> Result<Vec<(&'static str, Tensor)>> {
        if let Reference::Pt2(_) = ts {
            // python/probattn_tools/export/pt2.py's seq2seq wrapper: the causal mask is built inside.
            let pads = [&self.src_pad, &self.tgt_pad].map(|m| m.as_ref().map_or(IValue::None, |m| IValue::Tensor(m.shallow_clone())));
            let outs = ts.forward_tensors(&tensor_inputs(xs, pads))?;
            return Ok(vec![("output", outs.into_iter().next().context("the package returned no tensor")?.1)]);
        }
        // Which dimension is time cannot be told from nn.Transformer's call either: the causal
        // mask is square in the target length, so try the time-first reading, then batch-first
        // (when N = T both give the same mask), and keep the one that worked.
        let mut last = None;
        let readings = match self.reading.get() {
            Some(bf) => vec![bf],
            None => vec![false, true],
        };
        for batch_first in readings {
            let t = xs[1].size()[if batch_first { 1 } else { 0 }];
            let causal = Tensor::ones([t, t], (Kind::Bool, xs[1].device())).triu(1);
            let opt = |m: &Option<Tensor>| m.as_ref().map_or(IValue::None, |m| IValue::Tensor(m.shallow_clone()));
            let extra = [IValue::None, IValue::Tensor(causal), IValue::None, opt(&self.src_pad), opt(&self.tgt_pad), opt(&self.src_pad)];
            match ts.forward_tensors(&tensor_inputs(xs, extra)) {
                Ok(outs) => {
                    self.reading.set(Some(batch_first));
                    return Ok(vec![("output", outs.into_iter().next().context("the TorchScript module returned no tensor")?.1)]);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(|| anyhow::anyhow!("no call"), anyhow::Error::from))
    }

    fn native(&self, xs: &[Tensor], batch_first: bool) -> Result<Vec<(&'static str, Tensor)>> {
        let (src, tgt) = (layout(&xs[0], batch_first), layout(&xs[1], batch_first));
        let out = self.model.forward_t(&src, self.src_pad.as_ref(), &tgt, self.tgt_pad.as_ref(), false)?.output;
        Ok(vec![("output", layout(&out, batch_first))])
    }
}

pub(super) fn transformer_pair(
    args: &CompareArgs,
    params: &[(String, Tensor)],
    vs: &nn::VarStore,
    device: Device,
) -> Result<TransformerPair> {
    let heads = args.heads.context("--native transformer needs --heads (the head count is not stored in the weights)")?;
    let cfg = config_of_pytorch(params, heads, args.variant).with_context(|| args.module_path().display().to_string())?;
    let embed_dim = cfg.embed_dim;
    let model = Transformer::new(&vs.root(), cfg)?;
    let known = ["src", "tgt", "src_key_padding_mask", "tgt_key_padding_mask"];
    let (inputs, src_pad, tgt_pad) = match read_inputs(args, &known, &known[..2], device)? {
        Some(mut t) => {
            let mut take = |n: &str| t.remove(n).context(n.to_string());
            ([take("src")?, take("tgt")?], t.remove("src_key_padding_mask"), t.remove("tgt_key_padding_mask"))
        }
        None => ([random_input(args, args.src_len, embed_dim, device), random_input(args, args.tgt_len, embed_dim, device)], None, None),
    };
    for x in &inputs {
        ensure!(x.size()[2] == embed_dim, "--inputs: src and tgt need {embed_dim} features (the module's d_model), got {:?}", x.size());
    }
    Ok(TransformerPair { model, inputs, src_pad, tgt_pad, reading: std::cell::Cell::new(None) })
}

/// python/probattn_tools/baselines/translate.py's `Seq2Seq` and the native [`Seq2Seq`]: logits `(N, T, V)` of
/// `src (N, S)` and `prev (N, T)` token ids, compared at the real (non-padding) target positions.
pub(super) struct TranslationPair {
    model: Seq2Seq,
    src: Tensor,
    prev: Tensor,
}

impl Pair for TranslationPair {
    fn inputs(&self) -> Vec<(&'static str, Tensor)> {
        vec![]
    }

    fn torchscript(&self, ts: &Reference, _xs: &[Tensor]) -> Result<Vec<(&'static str, Tensor)>> {
        let out = ts.forward_tensors(&[IValue::Tensor(self.src.shallow_clone()), IValue::Tensor(self.prev.shallow_clone())])?;
        Ok(vec![("logits", out.into_iter().next().context("the TorchScript module returned no tensor")?.1)])
    }

    fn native(&self, _xs: &[Tensor], _batch_first: bool) -> Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![("logits", self.model.forward_t(&self.src, &self.prev, false)?.0)])
    }

    fn fixed_layout(&self) -> Option<bool> {
        Some(true)
    }

    fn keep(&self, _batch_first: bool, kind: Kind) -> Option<Tensor> {
        Some(self.prev.ne(PAD).to_kind(kind).unsqueeze(-1))
    }
}

pub(super) fn translation_pair(
    args: &CompareArgs,
    params: &[(String, Tensor)],
    vs: &nn::VarStore,
    device: Device,
) -> Result<TranslationPair> {
    let Some(embed) = matrix_shape(args, params, "embed")? else {
        bail!("{}: no 'embed' parameter: not python/probattn_tools/baselines/translate.py's model", args.module_path().display());
    };
    let (vocab, embed_dim) = (embed[0], embed[1]);
    let count = |side: &str| (0..).take_while(|i| params.iter().any(|(n, _)| n.starts_with(&format!("{side}.{i}.")))).count();
    let ffn_dim = matrix_shape(args, params, "encoder.0.fc1.weight")?.context("no encoder.0.fc1.weight")?[0];
    let heads = args.heads.context("--native translation needs --heads (the head count is not stored in the weights)")?;
    ensure!(heads >= 1 && embed_dim % heads == 0, "--heads {heads} does not divide the model's embed_dim {embed_dim}");
    let transformer = TransformerConfig {
        encoder_layers: count("encoder"),
        decoder_layers: count("decoder"),
        embed_dim,
        heads,
        ffn_dim,
        dropout: 0.0,
        attention_dropout: 0.0,
        variant: args.variant,
        ..TransformerConfig::iwslt()
    };
    let cfg = Seq2SeqConfig {
        transformer: Some(transformer),
        lstm: None,
        vocab,
        pad: PAD,
        share_all_embeddings: true,
        max_positions: args.max_positions,
    };
    let model = Seq2Seq::new(&vs.root(), cfg)?;
    let (src, prev) = match &args.inputs {
        Some(path) => {
            let mut t = probattn::io::read_safetensors(path).with_context(|| format!("--inputs {}", path.display()))?;
            let mut take = |n: &str| {
                t.remove(n).with_context(|| format!("--inputs {} has no '{n}' (token ids, int64 (N, S) and (N, T))", path.display()))
            };
            let (src, prev) = (take("src")?, take("prev")?);
            if let Some(other) = t.keys().next() {
                bail!("--inputs {}: unknown tensor '{other}' (the call takes src, prev)", path.display());
            }
            for (name, x) in [("src", &src), ("prev", &prev)] {
                ensure!(
                    x.kind() == Kind::Int64 && x.dim() == 2,
                    "--inputs: {name} is {:?}{:?}; token ids are int64 (N, length)",
                    x.kind(),
                    x.size()
                );
            }
            (src.to_device(device), prev.to_device(device))
        }
        None => {
            let ids = |len: i64| Tensor::randint_low(4, vocab, [args.batch, len], (Kind::Int64, device));
            let (src, prev) = (ids(args.src_len), ids(args.tgt_len));
            let _ = prev.narrow(1, 0, 1).fill_(EOS);
            let _ = src.narrow(1, args.src_len - 1, 1).fill_(EOS);
            (src, prev)
        }
    };
    for (name, x) in [("src", &src), ("prev", &prev)] {
        ensure!(x.numel() > 0, "--inputs: {name} has shape {:?}: no token ids", x.size());
        let (lo, hi) = (x.min().int64_value(&[]), x.max().int64_value(&[]));
        ensure!(lo >= 0 && hi < vocab, "--inputs: {name} holds ids {lo}..={hi}, outside the vocabulary of {vocab}");
    }
    Ok(TranslationPair { model, src, prev })
}

/// python/probattn_tools/baselines/gat.py's `Gat` and the native [`Gat`]: logits `(N, C)` of dense features
/// `x (N, F)` over the edges `dst <- src` (self-loops included).
pub(super) struct GatPair {
    model: Gat,
    x: Tensor,
    dst: Tensor,
    src: Tensor,
}

impl Pair for GatPair {
    fn inputs(&self) -> Vec<(&'static str, Tensor)> {
        vec![("x", self.x.shallow_clone())]
    }

    fn torchscript(&self, ts: &Reference, xs: &[Tensor]) -> Result<Vec<(&'static str, Tensor)>> {
        let out =
            ts.forward_tensors(&tensor_inputs(xs, [IValue::Tensor(self.dst.shallow_clone()), IValue::Tensor(self.src.shallow_clone())]))?;
        Ok(vec![("logits", out.into_iter().next().context("the TorchScript module returned no tensor")?.1)])
    }

    fn native(&self, xs: &[Tensor], _batch_first: bool) -> Result<Vec<(&'static str, Tensor)>> {
        let n = xs[0].size()[0];
        let support = Support::Edges(EdgeList::new(self.dst.shallow_clone(), self.src.shallow_clone(), n, n)?);
        Ok(vec![("logits", self.model.forward(&Features::Dense(xs[0].shallow_clone()), &support, Mode::EVAL)?.logits)])
    }

    fn fixed_layout(&self) -> Option<bool> {
        Some(true)
    }
}

pub(super) fn gat_pair(args: &CompareArgs, params: &[(String, Tensor)], vs: &nn::VarStore, device: Device) -> Result<GatPair> {
    let size = |name: &str| {
        params.iter().find(|(n, _)| n == name).map(|(_, t)| t.size()).with_context(|| {
            format!("{}: no '{name}' parameter: not python/probattn_tools/baselines/gat.py's model", args.module_path().display())
        })
    };
    let (a1, a2, w1) = (size("l1.att_src")?, size("l2.att_src")?, size("l1.weight")?);
    let cfg = GatConfig { heads: a1[0], hidden: a1[1], output_heads: a2[0], ..GatConfig::transductive(args.variant) };
    let model = Gat::new(&vs.root(), w1[0], a2[1], cfg)?;
    let (x, dst, src) = match &args.inputs {
        Some(path) => {
            let mut t = probattn::io::read_safetensors(path).with_context(|| format!("--inputs {}", path.display()))?;
            let mut take = |n: &str| {
                t.remove(n).with_context(|| format!("--inputs {} has no '{n}' (x (N, F), dst and src int64 (E,))", path.display()))
            };
            let (x, dst, src) = (take("x")?, take("dst")?, take("src")?);
            if let Some(other) = t.keys().next() {
                bail!("--inputs {}: unknown tensor '{other}' (the call takes x, dst, src)", path.display());
            }
            (x.to_device(device), dst.to_device(device), src.to_device(device))
        }
        None => {
            let n = args.batch.max(2) * 10;
            let x = Tensor::randn([n, w1[0]], (Kind::Float, device));
            let nodes = Tensor::arange(n, (Kind::Int64, device));
            let src = Tensor::cat(&[nodes.shallow_clone(), Tensor::randint(n, [3 * n], (Kind::Int64, device))], 0);
            let dst = Tensor::cat(&[nodes.shallow_clone(), nodes.repeat_interleave_self_int(3, None, None)], 0);
            (x, dst, src)
        }
    };
    ensure!(
        x.dim() == 2 && x.size()[1] == w1[0] && x.is_floating_point(),
        "--inputs: x is {:?}{:?}; the model takes floats (N, {})",
        x.kind(),
        x.size(),
        w1[0]
    );
    for (name, t) in [("dst", &dst), ("src", &src)] {
        ensure!(
            t.kind() == Kind::Int64 && t.dim() == 1 && t.size() == dst.size(),
            "--inputs: {name} is {:?}{:?}; edges are int64 (E,), dst and src alike",
            t.kind(),
            t.size()
        );
    }
    check_finite("x", &x)?;
    Ok(GatPair { model, x, dst, src })
}

/// Both models' greedy translations of `--greedy-file`, in the same batches.
pub(super) fn compare_greedy(
    args: &CompareArgs,
    pair: &TranslationPair,
    ts: &Reference,
    file: &std::path::Path,
    device: Device,
) -> Result<GreedyReport> {
    let tok = args.tokenizer.as_deref().context("--greedy-file needs --tokenizer (the run's tokenizer.json)")?;
    let tokenizer = crate::seq2seq::data::load_tokenizer(tok)?;
    let mut lines = crate::seq2seq::data::read_sentences(file).with_context(|| format!("--greedy-file {}", file.display()))?;
    if let Some(n) = args.limit {
        lines.truncate(n);
    }
    let sources: Vec<Vec<i64>> = lines
        .iter()
        .map(|l| {
            let mut ids = crate::seq2seq::data::encode(&tokenizer, l)?;
            ids.push(EOS);
            Ok(ids)
        })
        .collect::<Result<_>>()?;
    // Sorted by length once, so that both sides see the same batches (translate sorts stably).
    let mut order: Vec<usize> = (0..sources.len()).collect();
    order.sort_by_key(|&i| sources[i].len());
    let sorted: Vec<Vec<i64>> = order.iter().map(|&i| sources[i].clone()).collect();
    let cfg = DecodeConfig { beam: 1, lenpen: 1.0, max_len_a: 1.2, max_len_b: 10 };
    let start = Instant::now();
    let ours = decode::translate(&pair.model, &sorted, &cfg, 64, device, |_| {})?;
    let native_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let theirs = tch::no_grad(|| {
        decode::greedy_with(
            |s, p| Ok(ts.forward_tensors(&[IValue::Tensor(s.shallow_clone()), IValue::Tensor(p.shallow_clone())])?.remove(0).1),
            &sorted,
            &cfg,
            64,
            device,
        )
    })?;
    let ts_s = start.elapsed().as_secs_f64();
    let differ: Vec<usize> = (0..sorted.len()).filter(|&k| ours[k] != theirs[k]).map(|k| order[k]).collect();
    Ok(GreedyReport {
        sentences: sorted.len(),
        identical: sorted.len() - differ.len(),
        first_difference: differ.iter().min().copied(),
        torchscript_sentences_per_second: sorted.len() as f64 / ts_s.max(1e-9),
        native_sentences_per_second: sorted.len() as f64 / native_s.max(1e-9),
    })
}
