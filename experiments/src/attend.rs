//! `probattn attend`: one attention call from a safetensors file, so anyone can check a variant
//! against their own PyTorch code (python/parity.py compare does it for ours).
//!
//! Input (`--input`): `q`, `k`, `v` as `(B, H, S, d)` in float32 or float64; optional
//! `key_padding_mask (B, S_k)`, `query_padding_mask (B, S_q)`, `attn_mask` (broadcastable to
//! `(B, H, S_q, S_k)`), bool or uint8 with `true` = excluded, and `hybrid_logit (H,)` for HNAS.
//! Output (`--output`): `output (B, H, S_q, d_v)`, `weights (B, H, S_q, S_k)` and
//! `received_mass (B, H, S_k)`, in the input's dtype. Scores are `q·kᵀ / sqrt(d)`.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use probattn::diagnostics::{explained_away_fraction, received_mass, EXPLAINED_AWAY_EPS};
use probattn::io::{read_safetensors, write_safetensors_atomic};
use probattn::{attend, check_finite, AttendOptions, Masks, NormalizerConfig, Variant};
use tch::{nn, Device, Kind, Tensor};

use crate::common::CommonArgs;

/// Flags of `probattn attend`.
#[derive(Args, Debug)]
pub struct AttendArgs {
    /// Attention variant: softmax, dnas, hnas or sinkhorn-N.
    #[arg(long, value_parser = parse_variant)]
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
    /// HNAS: the initial mixing weight u when the input has no hybrid_logit.
    #[arg(long, default_value_t = 0.5)]
    pub hybrid_init_u: f64,
    #[command(flatten)]
    pub common: CommonArgs,
}

fn parse_variant(s: &str) -> std::result::Result<Variant, String> {
    s.parse().map_err(|e: probattn::Error| e.to_string())
}

const KNOWN_INPUTS: [&str; 7] = ["q", "k", "v", "key_padding_mask", "query_padding_mask", "attn_mask", "hybrid_logit"];

pub fn run(args: &AttendArgs) -> Result<()> {
    let device = args.common.setup()?;
    let input = args.input.display().to_string();
    let tensors = read_safetensors(&args.input).context("reading --input")?;
    let get = |name: &str| -> Result<Tensor> {
        let t = tensors.get(name).with_context(|| format!("{input} has no tensor '{name}' (expected q, k and v, each (B, H, S, d))"))?;
        Ok(t.to_device(device))
    };
    let (q, k, v) = (get("q")?, get("k")?, get("v")?);
    let kind = q.kind();
    for (name, t) in [("q", &q), ("k", &k), ("v", &v)] {
        ensure!(matches!(t.kind(), Kind::Float | Kind::Double), "{input}: {name} has dtype {:?}; attend takes float32 or float64", t.kind());
        ensure!(t.kind() == kind, "{input}: q is {kind:?} but {name} is {:?}; use one dtype", t.kind());
        check_finite(name, t).with_context(|| input.clone())?;
    }
    let ignored: Vec<&String> = tensors.keys().filter(|n| !KNOWN_INPUTS.contains(&n.as_str())).collect();
    if !ignored.is_empty() {
        eprintln!("note: ignoring tensors attend does not read: {ignored:?}");
    }
    let optional = |name: &str| tensors.get(name).map(|t| t.to_device(device));
    let (kp, qp, am) = (optional("key_padding_mask"), optional("query_padding_mask"), optional("attn_mask"));
    let masks = Masks { key_padding: kp.as_ref(), query_padding: qp.as_ref(), attn_mask: am.as_ref(), causal: args.causal };

    ensure!(q.dim() == 4, "{input}: q has shape {:?}; expected rank 4 (B, H, S, d)", q.size());
    let heads = q.size()[1];
    let mut vs = nn::VarStore::new(device);
    let cfg = NormalizerConfig { hybrid_init_u: args.hybrid_init_u };
    let normalizer = args.variant.build(&vs.root(), heads, &cfg).context("--variant")?;
    if kind == Kind::Double {
        vs.double();
    }
    load_hybrid_logit(&vs, &tensors, args.variant, heads, &input)?;

    let out = tch::no_grad(|| attend(&q, &k, &v, &masks, normalizer.as_ref(), AttendOptions::default()))
        .with_context(|| format!("attending with {} on {input}", args.variant))?;
    let mass = received_mass(&out.weights);
    write_safetensors_atomic(&args.output, &[("output", &out.output), ("weights", &out.weights), ("received_mass", &mass)])
        .context("writing --output")?;

    let counted = masks_key_counted(&out.weights, &masks, device)?;
    let away = explained_away_fraction(&mass, counted.as_ref(), EXPLAINED_AWAY_EPS)?;
    let least = match &counted {
        Some(c) => mass.masked_select(c),
        None => mass.view([-1]),
    };
    let least = if least.numel() > 0 { f64::try_from(least.min())? } else { f64::NAN };
    println!(
        "{} on {}: output {:?}, weights {:?}; keys explained away (received < {EXPLAINED_AWAY_EPS:e}): {:.1}%, \
         least received mass {least:.3e}; wrote {}",
        args.variant,
        probattn::device::device_name(device),
        out.output.size(),
        out.weights.size(),
        100.0 * away,
        args.output.display()
    );
    Ok(())
}

/// Copies the file's `hybrid_logit` into the HNAS gate, after checking its shape.
fn load_hybrid_logit(vs: &nn::VarStore, tensors: &HashMap<String, Tensor>, variant: Variant, heads: i64, input: &str) -> Result<()> {
    let Some(logit) = tensors.get("hybrid_logit") else {
        if variant == Variant::Hnas {
            eprintln!("note: {input} has no hybrid_logit; every head uses the initial u (--hybrid-init-u)");
        }
        return Ok(());
    };
    if variant != Variant::Hnas {
        return Ok(()); // only HNAS has gates
    }
    if logit.size() != [heads] {
        bail!("{input}: hybrid_logit has shape {:?}, expected ({heads},): one logit per head", logit.size());
    }
    check_finite("hybrid_logit", logit).with_context(|| input.to_string())?;
    let mut var = vs.variables()["hybrid_logit"].shallow_clone();
    tch::no_grad(|| var.f_copy_(logit))?;
    Ok(())
}

/// The keys counted by the explained-away statistic: those some query may attend, `(B, H, S_k)`.
fn masks_key_counted(weights: &Tensor, masks: &Masks, device: Device) -> Result<Option<Tensor>> {
    let s = weights.size();
    let shape = probattn::ScoreShape { batch: s[0], heads: s[1], queries: s[2], keys: s[3] };
    Ok(masks.allowed(shape, device)?.map(|a| a.expand(shape.dims(), false).any_dim(-2, false)))
}
