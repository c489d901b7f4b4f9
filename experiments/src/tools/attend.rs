//! `probattn attend`: one attention call from a safetensors file, so anyone can check a variant
//! against their own PyTorch code (python/probattn_tools/reference/parity.py compare does it for ours).
//!
//! Input (`--input`): `q`, `k`, `v` as `(B, H, S, d)` in float32, float64, bfloat16 or float16
//! (`k` and `v` with fewer heads, a divisor of q's, under `--enable-gqa`); optional
//! `key_padding_mask (B, S_k)`, `query_padding_mask (B, S_q)`, `attn_mask` (broadcastable to
//! `(B, H, S_q, S_k)`), bool or uint8 with `true` = excluded, `attn_bias` (floating, broadcastable
//! to the scores, added to them before normalization; `-inf` excludes), and `hybrid_logit (H,)` for
//! HNAS.
//! BAM variants also read `noise (B, H, S_q, S_k)` (ε ~ U(0,1) for Weibull, N(0,1) for Lognormal,
//! used instead of drawing when `--train` is set) and the contextual prior's parameters
//! `prior.f1.weight (H, hidden, d)`, `prior.f1.bias (H, hidden)`, `prior.f2.weight (H, hidden)`,
//! `prior.f2.bias (H,)` (drawn from `--seed` when absent).
//! Output (`--output`): `output (B, H, S_q, d_v)`, `weights (B, H, S_q, S_k)` and
//! `received_mass (B, H, S_k)`, plus the scalar `kl` when a BAM variant with a prior samples; all in
//! the input's dtype, but for bfloat16 inputs, whose weights, received mass and KL are float32
//! (the library's statistics). Scores are `q·kᵀ / sqrt(d)`, or `--scale` times `q·kᵀ`.
//!
//! `--memory-efficient [--tile N]` runs the tiled path instead (`probattn::tiled`, every variant),
//! on the same inputs: it writes `output`, `received_mass` and BAM's `kl`, and no weights (they are
//! never formed). BAM with `--train` samples from the input's `noise` when it has one, else from
//! the tiled path's counter-based draws keyed by `--seed`. `--attention-backend tiles|fused` writes
//! what `--memory-efficient` writes (softmax's fused kernel forms no received mass), `eager` what the
//! default path writes; the summary line names the route that ran (`probattn::backend`).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use probattn::diagnostics::{explained_away_fraction, received_mass, EXPLAINED_AWAY_EPS};
use probattn::io::{read_safetensors, write_safetensors_atomic};
use probattn::normalize::BamConfig;
use probattn::{attend_with_choice, check_finite, AttendOptions, Backend, Masks, Mode, NormalizerConfig, Variant};
use tch::{nn, Device, Kind, Tensor};

use crate::common::CommonArgs;
use probattn::precision::Precision;

