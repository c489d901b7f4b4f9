//! `probattn compare`: a TorchScript module and the native probattn model holding the same
//! weights, on the same inputs: the largest differences of every output (and, with
//! `--backward`, of every gradient) and the median time per call of each side.
//!
//! `--native mha` pairs with `torch.nn.MultiheadAttention` (scripted or traced): its forward
//! arguments come from `--inputs IN.safetensors` by name (`query`, `key`, `value`, optional
//! boolean `key_padding_mask (N, S)` with `true` = ignored), in the module's layout, or are drawn
//! from `--seed`. The layout (`batch_first`) is not stored in a traced module, so by default it is
//! found by calling the native model both ways on the first call and keeping the one that agrees;
//! `--batch-first true|false` fixes it. PyTorch returns the attention weights averaged over heads;
//! the native per-head weights are averaged the same way before the comparison.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::{Args, ValueEnum};
use probattn::interop::{import_params, TorchScript};
use probattn::{check_finite, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention, Variant};
use serde::Serialize;
use tch::{nn, Device, IValue, Kind, Tensor};

use crate::common::CommonArgs;

/// `--native`: which probattn model to pair with the TorchScript module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum NativeModel {
    /// `MultiHeadAttention`, for `torch.nn.MultiheadAttention` (and python/probattn_torch's).
    Mha,
}

/// `--batch-first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BatchFirst {
    /// Found on the first call: the layout under which the native model agrees.
    Auto,
    True,
    False,
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DType {
    /// The inputs' dtype (float32 for random inputs); the module is cast to it.
    Inputs,
    Float32,
    Float64,
}

