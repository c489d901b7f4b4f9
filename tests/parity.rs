//! PyTorch parity: every normalizer and the multi-head module against python/probattn_tools/reference/formulas.py, an
//! independent implementation written from the formulas, on random cases it generates (shapes
//! with S_q != S_k, bool and uint8 masks of every broadcast layout with fully masked rows and
//! columns, scores up to ±1e4).
//!
//! Tolerances, on `max|ours − ref| / max(1, max|ref|)`:
//! - float64: 1e-10 for outputs, weights, received mass and gradients (w.r.t. q, k, v, the HNAS
//!   logits, and every MHA parameter), at moderate scores and at |score| up to 1e4;
//! - float32: 1e-5, at moderate scores (|z| up to about 30). At |z| = 1e4 float32 itself carries
//!   an absolute error of about 1e-3 in every logsumexp (its spacing there is 1e-3), so two correct
//!   implementations legitimately differ by more; tests/normalizers.rs checks float32 at 1e4 for
//!   finiteness and normalization instead.

mod common;

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use common::{devices, load, manifest, run_python, scaled_error, TempDir};
use probattn::normalize::BamConfig;
use probattn::{attend, AttendOptions, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention, NormalizerConfig, Variant};
use tch::{nn, Device, Kind};

/// The seed of the random cases; set PROBATTN_PARITY_SEED to draw others.
fn seed(default: u64) -> String {
    std::env::var("PROBATTN_PARITY_SEED").unwrap_or_else(|_| default.to_string())
}

#[derive(Default)]
struct Worst(BTreeMap<String, f64>);

impl Worst {
    fn record(&mut self, key: String, err: f64) {
        let e = self.0.entry(key).or_insert(0.0);
        *e = e.max(err);
    }

    fn print(&self, title: &str) {
        println!("{title}");
        for (k, e) in &self.0 {
            println!("  {k:40} {e:.2e}");
        }
    }
}

fn attend_case(device: Device, dir: &TempDir, case: &serde_json::Value, worst: &mut Worst) -> Result<()> {
    let name = case["name"].as_str().context("name")?;
    let variant: Variant = case["variant"].as_str().context("variant")?.parse()?;
    let input = load(&dir.path(&format!("{name}.safetensors")))?;
    let expected = load(&dir.path(&format!("{name}.ref.safetensors")))?;
    let leaf = |n: &str| input[n].to_device(device).set_requires_grad(true);
    let (q, k, v) = (leaf("q"), leaf("k"), leaf("v"));
    let kind = q.kind();
    let get = |n: &str| input.get(n).map(|t| t.to_device(device));
    let (kp, qp, am) = (get("key_padding_mask"), get("query_padding_mask"), get("attn_mask"));
    let masks = Masks {
        key_padding: kp.as_ref(),
        query_padding: qp.as_ref(),
        attn_mask: am.as_ref(),
        causal: case["causal"].as_bool().unwrap_or(false),
        bias: None,
    };
    let heads = q.size()[1];
    let mut vs = nn::VarStore::new(device);
    let cfg = NormalizerConfig { bam: bam_config(&case["bam"])?, ..Default::default() };
    let normalizer = variant.build(&vs.root(), heads, q.size()[3], &cfg)?;
    if kind == Kind::Double {
        vs.double();
    }
    // The HNAS gates and the contextual prior's parameters come from the file, by name.
    for (name, var) in vs.variables() {
        let value = input.get(&name).with_context(|| format!("{name}: case file lacks {name}"))?;
        tch::no_grad(|| var.shallow_clone().copy_(value));
    }
    let noise = get("noise");
    let sample = case["train"].as_bool().unwrap_or(false);
    let opts = AttendOptions { mode: Mode { dropout: false, sample }, noise: noise.as_ref(), ..Default::default() };
    let out = attend(&q, &k, &v, &masks, normalizer.as_ref(), opts)?;
    let mut loss = (&out.output * get("grad_output").context("grad_output")?).sum(kind)
        + (out.weights()? * get("grad_weights").context("grad_weights")?).sum(kind);
    anyhow::ensure!(out.kl.is_some() == expected.contains_key("kl"), "{name}: KL present {} here", out.kl.is_some());
    if let Some(kl) = &out.kl {
        loss += kl * get("grad_kl").context("grad_kl")?;
    }
    loss.backward();
    let mass = probattn::diagnostics::received_mass(out.weights()?);
    let mut compared = vec![
        ("output".to_string(), out.output.detach()),
        ("weights".to_string(), out.weights()?.detach()),
        ("received_mass".to_string(), mass),
        ("grad_q".to_string(), q.grad()),
        ("grad_k".to_string(), k.grad()),
        ("grad_v".to_string(), v.grad()),
    ];
    if let Some(kl) = &out.kl {
        compared.push(("kl".to_string(), kl.detach()));
    }
    for (param, var) in vs.variables() {
        // Parameters the loss does not reach (the prior network in eval mode) have no gradient.
        let grad = if var.grad().defined() { var.grad() } else { var.zeros_like() };
        compared.push((format!("grad_{param}"), grad));
    }
    let regime = if case["extreme"].as_bool().unwrap_or(false) { "|z|<=1e4" } else { "moderate" };
    let mode = if sample { " sampled" } else { "" };
    let tol = if kind == Kind::Double { 1e-10 } else { 1e-5 };
    for (what, ours) in compared {
        let err = scaled_error(&ours, &expected[&what]).with_context(|| format!("{name} {what}"))?;
        let group = if what.starts_with("grad") { "grads" } else { "values" };
        worst.record(format!("{variant}{mode} {kind:?} {regime} {group}"), err);
        anyhow::ensure!(err <= tol, "{name} ({variant}{mode}, {kind:?}, {regime}) on {device:?}: {what} differs by {err:.3e} > {tol:.0e}");
    }
    Ok(())
}