/// Flags of `probattn attend`.
#[derive(Args, Debug)]
pub struct AttendArgs {
    /// Attention variant: softmax, dnas, hnas, sinkhorn-N, bam-nokl, bam-lf, bam-lc, bam-wf or bam-wc.
    #[arg(long, visible_alias = "attention", value_parser = crate::variants::parse_variant)]
    pub variant: Variant,
    /// safetensors file with q, k, v (B, H, S, d) and optional masks and hybrid_logit.
    #[arg(long)]
    pub input: PathBuf,
    /// safetensors file to write output, weights and received_mass to (written atomically).
    #[arg(long)]
    pub output: PathBuf,
    /// Add a causal mask (query i sees keys j <= i); refused for the doubly-normalized variants.
    #[arg(long)]
    pub causal: bool,
    /// The factor of the scores q·kᵀ (default 1/sqrt(d)), as scaled_dot_product_attention's scale.
    #[arg(long, allow_hyphen_values = true)]
    pub scale: Option<f64>,
    /// Grouped-query attention: k and v may have fewer heads than q (a divisor of them), query head
    /// h reading key/value head h / (H / H_kv).
    #[arg(long)]
    pub enable_gqa: bool,
    #[command(flatten)]
    pub memory: crate::common::MemoryEfficientArgs,
    /// HNAS: the initial mixing weight u when the input has no hybrid_logit.
    #[arg(long, default_value_t = 0.5)]
    pub hybrid_init_u: f64,
    #[command(flatten)]
    pub bam: BamArgs,
    // bf16: float32 inputs attend in bfloat16 (an autocast region); the weights, received mass and
    // KL stay float32 and the output is bfloat16.
    #[command(flatten)]
    pub precision: crate::common::PrecisionArgs,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// The BAM flags of `probattn attend` (defaults: the authors' code, see `BamConfig`).
#[derive(Args, Debug)]
pub struct BamArgs {
    /// BAM: sample the weights (training mode) and compute the KL term; without it BAM returns
    /// the base weights exactly.
    #[arg(long)]
    pub train: bool,
    /// Seed of libtorch's generator: BAM noise (when the input has none; with --memory-efficient,
    /// the key of the counter-based draws) and prior initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// BAM Weibull shape k (> 0).
    #[arg(long, default_value_t = BamConfig::default().k)]
    pub k: f64,
    /// BAM Lognormal sigma (> 0).
    #[arg(long, default_value_t = BamConfig::default().sigma)]
    pub sigma: f64,
    /// BAM Gamma prior shape alpha (bam-wf).
    #[arg(long, default_value_t = BamConfig::default().prior_alpha)]
    pub prior_alpha: f64,
    /// BAM Gamma prior rate beta (bam-wf, bam-wc).
    #[arg(long, default_value_t = BamConfig::default().prior_beta)]
    pub prior_beta: f64,
    /// BAM Lognormal prior mean mu_p (bam-lf).
    #[arg(long, default_value_t = BamConfig::default().prior_mu, allow_hyphen_values = true)]
    pub prior_mu: f64,
    /// BAM Lognormal prior sigma_p (bam-lf, bam-lc).
    #[arg(long, default_value_t = BamConfig::default().prior_sigma)]
    pub prior_sigma: f64,
    /// BAM contextual prior hidden units (bam-wc, bam-lc), when the input has no prior.* tensors.
    #[arg(long, default_value_t = BamConfig::default().prior_hidden)]
    pub prior_hidden: i64,
    /// BAM base normalizer whose weights are the mean: softmax, dnas, hnas or sinkhorn-N.
    #[arg(long, default_value = "softmax", value_parser = crate::variants::parse_variant)]
    pub base: Variant,
}

impl BamArgs {
    fn config(&self) -> BamConfig {
        BamConfig {
            k: self.k,
            sigma: self.sigma,
            prior_alpha: self.prior_alpha,
            prior_beta: self.prior_beta,
            prior_mu: self.prior_mu,
            prior_sigma: self.prior_sigma,
            prior_hidden: self.prior_hidden,
            base: self.base,
            // Dense attention: the prior's scope only matters over edge lists.
            ..BamConfig::default()
        }
    }
}

const KNOWN_INPUTS: [&str; 9] =
    ["q", "k", "v", "key_padding_mask", "query_padding_mask", "attn_mask", "attn_bias", "hybrid_logit", "noise"];

pub fn run(args: &AttendArgs) -> Result<()> {
    let device = args.common.setup()?;
    let _precision = args.precision.begin(device)?;
    let input = args.input.display().to_string();
    let (tensors, q, k, v) = read_qkv(args, device)?;
    let kind = q.kind();
    let precision = args.precision.precision;
    let ignored: Vec<&String> = tensors.keys().filter(|n| !KNOWN_INPUTS.contains(&n.as_str()) && !n.starts_with("prior.")).collect();
    if !ignored.is_empty() {
        eprintln!("note: ignoring tensors attend does not read: {ignored:?}");
    }
    let optional = |name: &str| tensors.get(name).map(|t| t.to_device(device));
    let (kp, qp, am) = (optional("key_padding_mask"), optional("query_padding_mask"), optional("attn_mask"));
    let bias = optional("attn_bias");
    let masks =
        Masks { key_padding: kp.as_ref(), query_padding: qp.as_ref(), attn_mask: am.as_ref(), causal: args.causal, bias: bias.as_ref() };

    ensure!(q.dim() == 4, "{input}: q has shape {:?}; expected rank 4 (B, H, S, d)", q.size());
    let (heads, key_dim) = (q.size()[1], q.size()[3]);
    tch::manual_seed(args.bam.seed as i64);
    let mut vs = nn::VarStore::new(device);
    let mut cfg = NormalizerConfig { hybrid_init_u: args.hybrid_init_u, bam: args.bam.config() };
    if let Some(f1) = tensors.get("prior.f1.weight") {
        // The file's prior network fixes its hidden size (--prior-hidden is for drawn priors).
        ensure!(f1.dim() == 3, "{input}: prior.f1.weight has shape {:?}, expected (H, hidden, d)", f1.size());
        cfg.bam.prior_hidden = f1.size()[1];
    }
    let normalizer = args.variant.build(&vs.root(), heads, key_dim, &cfg).context("--variant")?;
    if kind == Kind::Double {
        vs.double();
    }
    load_hybrid_logit(&vs, &tensors, heads, &input)?;
    load_prior(&vs, &tensors, args.variant, &input)?;
    let noise = optional("noise");
    if let Some(n) = &noise {
        check_finite("noise", n).with_context(|| input.clone())?;
        if !(args.variant.is_stochastic() && args.bam.train) {
            eprintln!("note: noise is only used by BAM variants with --train; ignored");
        }
    }

    // The routes that form no weights: --memory-efficient (unless eager is forced), or a forced
    // tiles or fused backend. Through probattn::attend, as every caller: BAM samples from the
    // input's noise when it has one, else (on the memory-efficient routes) from the counter-based
    // draws keyed by --seed (`probattn::tiled::counter_noise` reproduces them).
    let backend = args.common.attention_backend;
    let weightless = (args.memory.memory_efficient && backend != Backend::Eager) || matches!(backend, Backend::Tiles | Backend::Fused);
    let opts = AttendOptions {
        mode: Mode { dropout: false, sample: args.bam.train },
        noise: noise.as_ref(),
        need_weights: !weightless,
        // The mass is written beside the output wherever a route forms it.
        need_mass: true,
        tile: weightless.then_some(args.memory.tile),
        seed: weightless.then_some(args.bam.seed),
        scale: args.scale,
        enable_gqa: args.enable_gqa,
        ..Default::default()
    };
    let (out, choice) = tch::no_grad(|| precision.run(device, || attend_with_choice(&q, &k, &v, &masks, normalizer.as_ref(), opts)))?
        .with_context(|| format!("attending with {} ({backend} backend) on {input}", args.variant))?;
    write_outputs(args, device, &masks, &normalizer.name(), &choice, &out)
}

/// Reads `--input` and its q, k and v, checked: one of the four float dtypes for all three, finite
/// values, and float32 where `--precision` asks for autocast.
fn read_qkv(args: &AttendArgs, device: Device) -> Result<(HashMap<String, Tensor>, Tensor, Tensor, Tensor)> {
    let input = args.input.display().to_string();
    let tensors = read_safetensors(&args.input).context("reading --input")?;
    let get = |name: &str| -> Result<Tensor> {
        let t = tensors.get(name).with_context(|| format!("{input} has no tensor '{name}' (expected q, k and v, each (B, H, S, d))"))?;
        Ok(t.to_device(device))
    };
    let (q, k, v) = (get("q")?, get("k")?, get("v")?);
    let kind = q.kind();
    for (name, t) in [("q", &q), ("k", &k), ("v", &v)] {
        ensure!(
            matches!(t.kind(), Kind::Float | Kind::Double | Kind::BFloat16 | Kind::Half),
            "{input}: {name} has dtype {:?}; attend takes float32, float64, bfloat16 or float16",
            t.kind()
        );
        ensure!(t.kind() == kind, "{input}: q is {kind:?} but {name} is {:?}; use one dtype", t.kind());
        check_finite(name, t).with_context(|| input.clone())?;
    }
    let precision = args.precision.precision;
    ensure!(
        precision == Precision::F32 || kind == Kind::Float,
        "{input}: --precision {precision} takes float32 inputs (autocast leaves {kind:?} as it is)"
    );
    Ok((tensors, q, k, v))
}

/// Writes what one call returned (the received mass from the weights where it has them; a kernel
/// route, softmax's fused attention, forms neither) and prints the summary line, formed first: a
/// failure leaves no file behind.
fn write_outputs(
    args: &AttendArgs,
    device: Device,
    masks: &Masks,
    name: &str,
    choice: &probattn::backend::Choice,
    out: &probattn::Attended,
) -> Result<()> {
    let mass = match &out.weights {
        Some(weights) => Some(received_mass(weights)),
        None => out.received_mass.as_ref().map(Tensor::shallow_clone),
    };
    // The keys the explained-away statistic counts: those some query may attend, (B, H, S_k).
    let counted = match (&mass, &out.output.size()[..]) {
        (Some(mass), &[batch, heads, queries, _]) => {
            let shape = probattn::ScoreShape { batch, heads, queries, keys: mass.size()[2] };
            masks.allowed(shape, device)?.map(|a| a.expand(shape.dims(), false).any_dim(-2, false))
        }
        _ => None,
    };
    let line =
        summary(name, choice, device, &out.output, out.weights.as_ref(), mass.as_ref(), counted.as_ref(), out.kl.as_ref(), &args.output)?;
    let mut written = vec![("output", &out.output)];
    if let Some(weights) = &out.weights {
        written.push(("weights", weights));
    }
    if let Some(mass) = &mass {
        written.push(("received_mass", mass));
    }
    if let Some(kl) = &out.kl {
        written.push(("kl", kl));
    }
    write_safetensors_atomic(&args.output, &written).context("writing --output")?;
    println!("{line}");
    Ok(())
}

/// The one line `attend` prints once its file is written: shapes, the explained-away share of keys
/// and the least received mass (over keys some query may attend), the KL term.
#[allow(clippy::too_many_arguments)]
fn summary(
    name: &str,
    choice: &probattn::backend::Choice,
    device: Device,
    output: &Tensor,
    weights: Option<&Tensor>,
    mass: Option<&Tensor>,
    counted: Option<&Tensor>,
    kl: Option<&Tensor>,
    path: &std::path::Path,
) -> Result<String> {
    let explained = match mass {
        Some(mass) => {
            let away = explained_away_fraction(mass, counted, EXPLAINED_AWAY_EPS)?;
            let least = match counted {
                Some(c) => mass.masked_select(c),
                // reshape, not view: a mass read from elsewhere need not be contiguous.
                None => mass.f_reshape([-1]).context("flattening the received mass")?,
            };
            let least = if least.numel() > 0 { f64::try_from(least.min())? } else { f64::NAN };
            format!("keys explained away (received < {EXPLAINED_AWAY_EPS:e}): {:.1}%, least received mass {least:.3e}", 100.0 * away)
        }
        None => format!("received mass not formed by the {} route", choice.route),
    };
    let kl = match kl {
        Some(kl) => format!("; KL {:.6e}", f64::try_from(kl)?),
        None => String::new(),
    };
    let weights = weights.map_or("none (memory-efficient)".to_string(), |w| format!("{:?}", w.size()));
    Ok(format!(
        "{name} on {} (route {}): output {:?}, weights {weights}; {explained}{kl}; wrote {}",
        probattn::device::device_name(device),
        choice.route,
        output.size(),
        path.display()
    ))
}

/// Copies the file's `prior.*` tensors into the contextual prior network, by name and shape.
fn load_prior(vs: &nn::VarStore, tensors: &HashMap<String, Tensor>, variant: Variant, input: &str) -> Result<()> {
    let vars = vs.variables();
    let mut ours: Vec<&String> = vars.keys().filter(|n| n.starts_with("prior.")).collect();
    ours.sort();
    let given: Vec<&String> = tensors.keys().filter(|n| n.starts_with("prior.")).collect();
    if given.is_empty() {
        if !ours.is_empty() {
            eprintln!("note: {input} has no prior.* tensors; {variant}'s prior network is initialised from --seed");
        }
        return Ok(());
    }
    if ours.is_empty() {
        return Ok(()); // only the contextual variants have a prior network
    }
    for name in &ours {
        let Some(t) = tensors.get(*name) else {
            bail!("{input} has some prior.* tensors but not '{name}' (expected {ours:?})");
        };
        let mut var = vars[*name].shallow_clone();
        ensure!(t.size() == var.size(), "{input}: {name} has shape {:?}, expected {:?}", t.size(), var.size());
        check_finite(name, t).with_context(|| input.to_string())?;
        tch::no_grad(|| var.f_copy_(t))?;
    }
    if let Some(extra) = given.iter().find(|n| !vars.contains_key(n.as_str())) {
        bail!("{input}: unknown prior tensor '{extra}' (expected {ours:?})");
    }
    Ok(())
}

/// Copies the file's `hybrid_logit` into the HNAS gates, when the normalizer has them (HNAS, or
/// BAM with an HNAS base), after checking its shape.
fn load_hybrid_logit(vs: &nn::VarStore, tensors: &HashMap<String, Tensor>, heads: i64, input: &str) -> Result<()> {
    let vars = vs.variables();
    let Some(gate) = vars.get("hybrid_logit") else {
        return Ok(()); // no HNAS gates: a hybrid_logit in the file is not read
    };
    let Some(logit) = tensors.get("hybrid_logit") else {
        eprintln!("note: {input} has no hybrid_logit; every head uses the initial u (--hybrid-init-u)");
        return Ok(());
    };
    if logit.size() != [heads] {
        bail!("{input}: hybrid_logit has shape {:?}, expected ({heads},): one logit per head", logit.size());
    }
    check_finite("hybrid_logit", logit).with_context(|| input.to_string())?;
    tch::no_grad(|| gate.shallow_clone().f_copy_(logit))?;
    Ok(())
}
