//! Repulsive attention: the SVGD/SPOS direction against the PyTorch reference, its limits and
//! symmetries, real repulsion, the hook on a real MultiHeadAttention stack with nn::Adam, and
//! head diversity on a small model whose heads tend to collapse.

mod common;

use anyhow::{Context, Result};
use common::{load, manifest, run_python, scaled_error, TempDir};
use probattn::repulsive::{
    direction, head_diversity, Bandwidth, Method, ModuleKind, Projection, RepulsiveConfig, RepulsiveHook, Selection,
};
use probattn::{MhaConfig, MhaInput, MultiHeadAttention};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn cfg(method: Method, alpha: f64, stepsize: f64) -> RepulsiveConfig {
    RepulsiveConfig { method, alpha, stepsize, ..Default::default() }
}

#[test]
fn direction_matches_the_pytorch_reference() -> Result<()> {
    let _serial = common::serial();
    let dir = TempDir::new("parity-svgd")?;
    run_python("reference.parity", &["svgd-cases", "--out", &dir.0.to_string_lossy(), "--seed", "3"])?;
    let mut worst: f64 = 0.0;
    for case in manifest(&dir.0)? {
        let name = case["name"].as_str().context("name")?;
        let t = load(&dir.path(&format!("{name}.safetensors")))?;
        let config = RepulsiveConfig {
            method: if case["method"] == "spos" { Method::Spos } else { Method::Svgd },
            alpha: case["alpha"].as_f64().context("alpha")?,
            stepsize: case["stepsize"].as_f64().context("stepsize")?,
            beta: case["beta"].as_f64().context("beta")?,
            bandwidth: case["bandwidth"].as_f64().map_or(Bandwidth::Median, Bandwidth::Fixed),
        };
        let ours = direction(&t["theta"], &t["grad"], &config, Some(&t["xi"]))?;
        assert!(bool::try_from(ours.isfinite().all())?, "{name}: non-finite direction");
        let err = scaled_error(&ours, &t["direction"])?;
        worst = worst.max(err);
        anyhow::ensure!(err <= 1e-10, "{name} ({config:?}): differs by {err:.3e}");
    }
    println!("SVGD/SPOS direction, float64: largest scaled error {worst:.2e}");
    Ok(())
}

#[test]
fn one_particle_without_repulsion_gets_stepsize_times_its_gradient() -> Result<()> {
    let _serial = common::serial();
    for alpha in [0.0, 0.7] {
        let theta = Tensor::randn([1, 1, 9], (Kind::Double, Device::Cpu));
        let grad = Tensor::randn([1, 1, 9], (Kind::Double, Device::Cpu));
        let d = direction(&theta, &grad, &cfg(Method::Svgd, alpha, 0.3), None)?;
        assert!(d.equal(&(&grad * 0.3)), "alpha {alpha}: {d} vs {}", &grad * 0.3);
    }
    // Through the hook, on a parameter's gradient.
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().var("w", &[1, 5], nn::Init::Randn { mean: 0.0, stdev: 1.0 });
    let mut hook = RepulsiveHook::new(cfg(Method::Svgd, 0.0, 0.25), Selection::default())?;
    hook.add_rows("w", &w, ModuleKind::Other, 0)?;
    (&w * Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0])).sum(Kind::Float).backward();
    let before = w.grad().copy();
    hook.apply()?;
    assert!(w.grad().equal(&(before * 0.25)));
    Ok(())
}

fn min_pairwise_distance(theta: &Tensor) -> f64 {
    let d = Tensor::cdist(theta, theta, 2.0, 2i64) + Tensor::eye(theta.size()[0], (Kind::Double, Device::Cpu)) * 1e9;
    f64::try_from(d.min()).expect("scalar")
}

