//! The multi-view VQA model against python/probattn_tools/baselines/vqa.py (the PyTorch model written separately
//! from Appendix B's formula and the same head): same weights, eval mode, float64 logits and the
//! gradients of every view and parameter within 1e-10, for each fusion (none, UNAS, DNAS, HNAS)
//! with 0, 1 and 2 reasoning layers, post-norm and pre-norm, with the relational layer, and with
//! each question encoder (GRU, LSTM, bag of words), and with the head reading the primary's unfused boxes (added, or beside).

#[path = "../../tests/common/mod.rs"]
mod common;

use anyhow::{ensure, Context, Result};
use common::{load, manifest, run_python, scaled_error, TempDir};
use probattn::{Mode, NormalizerConfig, Variant};
use probattn_models::vqa::{VqaConfig, VqaModel};
use tch::{nn, Kind, Tensor};

fn config(case: &serde_json::Value) -> Result<VqaConfig> {
    let int = |k: &str| case[k].as_i64().with_context(|| format!("case field {k}"));
    let fusion = match case["fusion"].as_str().context("fusion")? {
        "none" => None,
        v => Some(v.parse::<Variant>()?),
    };
    let regions: Vec<i64> = case["regions"].as_array().context("regions")?.iter().filter_map(|r| r.as_i64()).collect();
    Ok(VqaConfig {
        view_regions: regions,
        feature_dim: int("dim")?,
        fusion,
        key_dim: int("dim")?,
        attention_dropout: 0.1,
        normalizer: NormalizerConfig::default(),
        vocab: int("vocab")?,
        word_dim: int("word_dim")?,
        question_encoder: case.get("question_encoder").and_then(|e| e.as_str()).unwrap_or("gru").parse()?,
        question_dim: int("question_dim")?,
        hidden: int("hidden")?,
        reasoning_layers: int("reasoning_layers")? as usize,
        reasoning_prenorm: case["reasoning_prenorm"].as_bool().context("reasoning_prenorm")?,
        reasoning_heads: 4,
        relational_heads: case.get("relational_heads").and_then(|r| r.as_i64()).unwrap_or(0),
        relational_dim: case.get("relational_dim").and_then(|r| r.as_i64()).unwrap_or(8),
        primary_skip: case.get("primary_skip").and_then(|r| r.as_bool()).unwrap_or(false),
        primary_beside: case.get("primary_beside").and_then(|r| r.as_bool()).unwrap_or(false),
        glimpses: int("glimpses")?,
        dropout: 0.1,
        answers: int("answers")?,
        tile: None,
    })
}

#[test]
fn vqa_model_matches_the_pytorch_baseline() -> Result<()> {
    let _serial = common::serial();
    let dir = TempDir::new("parity-vqa")?;
    run_python("reference.parity", &["vqa-cases", "--out", &dir.0.to_string_lossy(), "--seed", "4"])?;
    let cases = manifest(&dir.0)?;
    ensure!(cases.len() == 11, "expected four fusions, a pre-norm case, two relational ones, the LSTM and bag-of-words encoders, a primary skip and a primary beside, got {}", cases.len());
    for case in cases {
        let name = case["name"].as_str().context("name")?;
        let t = load(&dir.path(&format!("{name}.safetensors")))?;
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let model = VqaModel::new(&vs.root(), config(&case)?)?;
        vs.double();
        // Every parameter is named as PyTorch names it: the load fails on any name left over.
        vs.load(dir.path(&format!("{name}.weights.safetensors")))?;
        let views: Vec<Tensor> = (0..3).map(|v| t[&format!("view{v}")].set_requires_grad(true)).collect();
        let out = model.forward(&views, &t["tokens"], Mode::EVAL)?;
        (&out.logits * &t["cotangent"]).sum(Kind::Double).backward();
        let mut compared = vec![("logits".to_string(), out.logits.detach())];
        for (v, x) in views.iter().enumerate() {
            compared.push((format!("grad.view{v}"), x.grad()));
        }
        for (param, var) in vs.variables() {
            let g = var.grad();
            compared.push((format!("grad.{param}"), if g.defined() { g } else { var.zeros_like() }));
        }
        for (what, ours) in compared {
            let expected = t.get(&what).with_context(|| format!("{name}: the reference has no {what}"))?;
            let err = scaled_error(&ours, expected)?;
            ensure!(err <= 1e-10, "{name}: {what} differs by {err:.3e}");
        }
        if let Some(u) = model.fusion.gates() {
            ensure!(u.size() == [2], "{name}: one HNAS gate per secondary view, got {:?}", u.size());
        }
    }
    Ok(())
}

