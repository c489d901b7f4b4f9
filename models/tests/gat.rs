//! The edge-list GAT layer against python/probattn_tools/baselines/gat.py (the PyTorch GAT written separately
//! from the same formulas): same weights, eval mode, float64 outputs and gradients within 1e-10.

#[path = "../../tests/common/mod.rs"]
mod common;

use anyhow::{Context, Result};
use common::{load, manifest, run_python, scaled_error, TempDir};
use probattn::normalize::{EdgeList, Support};
use probattn::{Mode, Variant};
use probattn_models::gat::{dropout, Features, GatConfig, GatLayer};
use tch::{nn, Kind};

#[test]
fn gat_layer_matches_the_pytorch_baseline() -> Result<()> {
    let _serial = common::serial();
    let dir = TempDir::new("parity-gat")?;
    run_python("reference.parity", &["gat-cases", "--out", &dir.0.to_string_lossy(), "--seed", "9"])?;
    for case in manifest(&dir.0)? {
        let name = case["name"].as_str().context("name")?;
        let int = |k: &str| case[k].as_i64().context("int");
        let t = load(&dir.path(&format!("{name}.safetensors")))?;
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = GatConfig::transductive(Variant::Softmax);
        let concat = case["concat"].as_bool().context("concat")?;
        let layer = GatLayer::new(&vs.root(), int("in")?, int("out")?, int("heads")?, concat, &cfg)?;
        vs.double();
        vs.load(dir.path(&format!("{name}.weights.safetensors")))?;
        let n = int("nodes")?;
        let support = Support::Edges(EdgeList::new(t["edge_dst"].shallow_clone(), t["edge_src"].shallow_clone(), n, n)?);
        let x = t["x"].set_requires_grad(true);
        let (out, _) = layer.forward(&Features::Dense(x.shallow_clone()), &support, Mode::EVAL, &cfg)?;
        (&out * &t["cotangent"]).sum(Kind::Double).backward();
        let mut compared = vec![("output".to_string(), out.detach()), ("grad.x".to_string(), x.grad())];
        for (param, var) in vs.variables() {
            compared.push((format!("grad.{param}"), var.grad()));
        }
        for (what, ours) in compared {
            let err = scaled_error(&ours, &t[&what])?;
            anyhow::ensure!(err <= 1e-10, "{name}: {what} differs by {err:.3e}");
        }
    }
    Ok(())
}

#[test]
fn dropout_draws_the_same_masks_in_bfloat16_as_in_float32() -> Result<()> {
    // The masks a seed draws do not depend on the precision of what they drop (a bfloat16 uniform
    // of libtorch's keeps 8 random bits, other bits than a float32 one's), and 1 - p are kept.
    let _serial = common::serial();
    let x = tch::Tensor::ones([400, 500], (Kind::Float, tch::Device::Cpu));
    let mut kept = Vec::new();
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        tch::manual_seed(11);
        kept.push(dropout(&x.to_kind(kind), 0.6, true).ne(0.0));
    }
    for (kind, mask) in ["bfloat16", "half"].iter().zip(&kept[1..]) {
        anyhow::ensure!(mask.equal(&kept[0]), "{kind} dropout drew other masks than float32 with the same seed");
    }
    // 200,000 draws: the kept fraction's standard deviation is 0.0011; the bound is 3 of them.
    let rate = kept[1].to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
    anyhow::ensure!((rate - 0.4).abs() < 0.0033, "kept {rate:.4} of the entries at p = 0.6");
    // Kept entries are scaled by 1 / (1 - p) in the input's precision.
    let scaled = dropout(&x.to_kind(Kind::BFloat16), 0.6, true);
    anyhow::ensure!(scaled.kind() == Kind::BFloat16 && scaled.max().double_value(&[]) == 2.5, "kept entries are not 2.5");
    Ok(())
}

#[test]
fn sparse_and_dense_inputs_give_the_same_layer_output() -> Result<()> {
    // libtorch's generator is global: without the lock another test's draws interleave with ours.
    let _serial = common::serial();
    tch::manual_seed(5);
    let x = tch::Tensor::rand([6, 9], (Kind::Float, tch::Device::Cpu)).lt(0.3).to_kind(Kind::Float);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let cfg = GatConfig::transductive(Variant::Dnas);
    let layer = GatLayer::new(&vs.root(), 9, 4, 2, true, &cfg)?;
    let ring: Vec<i64> = (0..6).collect();
    let dst = tch::Tensor::from_slice(&[ring.clone(), ring.clone()].concat());
    let src = tch::Tensor::from_slice(&[ring.clone(), ring.iter().map(|i| (i + 1) % 6).collect()].concat());
    let support = Support::Edges(EdgeList::new(dst, src, 6, 6)?);
    let (dense, _) = layer.forward(&Features::Dense(x.shallow_clone()), &support, Mode::EVAL, &cfg)?;
    let (sparse, _) = layer.forward(&Features::sparse_from_dense(&x), &support, Mode::EVAL, &cfg)?;
    assert!(dense.allclose(&sparse, 1e-6, 1e-6, false));
    Ok(())
}

