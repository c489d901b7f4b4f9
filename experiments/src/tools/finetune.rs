//! A PyTorch `nn.Transformer` fine-tuned in probattn: its TorchScript export's weights go into a
//! native [`Transformer`] with any normalizer in the encoder (DNAS, say), which then trains with
//! repulsive (SVGD / SPOS) heads, and its weights come back out under nn.Transformer's names.
//! The mechanics of the interop walk-through (docs/interop.md), on a synthetic task that needs attention
//! (`tgt` = `src` reversed in time, teacher-forced, mean squared error); a real fine-tuning run
//! brings its own data and loss. `cargo run --release -p probattn-experiments --example
//! finetune_transformer -- --help`.

use std::path::Path;

use anyhow::{Context, Result};
use probattn::interop::{export_params, import_params, TorchScript};
use probattn::repulsive::{RepulsiveConfig, RepulsiveHook, Selection};
use probattn::Variant;
use probattn_models::transformer::{config_of_pytorch, pytorch_name, pytorch_renamer, Transformer};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// What to fine-tune and how.
#[derive(Clone, Debug)]
pub struct FinetuneConfig {
    pub heads: i64,
    /// The encoder's normalizer (the decoder's self-attention and the cross-attention stay
    /// softmax unless it is row-wise: see `TransformerConfig::cross_variant`).
    pub variant: Variant,
    /// SVGD or SPOS heads on every attention module's Q, K, V projections; `None`: plain Adam.
    pub repulsive: Option<RepulsiveConfig>,
    pub steps: usize,
    pub lr: f64,
    pub batch: i64,
    pub len: i64,
    pub seed: i64,
}

/// What happened.
#[derive(Debug)]
pub struct FinetuneReport {
    /// The import's summary (HNAS's gates, say, are missing from an nn.Transformer and keep their
    /// initial values).
    pub import: String,
    /// Mean squared error on a held-out batch before and after.
    pub loss_before: f64,
    pub loss_after: f64,
    /// Particle sets the hook moved (0 without repulsive heads).
    pub particle_sets: usize,
}

/// Loads `torchscript` (an nn.Transformer), fine-tunes the native model, and writes its weights to
/// `out` (a safetensors state dict under nn.Transformer's names; the PyTorch module loads it with
/// `load_state_dict(strict=True)` unless the normalizer added parameters of its own).
pub fn finetune(torchscript: &Path, cfg: &FinetuneConfig, out: &Path, device: Device) -> Result<FinetuneReport> {
    let ts = TorchScript::load(torchscript, device)?;
    let params = ts.named_parameters()?;
    let model_cfg = config_of_pytorch(&params, cfg.heads, cfg.variant).with_context(|| torchscript.display().to_string())?;
    let e = model_cfg.embed_dim;
    let vs = nn::VarStore::new(device);
    let model = Transformer::new(&vs.root(), model_cfg)?;
    // Parameters of the normalizer (HNAS's gates) have no nn.Transformer counterpart: a partial
    // import keeps their initial values, and the report says which they are.
    let report = import_params(&vs, &params, pytorch_renamer(&vs), true)?;
    anyhow::ensure!(
        report.unexpected.is_empty() && report.wrong_shape.is_empty(),
        "{} does not fit the native model:\n{}",
        torchscript.display(),
        report.summary()
    );
    let mut hook = match &cfg.repulsive {
        Some(r) => {
            let mut hook = RepulsiveHook::new(r.clone(), Selection::default())?;
            model.register_repulsive(&mut hook);
            Some(hook)
        }
        None => None,
    };

    tch::manual_seed(cfg.seed);
    let batch = |n: i64| {
        let src = Tensor::randn([n, cfg.len, e], (Kind::Float, device));
        let tgt = src.flip([1]);
        // Teacher forcing: the decoder reads the target shifted right, a zero vector first.
        let prev = Tensor::cat(&[Tensor::zeros([n, 1, e], (Kind::Float, device)), tgt.narrow(1, 0, cfg.len - 1)], 1);
        (src, prev, tgt)
    };
    let loss_of = |src: &Tensor, prev: &Tensor, tgt: &Tensor, train: bool| -> Result<Tensor> {
        let out = model.forward_t(src, None, prev, None, train)?.output;
        Ok((out - tgt).square().mean(Kind::Float))
    };
    let held_out = batch(64);
    let eval = || -> Result<f64> { tch::no_grad(|| Ok(loss_of(&held_out.0, &held_out.1, &held_out.2, false)?.double_value(&[]))) };
    let loss_before = eval()?;
    let mut opt = nn::Adam::default().build(&vs, cfg.lr)?;
    for _ in 0..cfg.steps {
        let (src, prev, tgt) = batch(cfg.batch);
        opt.zero_grad();
        loss_of(&src, &prev, &tgt, true)?.backward();
        if let Some(hook) = hook.as_mut() {
            hook.apply()?;
        }
        opt.step();
    }
    let loss_after = eval()?;
    export_params(&vs, out, |n| pytorch_name(n).unwrap_or_else(|| n.to_string()))?;
    Ok(FinetuneReport { import: report.summary(), loss_before, loss_after, particle_sets: hook.as_ref().map_or(0, |h| h.sets().len()) })
}
