//! `probattn compare`: a TorchScript module (`--torchscript`) or an AOTInductor package
//! (`--pt2`) and the native probattn model holding the same weights, on the same inputs: the
//! largest differences of every output (and, with `--backward`, of every gradient: TorchScript
//! only, a package has no backward) and the median time per call of each side.
//!
//! A package takes tensors only, in the order its exported program takes them (python/
//! probattn_tools/export/pt2.py: query, key, value, key_padding_mask for attention; src, tgt, src_key_padding_mask,
//! tgt_key_padding_mask for nn.Transformer, its causal mask built inside), at the shapes and dtype
//! it was exported with; its weights come from the package itself, under their state_dict names.
//!
//! `--native mha` pairs with `torch.nn.MultiheadAttention` (scripted or traced): its forward
//! arguments come from `--inputs IN.safetensors` by name (`query`, `key`, `value`, optional
//! boolean `key_padding_mask (N, S)` with `true` = ignored), in the module's layout, or are drawn
//! from `--seed`. The layout (`batch_first`) is not stored in a traced module, so by default it is
//! found by calling the native model both ways on the first call and keeping the one that agrees;
//! `--batch-first true|false` fixes it. PyTorch returns the attention weights averaged over heads;
//! the native per-head weights are averaged the same way before the comparison.

use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use probattn::interop::{import_params, Pt2Package, TorchScript};
use probattn_models::transformer::pytorch_renamer;
use probattn_models::translation::baseline_name;

use serde::Serialize;
use tch::{nn, Device, IValue, Kind, Tensor};

use pairs::{compare_greedy, gat_pair, mha_pair, transformer_pair, translation_pair, TranslationPair};

mod args;
mod pairs;

pub use args::{BatchFirst, CompareArgs, DType, NativeModel};

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
    /// The PyTorch side's median milliseconds per call (the name predates `--pt2`; it is the
    /// package's time when `reference` is "pt2").
    pub torchscript_ms: f64,
    pub native_ms: f64,
    /// What the PyTorch side was: "torchscript" or "pt2".
    pub reference: String,
    pub native: String,
    pub variant: String,
    pub batch_first: bool,
    pub dtype: String,
    pub device: String,
    pub threads: i32,
    pub repeats: u32,
    /// Weights the native model kept its own values for (--allow-partial), and module parameters
    /// it had no place for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_imported: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub greedy: Option<GreedyReport>,
}

/// `--greedy-file`: both models' greedy translations of the same sentences.
#[derive(Debug, Serialize)]
pub struct GreedyReport {
    pub sentences: usize,
    /// Translations identical token for token.
    pub identical: usize,
    /// The first sentence (0-based line) whose translations differ.
    pub first_difference: Option<usize>,
    /// TorchScript side: each step re-runs the model over the prefix (the module has no cache).
    pub torchscript_sentences_per_second: f64,
    /// Native side: incremental decoding with the key/value cache.
    pub native_sentences_per_second: f64,
}

/// The PyTorch side of a comparison.
enum Reference {
    Script(TorchScript),
    Pt2(Pt2Package),
}

impl Reference {
    fn load(args: &CompareArgs, device: Device) -> Result<Self> {
        Ok(match (&args.torchscript, &args.pt2) {
            (Some(path), None) => Reference::Script(TorchScript::load(path, device)?),
            (None, Some(path)) => Reference::Pt2(Pt2Package::load(path, device)?),
            _ => bail!("give one of --torchscript and --pt2"),
        })
    }