#[test]
fn with_no_data_gradient_the_particles_strictly_spread() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let p = root.var("p", &[5, 8], nn::Init::Randn { mean: 0.0, stdev: 0.01 });
    let mut vs = vs;
    vs.double();
    let mut hook = RepulsiveHook::new(cfg(Method::Svgd, 1.0, 1.0), Selection::default())?;
    hook.add_rows("p", &p, ModuleKind::Other, 0)?;
    let mut sgd = nn::Sgd::default().build(&vs, 0.01)?;
    let mut last = min_pairwise_distance(&p.detach());
    for step in 0..50 {
        sgd.zero_grad();
        (&p * 0.0).sum(Kind::Double).backward(); // the data gradient is exactly zero
        hook.apply()?;
        sgd.step();
        let now = min_pairwise_distance(&p.detach());
        assert!(now > last, "step {step}: smallest distance {now} did not grow from {last}");
        last = now;
    }
    Ok(())
}

#[test]
fn permuting_the_particles_permutes_the_direction() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(2);
    let theta = Tensor::randn([2, 6, 11], (Kind::Double, Device::Cpu));
    let grad = Tensor::randn([2, 6, 11], (Kind::Double, Device::Cpu));
    let xi = Tensor::randn([2, 6, 11], (Kind::Double, Device::Cpu));
    let perm = Tensor::from_slice(&[3i64, 0, 5, 1, 4, 2]);
    for method in [Method::Svgd, Method::Spos] {
        let c = cfg(method, 0.5, 0.1);
        let d = direction(&theta, &grad, &c, Some(&xi))?.index_select(1, &perm);
        let dp = direction(&theta.index_select(1, &perm), &grad.index_select(1, &perm), &c, Some(&xi.index_select(1, &perm)))?;
        let err = f64::try_from((d - dp).abs().max())?;
        assert!(err < 1e-12, "{method:?}: permutation changed the direction by {err}");
    }
    Ok(())
}

#[test]
fn identical_particles_stay_finite() -> Result<()> {
    let _serial = common::serial();
    let theta = Tensor::ones([1, 4, 3], (Kind::Float, Device::Cpu));
    let grad = Tensor::randn([1, 4, 3], (Kind::Float, Device::Cpu));
    for method in [Method::Svgd, Method::Spos] {
        let d = direction(&theta, &grad, &cfg(method, 1.0, 0.01), None)?;
        assert!(bool::try_from(d.isfinite().all())?, "{method:?}: {d}");
    }
    Ok(())
}

/// A stack of two MultiHeadAttention layers (the first "encoder self", the second "cross").
fn stack(vs: &nn::VarStore) -> Result<Vec<MultiHeadAttention>> {
    (0..2).map(|i| Ok(MultiHeadAttention::new(&(vs.root() / format!("layer{i}")), MhaConfig::new(16, 4))?)).collect()
}

#[test]
fn the_hook_replaces_only_the_selected_gradients_and_works_with_adam() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let layers = stack(&vs)?;
    let selection = Selection { layers: Some(vec![0]), projections: Some(vec![Projection::Q]), kinds: None };
    let mut hook = RepulsiveHook::new(cfg(Method::Svgd, 1.0, 0.5), selection)?;
    hook.add_attention("layer0", &layers[0], ModuleKind::EncoderSelf, 0);
    hook.add_attention("layer1", &layers[1], ModuleKind::Cross, 1);
    assert_eq!(hook.sets().iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), vec!["layer0.q"]);

    let mut adam = nn::Adam::default().build(&vs, 1e-3)?;
    let x = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu));
    let h = layers[0].forward_t(&MhaInput::self_attention(&x), true)?.context;
    let y = layers[1].forward_t(&MhaInput::cross_attention(&h, &x), true)?.context;
    adam.zero_grad();
    y.square().mean(Kind::Float).backward();
    let before: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.grad().copy())).collect();
    hook.apply()?;
    for (name, old) in before {
        let new = vs.variables()[&name].grad();
        if name == "layer0.in_proj_weight" {
            assert!(!new.narrow(0, 0, 16).equal(&old.narrow(0, 0, 16)), "the Q rows were not replaced");
            assert!(new.narrow(0, 16, 32).equal(&old.narrow(0, 16, 32)), "K and V rows changed");
        } else {
            assert!(new.equal(&old), "{name} changed");
        }
    }
    adam.step();
    Ok(())
}