#[test]
fn dnas_fusion_gives_every_secondary_box_at_least_one_over_its_count() -> Result<()> {
    // Theorem 2 of Ding et al.: with DNAS, each key receives at least 1 / (number of keys) of
    // the attention in total; with softmax a key can receive almost nothing.
    let _serial = common::serial();
    tch::manual_seed(3);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let mut cfg = config(
        &serde_json::json!({"fusion": "dnas", "regions": [6, 9, 4], "dim": 8, "vocab": 5, "word_dim": 4, "question_dim": 4, "hidden": 8, "reasoning_layers": 0, "reasoning_prenorm": false, "glimpses": 1, "answers": 3}),
    )?;
    let dnas = VqaModel::new(&(vs.root() / "dnas"), cfg.clone())?;
    cfg.fusion = Some(Variant::Softmax);
    let softmax = VqaModel::new(&(vs.root() / "softmax"), cfg)?;
    // Large features make the scores peaked, so softmax explains boxes away.
    let views: Vec<Tensor> = [6, 9, 4].iter().map(|&n| Tensor::randn([5, n, 8], (Kind::Float, tch::Device::Cpu)) * 30.0).collect();
    let min_scaled = |m: &VqaModel| -> Result<f64> {
        let fused = m.fusion.forward(&views, Mode::EVAL)?;
        let mut worst = f64::INFINITY;
        for w in &fused.weights {
            let mass = probattn::diagnostics::received_mass(w);
            worst = worst.min(f64::try_from(mass.min())? * w.size()[3] as f64);
        }
        Ok(worst)
    };
    let (d, s) = (min_scaled(&dnas)?, min_scaled(&softmax)?);
    ensure!(d >= 1.0 - 1e-5, "DNAS: the least-attended box gets {d} x 1/keys");
    ensure!(s < 0.1, "softmax: expected an explained-away box at these scales, the least gets {s} x 1/keys");
    Ok(())
}

#[test]
fn wrong_view_shapes_are_named() -> Result<()> {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let cfg = config(
        &serde_json::json!({"fusion": "softmax", "regions": [3, 4, 5], "dim": 8, "vocab": 5, "word_dim": 4, "question_dim": 4, "hidden": 8, "reasoning_layers": 1, "reasoning_prenorm": false, "glimpses": 1, "answers": 3}),
    )?;
    let model = VqaModel::new(&vs.root(), cfg)?;
    let tokens = Tensor::from_slice(&[1i64, 2, 0, 3, 0, 0]).view([2, 3]);
    let good = |n: i64| Tensor::zeros([2, n, 8], (Kind::Float, tch::Device::Cpu));
    let err = model.forward(&[good(3), good(4)], &tokens, Mode::EVAL).unwrap_err().to_string();
    ensure!(err.contains("3 views, got 2"), "{err}");
    let err = model
        .forward(&[good(3), Tensor::zeros([2, 4, 7], (Kind::Float, tch::Device::Cpu)), good(5)], &tokens, Mode::EVAL)
        .unwrap_err()
        .to_string();
    ensure!(err.contains("view 1 has shape [2, 4, 7]"), "{err}");
    Ok(())
}