#[test]
fn pubmed_configuration_trains_on_a_synthetic_graph() -> Result<()> {
    // Pubmed's files are incomplete here; its architecture (8 averaged output heads) still runs.
    use probattn_models::gat::Gat;
    use tch::nn::OptimizerConfig;
    let _serial = common::serial();
    tch::manual_seed(6);
    let (n, features, classes) = (30, 12, 3);
    let x = tch::Tensor::rand([n, features], (Kind::Float, tch::Device::Cpu));
    let labels = tch::Tensor::randint(classes, [n], (Kind::Int64, tch::Device::Cpu));
    let nodes: Vec<i64> = (0..n).collect();
    let dst = tch::Tensor::from_slice(&[nodes.clone(), nodes.clone()].concat());
    let src = tch::Tensor::from_slice(&[nodes.clone(), nodes.iter().map(|i| (i + 1) % n).collect()].concat());
    let support = Support::Edges(EdgeList::new(dst, src, n, n)?);
    for variant in ["softmax", "bam-wc"] {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let model = Gat::new(&vs.root(), features, classes, GatConfig::pubmed(variant.parse()?))?;
        let mut opt = nn::Adam::default().build(&vs, 0.01)?;
        let mut first = None;
        let mut last = 0.0;
        for _ in 0..30 {
            let out = model.forward(&Features::sparse_from_dense(&x), &support, Mode::TRAIN)?;
            assert_eq!(out.logits.size(), vec![n, classes]);
            let loss = out.logits.cross_entropy_for_logits(&labels);
            last = f64::try_from(&loss)?;
            first.get_or_insert(last);
            opt.backward_step(&loss);
        }
        let first = first.context("ran")?;
        assert!(last < first, "{variant}: training loss did not fall ({first} -> {last})");
    }
    Ok(())
}

/// DNAS's weights through a user's own normalizer (the trait, not the `Variant` enum).
#[derive(Debug)]
struct UserDnas;

impl probattn::Normalizer for UserDnas {
    fn name(&self) -> String {
        "user-dnas".into()
    }

    fn normalize(&self, input: &probattn::normalize::NormalizeInput) -> probattn::Result<probattn::normalize::Normalized> {
        probattn::normalize::Dnas.normalize(input)
    }
}

#[test]
fn a_user_normalizer_goes_into_gat_layers() -> Result<()> {
    // The same seed gives the same parameters to a layer built from the variant and one given a
    // user's normalizer; their outputs agree, and the user's normalizer is the one in the layer.
    let _serial = common::serial();
    let ring: Vec<i64> = (0..6).collect();
    let dst = tch::Tensor::from_slice(&[ring.clone(), ring.clone()].concat());
    let src = tch::Tensor::from_slice(&[ring.clone(), ring.iter().map(|i| (i + 2) % 6).collect()].concat());
    let support = Support::Edges(EdgeList::new(dst, src, 6, 6)?);
    let cfg = GatConfig::transductive(Variant::Dnas);
    let x = tch::Tensor::randn([6, 9], (Kind::Float, tch::Device::Cpu));
    let layer = |user: bool| -> Result<GatLayer> {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let make = |_: &nn::Path, _: i64, _: i64| -> probattn::Result<Box<dyn probattn::Normalizer>> { Ok(Box::new(UserDnas)) };
        Ok(if user {
            GatLayer::with_normalizer(&vs.root(), 9, 4, 2, true, &make)?
        } else {
            GatLayer::new(&vs.root(), 9, 4, 2, true, &cfg)?
        })
    };
    let (built, user) = (layer(false)?, layer(true)?);
    assert_eq!(user.normalizer().name(), "user-dnas");
    let (a, _) = built.forward(&Features::Dense(x.shallow_clone()), &support, Mode::EVAL, &cfg)?;
    let (b, _) = user.forward(&Features::Dense(x), &support, Mode::EVAL, &cfg)?;
    assert!(a.equal(&b), "a user's DNAS and the built-in one differ");
    Ok(())
}