    /// Weights by PyTorch name: a module's parameters, a package's constants.
    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(match self {
            Reference::Script(ts) => ts.named_parameters()?,
            Reference::Pt2(p) => p.named_constants()?,
        })
    }

    /// Calls forward. A package takes tensors only: the tensors among `inputs`, in order (a
    /// `None` is an input the package was exported without).
    fn forward_tensors(&self, inputs: &[IValue]) -> Result<Vec<(usize, Tensor)>> {
        match self {
            Reference::Script(ts) => Ok(ts.forward_tensors(inputs)?),
            Reference::Pt2(p) => {
                let mut tensors = vec![];
                for v in inputs {
                    match v {
                        IValue::Tensor(t) => tensors.push(t),
                        IValue::None => {}
                        _ => bail!("{}: a .pt2 package takes tensors only", p.path().display()),
                    }
                }
                Ok(p.run(&tensors)?.into_iter().enumerate().collect())
            }
        }
    }

    /// Casts a TorchScript module; a package runs in the dtype it was exported in.
    fn cast(&mut self, kind: Kind, saved: Kind) -> Result<()> {
        match self {
            Reference::Script(ts) => ts.to_kind(kind),
            Reference::Pt2(p) => ensure!(
                kind == saved,
                "{}: a .pt2 package runs in the dtype it was exported in ({saved:?}), not {kind:?}: export it again with --dtype",
                p.path().display()
            ),
        }
        Ok(())
    }
}

fn difference(name: &str, reference: &Tensor, ours: &Tensor) -> Result<Difference> {
    ensure!(reference.size() == ours.size(), "{name}: TorchScript gives shape {:?}, probattn {:?}", reference.size(), ours.size());
    if reference.numel() == 0 {
        // Empty inputs give empty outputs, which agree; max() of nothing would be an error.
        return Ok(Difference { name: name.into(), max_abs_diff: 0.0, max_rel_diff: 0.0 });
    }
    let (r, o) = (reference.to_kind(Kind::Double), ours.to_kind(Kind::Double));
    let max_abs_diff = (&r - &o).abs().max().double_value(&[]);
    let scale = r.abs().max().double_value(&[]);
    Ok(Difference { name: name.into(), max_abs_diff, max_rel_diff: if scale > 0.0 { max_abs_diff / scale } else { max_abs_diff } })
}