/// Flags of `probattn compare`.
#[derive(Args, Debug)]
pub struct CompareArgs {
    /// The TorchScript module (saved with torch.jit.script(m).save(PATH) or torch.jit.trace).
    #[arg(long)]
    pub torchscript: PathBuf,
    /// The native model that receives the module's weights by name.
    #[arg(long, value_enum)]
    pub native: NativeModel,
    /// Attention heads (mha: not recorded in the weights).
    #[arg(long)]
    pub heads: Option<i64>,
    /// Normalizer of the native model: softmax for torch.nn.MultiheadAttention; dnas, hnas,
    /// sinkhorn-N for python/probattn_torch modules of that variant.
    #[arg(long, default_value = "softmax", value_parser = parse_variant)]
    pub variant: Variant,
    /// safetensors file with the forward arguments by name, in the module's layout (mha: query,
    /// key, value, optional key_padding_mask); without it, random inputs from --seed.
    #[arg(long)]
    pub inputs: Option<PathBuf>,
    /// Seed of the random inputs (without --inputs) and of the backward pass's output gradient.
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
    /// Random inputs: batch size N.
    #[arg(long, default_value_t = 2)]
    pub batch: i64,
    /// Random inputs: query length L.
    #[arg(long, default_value_t = 5)]
    pub tgt_len: i64,
    /// Random inputs: key length S.
    #[arg(long, default_value_t = 7)]
    pub src_len: i64,
    /// The module's input layout: auto (found on the first call), true (N, L, E) or false (L, N, E).
    #[arg(long, value_enum, default_value_t = BatchFirst::Auto)]
    pub batch_first: BatchFirst,
    /// The dtype both sides run in.
    #[arg(long, value_enum, default_value_t = DType::Inputs)]
    pub dtype: DType,
    /// Also compare the gradients of sum(output · G), G drawn from --seed, with respect to the
    /// inputs and every parameter.
    #[arg(long)]
    pub backward: bool,
    /// Timed calls per side (the median is reported), after three warm-up calls.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Print the result as JSON: {"outputs": [{"name", "max_abs_diff", "max_rel_diff"}],
    /// "torchscript_ms", "native_ms", ...}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

fn parse_variant(s: &str) -> std::result::Result<Variant, String> {
    s.parse().map_err(|e: probattn::Error| e.to_string())
}

/// One compared tensor.
#[derive(Debug, Serialize)]
pub struct Difference {
    pub name: String,
    pub max_abs_diff: f64,
    /// `max_abs_diff` over the largest magnitude of the TorchScript side.
    pub max_rel_diff: f64,
}

/// The JSON of `--json`.
#[derive(Debug, Serialize)]
pub struct Comparison {
    pub outputs: Vec<Difference>,
    pub torchscript_ms: f64,
    pub native_ms: f64,
    pub native: String,
    pub variant: String,
    pub batch_first: bool,
    pub dtype: String,
    pub device: String,
    pub threads: i32,
    pub repeats: u32,
}

fn difference(name: &str, reference: &Tensor, ours: &Tensor) -> Result<Difference> {
    ensure!(reference.size() == ours.size(), "{name}: TorchScript gives shape {:?}, probattn {:?}", reference.size(), ours.size());
    let (r, o) = (reference.to_kind(Kind::Double), ours.to_kind(Kind::Double));
    let max_abs_diff = (&r - &o).abs().max().double_value(&[]);
    let scale = r.abs().max().double_value(&[]);
    Ok(Difference { name: name.into(), max_abs_diff, max_rel_diff: if scale > 0.0 { max_abs_diff / scale } else { max_abs_diff } })
}

/// The forward arguments of an `nn.MultiheadAttention` call.
struct MhaArgs {
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Option<Tensor>,
}

impl MhaArgs {
    fn read(args: &CompareArgs, embed_dim: i64, device: Device) -> Result<Self> {
        let Some(path) = &args.inputs else {
            tch::manual_seed(args.seed);
            let (n, l, s, e) = (args.batch, args.tgt_len, args.src_len, embed_dim);
            ensure!(n >= 1 && l >= 1 && s >= 1, "--batch, --tgt-len and --src-len must be at least 1");
            let layout = |len: i64| if args.batch_first == BatchFirst::True { [n, len, e] } else { [len, n, e] };
            let rand = |len| Tensor::randn(layout(len), (Kind::Float, device));
            return Ok(Self { query: rand(l), key: rand(s), value: rand(s), key_padding_mask: None });
        };
        let mut tensors = probattn::io::read_safetensors(path).with_context(|| format!("--inputs {}", path.display()))?;
        let known = ["query", "key", "value", "key_padding_mask"];
        if let Some(other) = tensors.keys().find(|k| !known.contains(&k.as_str())) {
            bail!("--inputs {}: unknown tensor '{other}' (an nn.MultiheadAttention call takes {})", path.display(), known.join(", "));
        }
        let mut take = |name: &str| tensors.remove(name).map(|t| t.to_device(device));
        let need = |t: Option<Tensor>, name: &str| t.with_context(|| format!("--inputs {} has no '{name}'", path.display()));
        let (query, key, value) = (need(take("query"), "query")?, need(take("key"), "key")?, need(take("value"), "value")?);
        let key_padding_mask = take("key_padding_mask");
        for (name, t) in [("query", &query), ("key", &key), ("value", &value)] {
            ensure!(t.dim() == 3, "--inputs: {name} has shape {:?}; nn.MultiheadAttention takes (L, N, E) or, batch_first, (N, L, E)", t.size());
            ensure!(t.is_floating_point(), "--inputs: {name} is {:?}, not a floating-point tensor", t.kind());
            check_finite(name, t)?;
        }
        ensure!(key.size() == value.size(), "--inputs: key {:?} and value {:?} differ in shape", key.size(), value.size());
        if let Some(m) = &key_padding_mask {
            ensure!(m.kind() == Kind::Bool, "--inputs: key_padding_mask is {:?}; it must be bool (true = ignored)", m.kind());
            ensure!(m.dim() == 2, "--inputs: key_padding_mask has shape {:?}, not (N, S)", m.size());
        }
        Ok(Self { query, key, value, key_padding_mask })
    }

    fn to_kind(&mut self, kind: Kind) {
        for t in [&mut self.query, &mut self.key, &mut self.value] {
            *t = t.to_kind(kind);
        }
    }