/// Trains token embeddings + one 4-head attention layer + a classifier on a task every head can
/// solve alone (predict the first token), where heads tend to collapse onto one pattern; returns
/// the heads' diversity "Dist" on a held-out batch.
fn train_small_model(repulsive: Option<RepulsiveConfig>) -> Result<f64> {
    tch::manual_seed(42);
    let device = Device::Cpu;
    let vs = nn::VarStore::new(device);
    let root = vs.root();
    let (vocab, len, embed) = (12, 6, 16);
    let tokens = nn::embedding(&root / "tokens", vocab, embed, Default::default());
    let positions = root.var("positions", &[len, embed], nn::Init::Randn { mean: 0.0, stdev: 0.1 });
    let mha = MultiHeadAttention::new(&(&root / "attn"), MhaConfig::new(embed, 4))?;
    let classifier = nn::linear(&root / "out", embed, vocab, Default::default());
    let mut hook = match repulsive {
        Some(c) => {
            let mut h = RepulsiveHook::new(c, Selection::default())?;
            h.add_attention("attn", &mha, ModuleKind::EncoderSelf, 0);
            Some(h)
        }
        None => None,
    };
    let mut adam = nn::Adam::default().build(&vs, 1e-2)?;
    let forward = |ids: &Tensor, heads: bool| -> Result<(Tensor, Option<Tensor>)> {
        let x = ids.apply(&tokens) + &positions; // (B, S, E)
        let input = MhaInput::self_attention(&x);
        let out = mha.forward_t(&if heads { input.with_head_outputs() } else { input }, false)?;
        Ok((classifier.forward(&out.context.mean_dim(&[1i64][..], false, Kind::Float)), out.head_outputs))
    };
    for _ in 0..300 {
        let ids = Tensor::randint(vocab, [32, len], (Kind::Int64, device));
        let (logits, _) = forward(&ids, false)?;
        let loss = logits.cross_entropy_for_logits(&ids.select(1, 0));
        adam.zero_grad();
        loss.backward();
        if let Some(h) = &mut hook {
            h.apply()?;
        }
        adam.step();
    }
    let ids = Tensor::randint(vocab, [256, len], (Kind::Int64, device));
    let (logits, heads) = tch::no_grad(|| forward(&ids, true))?;
    let accuracy = f64::try_from(logits.argmax(-1, false).eq_tensor(&ids.select(1, 0)).to_kind(Kind::Double).mean(Kind::Double))?;
    assert!(accuracy > 0.9, "the small model did not learn the task (accuracy {accuracy})");
    Ok(head_diversity(&heads.context("head outputs")?, None)?)
}

#[test]
fn repulsion_keeps_heads_more_diverse_at_the_same_seed() -> Result<()> {
    let _serial = common::serial();
    let without = train_small_model(None)?;
    let with = train_small_model(Some(cfg(Method::Svgd, 1.0, 1.0)))?;
    println!("head diversity Dist: without the hook {without:.4}, with SVGD {with:.4}");
    assert!(with > without, "Dist with SVGD {with} is not above Dist without {without}");
    Ok(())
}

#[test]
fn q_k_and_v_processed_together_equal_three_separate_sets() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(4);
    let vs = nn::VarStore::new(Device::Cpu);
    let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(12, 3))?;
    let c = cfg(Method::Svgd, 0.5, 0.1);
    let mut hook = RepulsiveHook::new(c.clone(), Selection::default())?;
    hook.add_attention("attn", &mha, ModuleKind::EncoderSelf, 0);
    let x = Tensor::randn([2, 4, 12], (Kind::Float, Device::Cpu));
    mha.forward_t(&MhaInput::self_attention(&x), false)?.context.sum(Kind::Float).backward();
    let w = &vs.variables()["in_proj_weight"];
    let expected: Vec<Tensor> = (0..3)
        .map(|i| {
            let view = |t: &Tensor| t.narrow(0, i * 12, 12).view([1, 3, 48]);
            direction(&view(w), &view(&w.grad()), &c, None).map(|d| d.view([12, 12]))
        })
        .collect::<probattn::Result<_>>()?;
    hook.apply()?;
    assert!(w.grad().equal(&Tensor::cat(&expected, 0)));
    Ok(())
}