/// A PyTorch module (TorchScript or a package) and a native model with its weights, called on
/// the same inputs.
trait Pair {
    /// The forward arguments that are differentiated (`query`, `key`, `value`; `src`, `tgt`).
    fn inputs(&self) -> Vec<(&'static str, Tensor)>;
    /// The module's named outputs on `xs` (the first is the one the backward pass weighs).
    fn torchscript(&self, ts: &Reference, xs: &[Tensor]) -> Result<Vec<(&'static str, Tensor)>>;
    /// The native model's, in the module's layout.
    fn native(&self, xs: &[Tensor], batch_first: bool) -> Result<Vec<(&'static str, Tensor)>>;
    /// The layout when the pair has only one (token-id models are batch-first).
    fn fixed_layout(&self) -> Option<bool> {
        None
    }
    /// Multiplies the first output of both sides before they are compared and weighed (1 where
    /// a position counts); `None`: all count.
    fn keep(&self, _batch_first: bool, _kind: Kind) -> Option<Tensor> {
        None
    }
}

/// A shared pair is a pair (the translation pair is also needed after the comparison, for
/// --greedy-file).
impl<P: Pair> Pair for std::rc::Rc<P> {
    fn inputs(&self) -> Vec<(&'static str, Tensor)> {
        (**self).inputs()
    }
    fn torchscript(&self, ts: &Reference, xs: &[Tensor]) -> Result<Vec<(&'static str, Tensor)>> {
        (**self).torchscript(ts, xs)
    }
    fn native(&self, xs: &[Tensor], batch_first: bool) -> Result<Vec<(&'static str, Tensor)>> {
        (**self).native(xs, batch_first)
    }
    fn fixed_layout(&self) -> Option<bool> {
        (**self).fixed_layout()
    }
    fn keep(&self, batch_first: bool, kind: Kind) -> Option<Tensor> {
        (**self).keep(batch_first, kind)
    }
}

/// `output · keep` when there is a mask.
fn kept(t: &Tensor, keep: &Option<Tensor>) -> Tensor {
    match keep {
        Some(k) => t * k,
        None => t.shallow_clone(),
    }
}

/// Maps a module's parameter name to ours (`None`: skip it).
type Renamer = Box<dyn Fn(&str) -> Option<String>>;

/// The module's parameter name → ours, per native model.
fn renamer(native: NativeModel, vs: &nn::VarStore) -> Renamer {
    match native {
        NativeModel::Mha => Box::new(|n: &str| Some(n.to_string())),
        NativeModel::Transformer => Box::new(pytorch_renamer(vs)),
        NativeModel::Gat => Box::new(|n: &str| Some(n.replacen("l1.", "layer1.", 1).replacen("l2.", "layer2.", 1))),
        NativeModel::Translation => {
            let ours: std::collections::HashMap<String, String> =
                vs.variables().into_keys().filter_map(|n| baseline_name(&n).map(|b| (b, n))).collect();
            Box::new(move |b: &str| Some(ours.get(b).cloned().unwrap_or_else(|| b.to_string())))
        }
    }
}

/// Median milliseconds per call of `a` and of `b`: three warm-up calls each, then `repeats`
/// rounds that time one call of each, alternating which goes first, so that drift in the
/// machine's speed (another process, frequency, allocator state) falls on both sides alike.
/// CUDA is synchronized around every timed call.
fn paired_median_ms(
    device: Device,
    repeats: u32,
    mut a: impl FnMut() -> Result<()>,
    mut b: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    for _ in 0..3 {
        a()?;
        b()?;
    }
    sync();
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let start = Instant::now();
        f()?;
        sync();
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    let (mut ta, mut tb) = (Vec::with_capacity(repeats as usize), Vec::with_capacity(repeats as usize));
    for round in 0..repeats {
        if round % 2 == 0 {
            ta.push(time(&mut a)?);
            tb.push(time(&mut b)?);
        } else {
            tb.push(time(&mut b)?);
            ta.push(time(&mut a)?);
        }
    }
    let median = |mut t: Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    Ok((median(ta), median(tb)))
}

/// A pair, and the translation pair itself when it is one.
type BuiltPair = (Box<dyn Pair>, Option<std::rc::Rc<TranslationPair>>);

/// The native model paired with the module, by `--native`; a translation pair is also returned
/// as itself, for `--greedy-file`.
fn build_pair(args: &CompareArgs, saved: &[(String, Tensor)], vs: &nn::VarStore, device: Device) -> Result<BuiltPair> {
    Ok(match args.native {
        NativeModel::Mha => (Box::new(mha_pair(args, saved, vs, device)?), None),
        NativeModel::Transformer => (Box::new(transformer_pair(args, saved, vs, device)?), None),
        NativeModel::Gat => (Box::new(gat_pair(args, saved, vs, device)?), None),
        NativeModel::Translation => {
            let p = std::rc::Rc::new(translation_pair(args, saved, vs, device)?);
            (Box::new(p.clone()), Some(p))
        }
    })
}

/// Named tensors, as a module's parameters come.
type Params = Vec<(String, Tensor)>;

/// The module's weights (as cast) loaded into the native model: the weights, and the names that
/// were not imported (with `--allow-partial`, which says so).
fn import_weights(args: &CompareArgs, ts: &Reference, vs: &nn::VarStore) -> Result<(Params, Vec<String>)> {
    let params = ts.named_parameters()?;
    let report = import_params(vs, &params, renamer(args.native, vs), args.allow_partial)
        .context("loading the module's weights into the native model")?;
    if !report.is_complete() {
        eprintln!("--allow-partial: imported what fits:\n{}", report.summary());
    }
    let not_imported: Vec<String> =
        report.missing.iter().chain(&report.unexpected).chain(report.wrong_shape.iter().map(|w| &w.0)).cloned().collect();
    Ok((params, not_imported))
}

fn compare(args: &CompareArgs, device: Device) -> Result<Comparison> {
    let is_pt2 = args.pt2.is_some();
    ensure!(
        !(is_pt2 && args.backward),
        "--backward needs --torchscript: a .pt2 package runs forward only (AOTInductor compiles no backward)"
    );
    ensure!(!(is_pt2 && args.greedy_file.is_some()), "--greedy-file needs --torchscript: a .pt2 package runs only at its exported shapes");
    let mut ts = Reference::load(args, device)?;
    let saved = ts.named_parameters()?;
    let mut vs = nn::VarStore::new(device);
    if args.inputs.is_none() {
        tch::manual_seed(args.seed);
    }
    let (pair, translation) = build_pair(args, &saved, &vs, device)?;
    let saved_kind = saved.first().map_or(Kind::Float, |(_, t)| t.kind());
    let kind = match args.dtype {
        DType::Inputs => pair.inputs().first().map_or(saved_kind, |(_, t)| t.kind()),
        DType::Float32 => Kind::Float,
        DType::Float64 => Kind::Double,
    };
    ts.cast(kind, saved_kind)?;
    if kind == Kind::Double {
        vs.double();
    }
    let (params, not_imported) = import_weights(args, &ts, &vs)?;
    let xs: Vec<Tensor> = pair.inputs().into_iter().map(|(_, t)| t.to_kind(kind)).collect();
    let recast = |e: anyhow::Error| {
        if saved_kind == kind {
            e
        } else {
            e.context(format!(
                "the module was saved in {saved_kind:?} and cast to {kind:?}: a traced module keeps the dtype it was traced in, so trace it in {kind:?} instead"
            ))
        }
    };

    // Forward: find the layout, then compare every output.
    let reference = tch::no_grad(|| pair.torchscript(&ts, &xs)).map_err(recast)?;
    let (batch_first, ours) = best_layout(pair.as_ref(), args, &xs, &reference, kind)?;
    let keep = pair.keep(batch_first, kind);
    let mut outputs = vec![];
    for (i, ((name, r), (_, o))) in reference.iter().zip(&ours).enumerate() {
        outputs.push(if i == 0 { difference(name, &kept(r, &keep), &kept(o, &keep))? } else { difference(name, r, o)? });
    }

    if args.backward {
        let shape = reference[0].1.size();
        outputs.extend(gradient_differences(args, pair.as_ref(), &ts, &vs, &params, &xs, (batch_first, kind, &shape))?);
    }

    let (torchscript_ms, native_ms) = tch::no_grad(|| {
        paired_median_ms(device, args.repeats, || pair.torchscript(&ts, &xs).map(drop), || pair.native(&xs, batch_first).map(drop))
    })?;
    let greedy = match (&args.greedy_file, &translation) {
        (Some(file), Some(t)) => Some(compare_greedy(args, t, &ts, file, device)?),
        (Some(_), None) => bail!("--greedy-file goes with --native translation"),
        _ => None,
    };
    Ok(Comparison {
        outputs,
        torchscript_ms,
        native_ms,
        reference: if is_pt2 { "pt2" } else { "torchscript" }.into(),
        native: format!("{:?}", args.native).to_lowercase(),
        variant: args.variant.to_string(),
        batch_first,
        dtype: format!("{kind:?}").to_lowercase(),
        device: probattn::device::device_name(device),
        threads: tch::get_num_threads(),
        repeats: args.repeats,
        not_imported,
        greedy,
    })
}

/// The native model's layout (batch-first or not; `--batch-first auto` tries both) whose first
/// output is closest to the module's, with its outputs.
fn best_layout<'a>(
    pair: &'a dyn Pair,
    args: &CompareArgs,
    xs: &[Tensor],
    reference: &[(&str, Tensor)],
    kind: Kind,
) -> Result<(bool, Vec<(&'a str, Tensor)>)> {
    let candidates: Vec<bool> = match (pair.fixed_layout(), args.batch_first) {
        (Some(bf), _) => vec![bf],
        (None, BatchFirst::Auto) => vec![false, true],
        (None, BatchFirst::True) => vec![true],
        (None, BatchFirst::False) => vec![false],
    };
    // (batch_first, output difference, the native outputs) of the best layout so far.
    type Candidate<'a> = (bool, f64, Vec<(&'a str, Tensor)>);
    let mut best: Option<Candidate> = None;
    for bf in candidates {
        let Ok(ours) = tch::no_grad(|| pair.native(xs, bf)) else { continue };
        if ours[0].1.size() != reference[0].1.size() {
            continue;
        }
        let keep = pair.keep(bf, kind);
        let d = difference("output", &kept(&reference[0].1, &keep), &kept(&ours[0].1, &keep))?.max_abs_diff;
        if best.as_ref().map_or(true, |b| d < b.1) {
            best = Some((bf, d, ours));
        }
    }
    let (batch_first, _, ours) =
        best.with_context(|| format!("the native model's output never has the module's shape {:?}", reference[0].1.size()))?;
    Ok((batch_first, ours))
}

/// `--backward`: both sides' gradients of one random projection of the first output, with respect
/// to every input and every imported parameter, compared. `at`: the layout, the dtype and the
/// first output's shape.
fn gradient_differences(
    args: &CompareArgs,
    pair: &dyn Pair,
    ts: &Reference,
    vs: &nn::VarStore,
    params: &[(String, Tensor)],
    xs: &[Tensor],
    (batch_first, kind, shape): (bool, Kind, &[i64]),
) -> Result<Vec<Difference>> {
    let (device, keep, mut outputs) = (vs.device(), pair.keep(batch_first, kind), vec![]);
    tch::manual_seed(args.seed + 1);
    let g = Tensor::randn(shape, (kind, device));
    let leaves = || -> Vec<Tensor> { xs.iter().map(|t| t.detach().set_requires_grad(true)).collect() };
    let (ts_x, our_x) = (leaves(), leaves());
    (kept(&pair.torchscript(ts, &ts_x)?[0].1, &keep) * &g).sum(Kind::Double).backward();
    (kept(&pair.native(&our_x, batch_first)?[0].1, &keep) * &g).sum(Kind::Double).backward();
    for (((name, _), t), o) in pair.inputs().iter().zip(&ts_x).zip(&our_x) {
        outputs.push(difference(&format!("grad.{name}"), &t.grad(), &o.grad())?);
    }
    let rename = renamer(args.native, vs);
    let native: std::collections::HashMap<String, Tensor> = vs.variables().into_iter().collect();
    for (name, p) in params {
        let Some(ours) = rename(name).and_then(|n| native.get(&n)) else { continue }; // not imported (--allow-partial)
        if !p.grad().defined() && !ours.grad().defined() {
            continue; // used by neither forward (BAM's prior outside training)
        }
        ensure!(p.grad().defined(), "the TorchScript module's {name} got no gradient (saved without requires_grad?)");
        ensure!(ours.grad().defined(), "probattn's {name} got no gradient where the TorchScript module's did");
        outputs.push(difference(&format!("grad.{name}"), &p.grad(), &ours.grad())?);
    }
    Ok(outputs)
}

pub fn run(args: &CompareArgs) -> Result<()> {
    let device = args.common.setup()?;
    let c = compare(args, device)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&c)?);
        return Ok(());
    }
    println!(
        "{} vs probattn {} ({}, batch_first {}, {}, {}, {} threads)",
        args.module_path().display(),
        c.native,
        c.variant,
        c.batch_first,
        c.dtype,
        c.device,
        c.threads
    );
    let rows: Vec<Vec<String>> =
        c.outputs.iter().map(|d| vec![d.name.clone(), format!("{:.3e}", d.max_abs_diff), format!("{:.3e}", d.max_rel_diff)]).collect();
    println!("{}", crate::report::markdown_table(&["tensor", "max abs diff", "max rel diff"], &rows));
    let side = if c.reference == "pt2" { "the .pt2 package" } else { "TorchScript" };
    println!(
        "time per call (median of {}): {side} {:.3} ms, probattn {:.3} ms (ratio {:.2})",
        c.repeats,
        c.torchscript_ms,
        c.native_ms,
        c.native_ms / c.torchscript_ms
    );
    if let Some(g) = &c.greedy {
        println!(
            "greedy decoding of {} sentences: {} identical token for token{}; TorchScript (no cache) {:.1} sentences/s, probattn (cached) {:.1}",
            g.sentences,
            g.identical,
            g.first_difference.map_or(String::new(), |i| format!(" (first difference: line {})", i + 1)),
            g.torchscript_sentences_per_second,
            g.native_sentences_per_second
        );
    }
    Ok(())
}