#[test]
fn the_primary_read_unfused_needs_attention_and_one_way() -> Result<()> {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let cfg = config(
        &serde_json::json!({"fusion": "none", "regions": [3, 4, 5], "dim": 8, "vocab": 5, "word_dim": 4, "question_dim": 4, "hidden": 8, "reasoning_layers": 0, "reasoning_prenorm": false, "glimpses": 1, "answers": 3, "primary_skip": true}),
    )?;
    let err = VqaModel::new(&vs.root(), cfg).unwrap_err().to_string();
    ensure!(err.contains("primary_skip and primary_beside need an attention fusion"), "{err}");
    let mut cfg = config(
        &serde_json::json!({"fusion": "dnas", "regions": [3, 4, 5], "dim": 8, "vocab": 5, "word_dim": 4, "question_dim": 4, "hidden": 8, "reasoning_layers": 0, "reasoning_prenorm": false, "glimpses": 1, "answers": 3, "primary_skip": true}),
    )?;
    cfg.primary_beside = true;
    let err = VqaModel::new(&vs.root(), cfg).unwrap_err().to_string();
    ensure!(err.contains("choose one"), "{err}");
    Ok(())
}

#[test]
fn a_tiled_fusion_equals_the_eager_one() -> Result<()> {
    // Same weights, float64, every fusion variant: the fused boxes and the gradients of every
    // parameter agree; the tiled fusion's received mass is the eager weights' column sums.
    let _serial = common::serial();
    tch::manual_seed(5);
    let case = serde_json::json!({"fusion": "softmax", "regions": [7, 5, 4], "dim": 8, "vocab": 5, "word_dim": 4, "question_dim": 4, "hidden": 8, "reasoning_layers": 0, "reasoning_prenorm": false, "glimpses": 1, "answers": 3});
    let views: Vec<Tensor> = [7, 5, 4].iter().map(|&n| Tensor::randn([3, n, 8], (Kind::Double, tch::Device::Cpu)) * 3.0).collect();
    for fusion in ["softmax", "dnas", "hnas", "sinkhorn-3", "bam-wc"] {
        let mut cfg = config(&case)?;
        cfg.fusion = Some(fusion.parse()?);
        cfg.attention_dropout = 0.0;
        let run = |tile: Option<i64>, from: Option<&nn::VarStore>| -> Result<(nn::VarStore, Tensor, Vec<Tensor>, Vec<Tensor>)> {
            let mut vs = nn::VarStore::new(tch::Device::Cpu);
            let model = VqaModel::new(&vs.root(), VqaConfig { tile, ..cfg.clone() })?;
            vs.double();
            if let Some(from) = from {
                vs.copy(from)?;
            }
            let fused = model.fusion.forward(&views, Mode::EVAL)?;
            fused.boxes.square().sum(Kind::Double).backward();
            let mut grads: Vec<(String, Tensor)> =
                vs.variables().into_iter().filter(|(n, _)| n.starts_with("fusion")).map(|(n, t)| (n, t.grad())).collect();
            grads.sort_by(|a, b| a.0.cmp(&b.0));
            let mass =
                if tile.is_some() { fused.received_mass } else { fused.weights.iter().map(probattn::diagnostics::received_mass).collect() };
            Ok((vs, fused.boxes.detach(), grads.into_iter().map(|(_, g)| g).collect(), mass))
        };
        let (vs, eager, eager_grads, eager_mass) = run(None, None)?;
        let (_, tiled, tiled_grads, tiled_mass) = run(Some(3), Some(&vs))?;
        let e = scaled_error(&tiled, &eager)?;
        ensure!(e <= 1e-10, "{fusion}: boxes differ by {e}");
        ensure!(!eager_grads.is_empty() && eager_grads.len() == tiled_grads.len(), "{fusion}: parameters");
        for (a, b) in tiled_grads.iter().zip(&eager_grads) {
            let e = scaled_error(a, b)?;
            ensure!(e <= 1e-10, "{fusion}: a gradient differs by {e}");
        }
        ensure!(eager_mass.len() == 2 && tiled_mass.len() == 2, "{fusion}: one mass per secondary view");
        for (a, b) in tiled_mass.iter().zip(&eager_mass) {
            let e = scaled_error(a, b)?;
            ensure!(e <= 1e-10, "{fusion}: received mass differs by {e}");
        }
    }
    // The tiled fusion has no attention dropout: a configuration with both is refused by name.
    let mut cfg = config(&case)?;
    cfg.tile = Some(4);
    let err = VqaModel::new(&nn::VarStore::new(tch::Device::Cpu).root(), cfg).unwrap_err().to_string();
    ensure!(err.contains("attention_dropout 0"), "{err}");
    Ok(())
}