/// The BAM settings of a case (`null` for the other variants: defaults).
fn bam_config(bam: &serde_json::Value) -> Result<BamConfig> {
    if bam.is_null() {
        return Ok(BamConfig::default());
    }
    let f = |key: &str| bam[key].as_f64().with_context(|| format!("bam.{key}"));
    Ok(BamConfig {
        k: f("k")?,
        sigma: f("sigma")?,
        prior_alpha: f("prior_alpha")?,
        prior_beta: f("prior_beta")?,
        prior_mu: f("prior_mu")?,
        prior_sigma: f("prior_sigma")?,
        prior_hidden: 5,
        base: bam["base"].as_str().context("bam.base")?.parse()?,
        ..Default::default()
    })
}

#[test]
fn every_normalizer_matches_the_pytorch_reference() -> Result<()> {
    let dir = TempDir::new("parity-attend")?;
    let out = dir.0.to_string_lossy().to_string();
    run_python("reference.parity", &["cases", "--out", &out, "--seed", &seed(20260101), "--count", "150", "--bam"])?;
    let cases = manifest(&dir.0)?;
    for device in devices() {
        let mut worst = Worst::default();
        for case in &cases {
            attend_case(device, &dir, case, &mut worst)?;
        }
        worst.print(&format!("largest scaled error per variant on {device:?} ({} cases):", cases.len()));
    }
    Ok(())
}