    fn ivalues(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Vec<IValue> {
        let mut inputs = vec![IValue::Tensor(q.shallow_clone()), IValue::Tensor(k.shallow_clone()), IValue::Tensor(v.shallow_clone())];
        if let Some(m) = &self.key_padding_mask {
            inputs.push(IValue::Tensor(m.shallow_clone()));
        }
        inputs
    }
}

/// The native side: (output in the module's layout, weights averaged over heads `(N, L, S)`).
fn native_mha(mha: &MultiHeadAttention, a: &MhaArgs, q: &Tensor, k: &Tensor, v: &Tensor, batch_first: bool) -> Result<(Tensor, Tensor)> {
    let to_bf = |t: &Tensor| if batch_first { t.shallow_clone() } else { t.transpose(0, 1) };
    let (q, k, v) = (to_bf(q), to_bf(k), to_bf(v));
    let masks = Masks { key_padding: a.key_padding_mask.as_ref(), ..Default::default() };
    let input = MhaInput::new(&q, &k, &v).with_masks(masks).with_weights();
    let out = mha.forward_mode(&input, Mode::EVAL)?;
    let weights = out.weights.context("the native model returned no weights")?.mean_dim(1, false, None);
    Ok((to_bf(&out.context), weights))
}

/// The TorchScript side: (output, weights when returned).
fn torchscript_mha(ts: &TorchScript, a: &MhaArgs, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
    let outs = ts.forward_tensors(&a.ivalues(q, k, v))?;
    let mut it = outs.into_iter();
    let (_, output) = it.next().context("the TorchScript module returned no tensor")?;
    Ok((output, it.next().map(|(_, w)| w)))
}

/// Median milliseconds of `repeats` calls of `f` after three warm-ups, synchronizing CUDA.
fn median_ms(device: Device, repeats: u32, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    for _ in 0..3 {
        f()?;
    }
    sync();
    let mut times = Vec::with_capacity(repeats as usize);
    for _ in 0..repeats {
        let start = Instant::now();
        f()?;
        sync();
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn compare_mha(args: &CompareArgs, device: Device) -> Result<Comparison> {
    let mut ts = TorchScript::load(&args.torchscript, device)?;
    let params = ts.named_parameters()?;
    let shape_of = |name: &str| params.iter().find(|(n, _)| n == name).map(|(_, t)| t.size());
    let (embed_dim, kdim, vdim) = match (shape_of("in_proj_weight"), shape_of("q_proj_weight"), shape_of("k_proj_weight"), shape_of("v_proj_weight")) {
        (Some(w), _, _, _) => (w[1], None, None),
        (None, Some(q), Some(k), Some(v)) => (q[0], Some(k[1]), Some(v[1])),
        _ => bail!(
            "{}: no in_proj_weight (or q/k/v_proj_weight) among its parameters ({}): not an nn.MultiheadAttention",
            args.torchscript.display(),
            params.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
        ),
    };
    let heads = args.heads.context("--native mha needs --heads (the head count is not stored in the weights)")?;
    ensure!(heads >= 1 && embed_dim % heads == 0, "--heads {heads} does not divide the module's embed_dim {embed_dim}");
    let mut a = MhaArgs::read(args, embed_dim, device)?;
    ensure!(a.query.size()[2] == embed_dim, "--inputs: query has {} features, the module's embed_dim is {embed_dim}", a.query.size()[2]);
    let kind = match args.dtype {
        DType::Inputs => a.query.kind(),
        DType::Float32 => Kind::Float,
        DType::Float64 => Kind::Double,
    };
    let saved_kind = params.iter().map(|(_, t)| t.kind()).next().unwrap_or(kind);
    a.to_kind(kind);
    ts.to_kind(kind);
    let params = ts.named_parameters()?;
    let recast = |e: anyhow::Error| {
        if saved_kind == kind {
            e
        } else {
            e.context(format!(
                "the module was saved in {saved_kind:?} and cast to {kind:?}: a traced module keeps the dtype it was traced in, so trace it in {kind:?} instead"
            ))
        }
    };

    let mut vs = nn::VarStore::new(device);
    let mut cfg = MhaConfig::new(embed_dim, heads).with_variant(args.variant);
    cfg.kdim = kdim;
    cfg.vdim = vdim;
    cfg.bias = params.iter().any(|(n, _)| n == "in_proj_bias");
    let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
    if kind == Kind::Double {
        vs.double();
    }
    import_params(&vs, &params, |n| Some(n.to_string()), false).context("loading the module's weights into the native model")?;

    // Forward: find the layout, then compare outputs and weights.
    let (q, k, v) = (&a.query, &a.key, &a.value);
    let (ts_out, ts_weights) = tch::no_grad(|| torchscript_mha(&ts, &a, q, k, v)).map_err(recast)?;
    let candidates: Vec<bool> = match args.batch_first {
        BatchFirst::Auto => vec![false, true],
        BatchFirst::True => vec![true],
        BatchFirst::False => vec![false],
    };
    let mut best: Option<(bool, f64, Tensor, Tensor)> = None;
    for bf in candidates {
        let Ok((out, w)) = tch::no_grad(|| native_mha(&mha, &a, q, k, v, bf)) else { continue };
        if out.size() != ts_out.size() {
            continue;
        }
        let d = difference("output", &ts_out, &out)?.max_abs_diff;
        if best.as_ref().map_or(true, |b| d < b.1) {
            best = Some((bf, d, out, w));
        }
    }
    let (batch_first, _, out, weights) = best.with_context(|| format!("the native model's output never has the module's shape {:?}", ts_out.size()))?;
    let mut outputs = vec![difference("output", &ts_out, &out)?];
    if let Some(w) = &ts_weights {
        outputs.push(difference("weights", w, &weights)?);
    }

    if args.backward {
        tch::manual_seed(args.seed + 1);
        let g = Tensor::randn(ts_out.size(), (kind, device));
        let leaf = |t: &Tensor| t.detach().set_requires_grad(true);
        let (tq, tk, tv) = (leaf(q), leaf(k), leaf(v));
        let (o, _) = torchscript_mha(&ts, &a, &tq, &tk, &tv)?;
        (o * &g).sum(Kind::Double).backward();
        let (nq, nk, nv) = (leaf(q), leaf(k), leaf(v));
        let (o, _) = native_mha(&mha, &a, &nq, &nk, &nv, batch_first)?;
        (o * &g).sum(Kind::Double).backward();
        for (name, t, n) in [("query", &tq, &nq), ("key", &tk, &nk), ("value", &tv, &nv)] {
            outputs.push(difference(&format!("grad.{name}"), &t.grad(), &n.grad())?);
        }
        let native: std::collections::HashMap<String, Tensor> = vs.variables().into_iter().collect();
        for (name, p) in &params {
            let ours = native.get(name).with_context(|| format!("no native parameter {name}"))?;
            ensure!(p.grad().defined(), "the TorchScript module's {name} got no gradient (saved without requires_grad?)");
            outputs.push(difference(&format!("grad.{name}"), &p.grad(), &ours.grad())?);
        }
    }

    let torchscript_ms = tch::no_grad(|| median_ms(device, args.repeats, || torchscript_mha(&ts, &a, q, k, v).map(drop)))?;
    let native_ms = tch::no_grad(|| median_ms(device, args.repeats, || native_mha(&mha, &a, q, k, v, batch_first).map(drop)))?;
    Ok(Comparison {
        outputs,
        torchscript_ms,
        native_ms,
        native: "mha".into(),
        variant: args.variant.to_string(),
        batch_first,
        dtype: format!("{kind:?}").to_lowercase(),
        device: probattn::device::device_name(device),
        threads: tch::get_num_threads(),
        repeats: args.repeats,
    })
}

pub fn run(args: &CompareArgs) -> Result<()> {
    let device = args.common.setup()?;
    let c = match args.native {
        NativeModel::Mha => compare_mha(args, device)?,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&c)?);
        return Ok(());
    }
    println!(
        "{} vs probattn {} ({}, batch_first {}, {}, {}, {} threads)",
        args.torchscript.display(),
        c.native,
        c.variant,
        c.batch_first,
        c.dtype,
        c.device,
        c.threads
    );
    let rows: Vec<Vec<String>> = c.outputs.iter().map(|d| vec![d.name.clone(), format!("{:.3e}", d.max_abs_diff), format!("{:.3e}", d.max_rel_diff)]).collect();
    println!("{}", crate::report::markdown_table(&["tensor", "max abs diff", "max rel diff"], &rows));
    println!("time per call (median of {}): TorchScript {:.3} ms, probattn {:.3} ms (ratio {:.2})", c.repeats, c.torchscript_ms, c.native_ms, c.native_ms / c.torchscript_ms);
    Ok(())
}