fn mha_case(device: Device, dir: &TempDir, case: &serde_json::Value, worst: &mut Worst) -> Result<()> {
    let name = case["name"].as_str().context("name")?;
    let variant: Variant = case["variant"].as_str().context("variant")?.parse()?;
    let int = |k: &str| case[k].as_i64().context("int");
    let mut cfg = MhaConfig::new(int("embed")?, int("heads")?).with_variant(variant);
    cfg.kdim = Some(int("kdim")?);
    cfg.vdim = Some(int("vdim")?);
    cfg.bias = case["bias"].as_bool().context("bias")?;
    let mut vs = nn::VarStore::new(device);
    let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
    vs.double();
    // A PyTorch nn.MultiheadAttention state dict loads by name, with nothing missing or left over.
    let weights_path = dir.path(&format!("{name}.weights.safetensors"));
    let file = load(&weights_path)?;
    let ours = vs.variables();
    let mut names: Vec<_> = ours.keys().cloned().collect();
    let mut theirs: Vec<_> = file.keys().cloned().collect();
    names.sort();
    theirs.sort();
    anyhow::ensure!(names == theirs, "{name}: parameters {names:?}, state dict {theirs:?}");
    vs.load(&weights_path)?;

    let input = load(&dir.path(&format!("{name}.safetensors")))?;
    let query = input["query"].to_device(device).set_requires_grad(true);
    let self_attention = case["self_attention"].as_bool().unwrap_or(false);
    let key = if self_attention { query.shallow_clone() } else { input["key"].to_device(device) };
    let value = if self_attention { query.shallow_clone() } else { input["value"].to_device(device) };
    let get = |n: &str| input.get(n).map(|t| t.to_device(device));
    let (kp, qp) = (get("key_padding_mask"), get("query_padding_mask"));
    let masks = Masks {
        key_padding: kp.as_ref(),
        query_padding: qp.as_ref(),
        attn_mask: None,
        causal: case["causal"].as_bool().unwrap_or(false),
        bias: None,
    };
    let out = mha.forward_t(&MhaInput::new(&query, &key, &value).with_masks(masks), false)?;
    (&out.context * get("grad_context").context("grad_context")?).sum(Kind::Double).backward();

    let expected = load(&dir.path(&format!("{name}.ref.safetensors")))?;
    let mut compared = vec![("context".to_string(), out.context.detach()), ("grad.query".to_string(), query.grad())];
    for (n, t) in &ours {
        compared.push((format!("grad.{n}"), t.grad()));
    }
    for (what, ours) in compared {
        let err = scaled_error(&ours, &expected[&what]).with_context(|| format!("{name} {what}"))?;
        worst.record(format!("mha {variant} {}", if what.starts_with("grad") { "grads" } else { "context" }), err);
        anyhow::ensure!(err <= 1e-10, "{name} ({variant}) on {device:?}: {what} differs by {err:.3e}");
    }
    Ok(())
}

#[test]
fn multi_head_attention_loads_pytorch_weights_and_matches_the_reference() -> Result<()> {
    let dir = TempDir::new("parity-mha")?;
    let out = dir.0.to_string_lossy().to_string();
    run_python("reference.parity", &["mha-cases", "--out", &out, "--seed", &seed(7), "--count", "30"])?;
    let cases = manifest(&dir.0)?;
    for device in devices() {
        let mut worst = Worst::default();
        for case in &cases {
            mha_case(device, &dir, case, &mut worst)?;
        }
        worst.print(&format!("MultiHeadAttention, float64, on {device:?} ({} cases):", cases.len()));
    }
    Ok(())
}

#[test]
fn additive_and_self_attentive_scores_match_the_reference() -> Result<()> {
    use probattn::scores::{AdditiveScore, SelfAttentiveScore};
    let dir = TempDir::new("parity-scores")?;
    run_python("reference.parity", &["score-cases", "--out", &dir.0.to_string_lossy(), "--seed", &seed(11)])?;
    let input = load(&dir.path("scores.safetensors"))?;
    let expected = load(&dir.path("scores.ref.safetensors"))?;
    for device in devices() {
        let mut vs = nn::VarStore::new(device);
        let additive = AdditiveScore::new(&(vs.root() / "additive"), 4, 6, 7);
        let lin = SelfAttentiveScore::new(&(vs.root() / "lin"), 6, 7, 3);
        vs.double();
        vs.load(dir.path("scores.weights.safetensors"))?;
        // detach(): on the CPU, to_device returns the loaded tensor itself, and setting requires_grad
        // on it would make the next device's copy a non-leaf with no .grad().
        let query = input["query"].to_device(device).detach().set_requires_grad(true);
        let key = input["key"].to_device(device).detach().set_requires_grad(true);
        let z_add = additive.forward(&query, &key)?;
        let z_lin = lin.forward(&key)?;
        let g = |n: &str| input[n].to_device(device);
        ((&z_add * g("grad_additive")).sum(Kind::Double) + (&z_lin * g("grad_self_attentive")).sum(Kind::Double)).backward();
        let mut compared = vec![("additive".to_string(), z_add.detach()), ("self_attentive".to_string(), z_lin.detach())];
        compared.push(("grad.query".into(), query.grad()));
        compared.push(("grad.key".into(), key.grad()));
        for (name, t) in vs.variables() {
            let short = name.split_once('.').map(|(_, rest)| rest.to_string()).unwrap_or(name.clone());
            compared.push((format!("grad.{short}"), t.grad()));
        }
        for (what, ours) in compared {
            let err = scaled_error(&ours, &expected[&what]).with_context(|| what.clone())?;
            anyhow::ensure!(err <= 1e-10, "{what} on {device:?} differs by {err:.3e}");
        }
    }
    Ok(())
}
