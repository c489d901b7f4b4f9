//! Properties of the normalizers that need no reference implementation: the DNAS paper's
//! Theorem 2, Sinkhorn's limits, masks at extreme scores, diagnostics, and clear errors.

mod common;

use anyhow::Result;
use common::devices;
use probattn::diagnostics::{explained_away_fraction, received_mass, EXPLAINED_AWAY_EPS};
use probattn::normalize::BamConfig;
use probattn::{attend, AttendOptions, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention, Normalizer, NormalizerConfig, Variant};
use tch::{nn, Device, Kind, Tensor};

const ALL: [&str; 5] = ["softmax", "dnas", "hnas", "sinkhorn-1", "sinkhorn-4"];
const BAM: [&str; 5] = ["bam-nokl", "bam-lf", "bam-lc", "bam-wf", "bam-wc"];

/// A normalizer for `heads` heads of keys with 4 features (the key size matters only to BAM's
/// contextual prior; every test here uses d = 4 where it builds one). BAM gets k = 5, noisier
/// than its default, so sampling shows.
fn normalizer(name: &str, heads: i64, device: Device) -> Result<(nn::VarStore, Box<dyn Normalizer>)> {
    let vs = nn::VarStore::new(device);
    let cfg = NormalizerConfig { bam: BamConfig { k: 5.0, ..Default::default() }, ..Default::default() };
    let n = name.parse::<Variant>()?.build(&vs.root(), heads, 4, &cfg)?;
    Ok((vs, n))
}

fn randn(shape: &[i64], kind: Kind, device: Device) -> Tensor {
    Tensor::randn(shape, (kind, device))
}

/// Random masks with fully masked rows and columns: (key_padding, attn_mask).
fn random_masks(b: i64, sq: i64, sk: i64, device: Device) -> (Tensor, Tensor) {
    let kp = Tensor::rand([b, sk], (Kind::Float, device)).lt(0.2);
    let am = Tensor::rand([sq, sk], (Kind::Float, device)).lt(0.3);
    let _ = am.get(0).fill_(1); // query 0 sees nothing
    let _ = am.select(1, sk - 1).fill_(1); // the last key is seen by nobody
    (kp, am)
}

#[test]
fn dnas_gives_every_key_at_least_one_over_s_k() -> Result<()> {
    let _serial = common::serial();
    // Theorem 2 of Ding et al. 2020: Σ_i π_ij ≥ 1/S_k for every key j with an allowed query.
    tch::manual_seed(1);
    for device in devices() {
        let (_vs, dnas) = normalizer("dnas", 3, device)?;
        for (sq, sk) in [(5, 5), (3, 11), (12, 4), (1, 7)] {
            let q = randn(&[2, 3, sq, 4], Kind::Double, device) * 4.0;
            let k = randn(&[2, 3, sk, 4], Kind::Double, device) * 4.0;
            let v = randn(&[2, 3, sk, 2], Kind::Double, device);
            let (kp, am) = random_masks(2, sq, sk, device);
            let masks = Masks { key_padding: Some(&kp), attn_mask: Some(&am), ..Default::default() };
            let w = attend(&q, &k, &v, &masks, dnas.as_ref(), AttendOptions::default())?.into_weights()?;
            let allowed = masks.allowed(probattn::ScoreShape { batch: 2, heads: 3, queries: sq, keys: sk }, device)?.unwrap();
            let has_query = allowed.expand([2, 3, sq, sk], false).any_dim(-2, false); // (B, H, S_k)
            let mass = received_mass(&w);
            let floor = 1.0 / sk as f64 - 1e-12;
            let violated = mass.lt(floor).logical_and(&has_query);
            assert!(!bool::try_from(violated.any())?, "a key got less than 1/{sk}: {mass}");
            // Keys nobody may attend receive exactly nothing.
            let unseen = mass.masked_select(&has_query.logical_not());
            assert!(bool::try_from(unseen.eq(0.0).all())?);
            assert_eq!(explained_away_fraction(&mass, Some(&has_query), EXPLAINED_AWAY_EPS)?, 0.0);
        }
    }
    Ok(())
}

#[test]
fn softmax_explains_keys_away_where_dnas_does_not() -> Result<()> {
    let _serial = common::serial();
    // One dominant key: softmax starves the others (mass < 1e-8), DNAS cannot.
    let q = Tensor::ones([1, 1, 4, 2], (Kind::Double, Device::Cpu)) * 10.0;
    let k = Tensor::from_slice(&[3.0f64, 3.0, 0.0, 0.0, -3.0, -3.0]).view([1, 1, 3, 2]);
    let v = Tensor::eye(3, (Kind::Double, Device::Cpu)).view([1, 1, 3, 3]);
    let mut fractions = vec![];
    for name in ["softmax", "dnas"] {
        let (_vs, n) = normalizer(name, 1, Device::Cpu)?;
        let w = attend(&q, &k, &v, &Masks::default(), n.as_ref(), AttendOptions::default())?.into_weights()?;
        fractions.push(explained_away_fraction(&received_mass(&w), None, EXPLAINED_AWAY_EPS)?);
    }
    assert_eq!(fractions, vec![2.0 / 3.0, 0.0]);
    Ok(())
}

#[test]
fn sinkhorn_one_equals_dnas() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(2);
    for device in devices() {
        let (_a, dnas) = normalizer("dnas", 2, device)?;
        let (_b, sk1) = normalizer("sinkhorn-1", 2, device)?;
        let q = randn(&[3, 2, 6, 5], Kind::Double, device) * 5.0;
        let k = randn(&[3, 2, 9, 5], Kind::Double, device) * 5.0;
        let v = randn(&[3, 2, 9, 3], Kind::Double, device);
        let (kp, am) = random_masks(3, 6, 9, device);
        let masks = Masks { key_padding: Some(&kp), attn_mask: Some(&am), ..Default::default() };
        let a = attend(&q, &k, &v, &masks, dnas.as_ref(), AttendOptions::default())?.into_weights()?;
        let b = attend(&q, &k, &v, &masks, sk1.as_ref(), AttendOptions::default())?.into_weights()?;
        let err = f64::try_from((a - b).abs().max())?;
        assert!(err < 1e-12, "sinkhorn-1 and dnas differ by {err}");
    }
    Ok(())
}

#[test]
fn sinkhorn_fifty_is_doubly_stochastic_on_square_scores() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(3);
    for device in devices() {
        let (_vs, sk50) = normalizer("sinkhorn-50", 4, device)?;
        let q = randn(&[2, 4, 16, 8], Kind::Float, device);
        let k = randn(&[2, 4, 16, 8], Kind::Float, device);
        let v = randn(&[2, 4, 16, 8], Kind::Float, device);
        let w = attend(&q, &k, &v, &Masks::default(), sk50.as_ref(), AttendOptions::default())?.into_weights()?;
        for dim in [-1i64, -2] {
            let sums = w.sum_dim_intlist(&[dim][..], false, Kind::Double);
            let err = f64::try_from((sums - 1.0).abs().max())?;
            assert!(err < 1e-4, "sums over dim {dim} are off by {err}");
        }
    }
    Ok(())
}

#[test]
fn masked_rows_and_columns_give_zeros_and_no_nan_at_extreme_scores() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(4);
    for device in devices() {
        for kind in [Kind::Float, Kind::Double] {
            // Every variant, BAM sampling (training mode) with its KL in the loss.
            for name in ALL.into_iter().chain(BAM) {
                let (mut vs, n) = normalizer(name, 2, device)?;
                if kind == Kind::Double {
                    vs.double();
                }
                let (b, sq, sk, d) = (2, 5, 7, 4);
                // Scores up to ±1e4 (d = 4, so q·k/2 with entries of 100).
                let q = (randn(&[b, 2, sq, d], kind, device).sign() * 100.0).set_requires_grad(true);
                let k = (randn(&[b, 2, sk, d], kind, device).sign() * 50.0).set_requires_grad(true);
                let v = randn(&[b, 2, sk, 3], kind, device).set_requires_grad(true);
                let (kp, am) = random_masks(b, sq, sk, device);
                let _ = kp.get(1).fill_(1); // the second sequence has no keys at all
                let qp = Tensor::zeros([b, sq], (Kind::Bool, device));
                let _ = qp.get(0).narrow(0, sq - 1, 1).fill_(1);
                let masks = Masks { key_padding: Some(&kp), query_padding: Some(&qp), attn_mask: Some(&am), causal: false, bias: None };
                let out = attend(&q, &k, &v, &masks, n.as_ref(), AttendOptions { mode: Mode::TRAIN, ..Default::default() })?;
                let mut loss = out.output.sum(kind) + out.weights()?.square().sum(kind);
                if let Some(kl) = &out.kl {
                    assert!(bool::try_from(kl.isfinite())?, "{name} {kind:?}: KL {kl}");
                    loss += kl;
                }
                loss.backward();
                for (what, t) in [
                    ("weights", out.weights()?),
                    ("output", &out.output),
                    ("grad q", &q.grad()),
                    ("grad k", &k.grad()),
                    ("grad v", &v.grad()),
                ] {
                    assert!(bool::try_from(t.isfinite().all())?, "{name} {kind:?}: non-finite {what}");
                }
                let w = out.weights()?;
                let excluded =
                    masks.allowed(probattn::ScoreShape { batch: b, heads: 2, queries: sq, keys: sk }, device)?.unwrap().logical_not();
                assert!(bool::try_from(w.masked_select(&excluded.expand_as(w)).eq(0.0).all())?, "{name}: weight on a masked entry");
                // Each row sums to 1 if it has an allowed key, else to exactly 0.
                let row_allowed = excluded.logical_not().expand_as(w).any_dim(-1, false).to_kind(Kind::Double);
                let err = f64::try_from((w.sum_dim_intlist(&[-1i64][..], false, Kind::Double) - row_allowed).abs().max())?;
                assert!(err < 1e-5, "{name} {kind:?}: row sums off by {err}");
            }
        }
    }
    Ok(())
}

#[test]
fn doubly_normalized_variants_refuse_a_causal_mask() -> Result<()> {
    let _serial = common::serial();
    let x = Tensor::randn([1, 2, 4, 3], (Kind::Float, Device::Cpu));
    let masks = Masks { causal: true, ..Default::default() };
    for name in ["dnas", "hnas", "sinkhorn-2"] {
        let (_vs, n) = normalizer(name, 2, Device::Cpu)?;
        let err = attend(&x, &x, &x, &masks, n.as_ref(), AttendOptions::default()).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains("causal") && err.contains("leak"), "{err}");
    }
    let (_vs, softmax) = normalizer("softmax", 2, Device::Cpu)?;
    let w = attend(&x, &x, &x, &masks, softmax.as_ref(), AttendOptions::default())?.into_weights()?;
    assert!(bool::try_from(w.triu(1).eq(0.0).all())?, "causal softmax looked ahead");
    Ok(())
}

#[test]
fn bad_shapes_and_masks_are_named_in_the_error() -> Result<()> {
    let _serial = common::serial();
    let (_vs, n) = normalizer("dnas", 2, Device::Cpu)?;
    let t = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
    let run =
        |q: &Tensor, k: &Tensor, v: &Tensor, m: &Masks| attend(q, k, v, m, n.as_ref(), AttendOptions::default()).unwrap_err().to_string();
    let (q, k, v) = (t(&[2, 2, 3, 4]), t(&[2, 2, 5, 4]), t(&[2, 2, 5, 6]));
    let none = Masks::default();
    let cases: Vec<(String, &str)> = vec![
        (run(&t(&[2, 3, 4]), &k, &v, &none), "q has shape [2, 3, 4]"),
        (run(&q, &t(&[2, 2, 5, 3]), &v, &none), "head size"),
        (run(&q, &k, &t(&[2, 2, 4, 6]), &none), "number of keys"),
        (run(&q, &k, &t(&[1, 2, 5, 6]), &none), "must agree on batch (dim 0)"),
        (
            run(&q, &k, &v, &Masks { key_padding: Some(&Tensor::zeros([2, 3], (Kind::Bool, Device::Cpu))), ..none }),
            "key_padding_mask has shape [2, 3], expected [2, 5]",
        ),
        (
            run(&q, &k, &v, &Masks { attn_mask: Some(&Tensor::zeros([3, 4], (Kind::Bool, Device::Cpu))), ..none }),
            "attn_mask has shape [3, 4], which does not broadcast",
        ),
        (
            run(&q, &k, &v, &Masks { query_padding: Some(&Tensor::zeros([2, 3], (Kind::Float, Device::Cpu))), ..none }),
            "query_padding_mask has dtype Float",
        ),
    ];
    for (err, expected) in cases {
        assert!(err.contains(expected), "error '{err}' does not say '{expected}'");
    }
    let nan = t(&[2, 2, 3, 4]).fill_(f64::NAN);
    let err = probattn::check_finite("q", &nan).unwrap_err().to_string();
    assert!(err.contains("q holds 48 NaN"), "{err}");
    Ok(())
}

#[test]
fn hnas_starts_at_the_configured_gate_and_the_module_reports_it() -> Result<()> {
    let _serial = common::serial();
    let vs = nn::VarStore::new(Device::Cpu);
    let mut cfg = MhaConfig::new(8, 4).with_variant(Variant::Hnas);
    cfg.normalizer.hybrid_init_u = 0.1;
    let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
    let u = Vec::<f64>::try_from(mha.hybrid_u().expect("hnas has a gate").to_kind(Kind::Double))?;
    assert_eq!(u.len(), 4);
    assert!(u.iter().all(|x| (x - 0.1).abs() < 1e-6), "{u:?}");
    let x = Tensor::randn([2, 3, 8], (Kind::Float, Device::Cpu));
    let out = mha.forward_t(&MhaInput::self_attention(&x).with_weights(), false)?;
    assert_eq!(out.context.size(), vec![2, 3, 8]);
    assert_eq!(out.weights.map(|w| w.size()), Some(vec![2, 4, 3, 3]));
    let bad = MultiHeadAttention::new(&(vs.root() / "bad"), MhaConfig::new(10, 4)).unwrap_err().to_string();
    assert!(bad.contains("not divisible"), "{bad}");
    let mut cfg = MhaConfig::new(8, 2).with_variant(Variant::Hnas);
    cfg.normalizer.hybrid_init_u = 1.0;
    assert!(MultiHeadAttention::new(&(vs.root() / "bad2"), cfg).is_err());
    Ok(())
}

#[test]
fn dropout_acts_in_training_only_and_weights_are_taken_before_it() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(5);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let mut cfg = MhaConfig::new(16, 4).with_variant(Variant::Dnas);
    cfg.dropout = 0.5;
    let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
    vs.double();
    let x = Tensor::randn([2, 6, 16], (Kind::Double, Device::Cpu));
    let input = MhaInput::self_attention(&x).with_weights();
    let eval_a = mha.forward_t(&input, false)?;
    let eval_b = mha.forward_t(&input, false)?;
    assert!(eval_a.context.equal(&eval_b.context), "eval mode is not deterministic");
    let train = mha.forward_t(&input, true)?;
    assert!(!train.context.allclose(&eval_a.context, 1e-6, 1e-6, false), "dropout had no effect in training");
    // The returned weights are the normalizer's, before dropout: identical in both modes.
    let (wt, we) = (train.weights.unwrap(), eval_a.weights.unwrap());
    assert!(wt.allclose(&we, 1e-12, 1e-12, false));
    Ok(())
}

#[test]
fn softmax_with_weights_and_time_first_views_match_the_general_path() -> Result<()> {
    // The layer's softmax path (Softmax's fused form) fills the mask into its scores in place and
    // projects time-first views in their own layout; `attend` with a softmax that has no fused form
    // ([`PlainSoftmax`]) on a batch-first copy is the general path. Both must agree, forward and backward, with a fully padded sequence in the
    // batch (its rows are zero) and random biases.
    let _serial = common::serial();
    tch::manual_seed(11);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(16, 4))?;
    vs.double();
    tch::no_grad(|| {
        for (_, mut v) in vs.variables() {
            v.copy_(&Tensor::randn_like(&v));
        }
    });
    let bias = vs.variables()["in_proj_bias"].split(16, 0);
    let (b, s, h) = (3, 5, 4);
    let time_first = Tensor::randn([s, b, 16], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let padding = Tensor::from_slice(&[0u8, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]).view([b, s]).ne(0);
    let masks = Masks { key_padding: Some(&padding), ..Default::default() };
    let view = time_first.transpose(0, 1);
    let fast = mha.forward_t(&MhaInput::self_attention(&view).with_masks(masks).with_weights(), false)?;

    let copy = time_first.transpose(0, 1).contiguous();
    let heads = |i: usize| copy.linear(&mha.proj_weight(i as i64), Some(&bias[i])).view([b, s, h, 4]).transpose(1, 2);
    let general = attend(&heads(0), &heads(1), &heads(2), &masks, &PlainSoftmax, AttendOptions::default())?;
    let merged = general.output.transpose(1, 2).contiguous().view([b, s, 16]);
    let vars = vs.variables();
    let context = merged.linear(&vars["out_proj.weight"], Some(&vars["out_proj.bias"]));

    let weights = fast.weights.expect("weights were asked for");
    assert!(weights.allclose(general.weights()?, 0.0, 1e-12, false), "weights differ");
    assert!(fast.context.allclose(&context, 0.0, 1e-12, false), "outputs differ");
    assert_eq!(f64::try_from(weights.get(2).abs().max())?, 0.0, "a fully padded sequence must get zero weights");
    let r = Tensor::randn([b, s, 16], (Kind::Double, Device::Cpu));
    let grad = |out: &Tensor| -> Result<Vec<Tensor>> {
        let params: Vec<Tensor> = vars.values().map(Tensor::shallow_clone).collect();
        let mut wrt = vec![time_first.shallow_clone()];
        wrt.extend(params);
        Ok(Tensor::run_backward(&[(out * &r).sum(Kind::Double)], &wrt, true, false))
    };
    for (i, (gf, gg)) in grad(&fast.context)?.iter().zip(grad(&context)?.iter()).enumerate() {
        assert!(gf.allclose(gg, 0.0, 1e-12, false), "gradient {i} differs");
    }
    Ok(())
}

/// Softmax through the general path only: [`probattn::normalize::Softmax`]'s weights without its
/// fused form, as a user's own normalizer would be.
#[derive(Debug)]
struct PlainSoftmax;

impl Normalizer for PlainSoftmax {
    fn name(&self) -> String {
        "plain-softmax".into()
    }

    fn normalize(&self, input: &probattn::normalize::NormalizeInput) -> probattn::Result<probattn::normalize::Normalized> {
        probattn::normalize::Softmax.normalize(input)
    }
}

#[test]
fn a_user_normalizer_goes_into_the_layers_and_softmax_fused_forms_equal_the_general_path() -> Result<()> {
    // One layer's parameters, three ways to attend with softmax weights: the built-in normalizer
    // without weights (libtorch's fused kernel), with weights (the in-place form), and a user's
    // normalizer given to `with_normalizer` (the general path). Outputs and gradients agree in
    // float64, with key padding.
    let _serial = common::serial();
    tch::manual_seed(12);
    let run = |normalizer: Option<Box<dyn Normalizer>>, need_weights: bool| -> Result<(Tensor, Vec<Tensor>)> {
        tch::manual_seed(13);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let cfg = MhaConfig::new(16, 4);
        let mha = match normalizer {
            Some(n) => MultiHeadAttention::with_normalizer(&vs.root(), cfg, n)?,
            None => MultiHeadAttention::new(&vs.root(), cfg)?,
        };
        vs.double();
        let x = Tensor::randn([3, 6, 16], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let padding = Tensor::from_slice(&[0u8, 0, 0, 0, 1, 1]).view([1, 6]).ne(0).expand([3, 6], false);
        let mut input = MhaInput::self_attention(&x).with_masks(Masks { key_padding: Some(&padding), ..Default::default() });
        input.need_weights = need_weights;
        let out = mha.forward_t(&input, false)?;
        assert_eq!(out.weights.is_some(), need_weights);
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut wrt = vec![x.shallow_clone()];
        wrt.extend(vars.into_iter().map(|(_, v)| v));
        let grads = Tensor::run_backward(&[(&out.context * &out.context.sin()).sum(Kind::Double)], &wrt, false, false);
        Ok((out.context.detach(), grads))
    };
    let (kernel, kernel_grads) = run(None, false)?;
    let (in_place, in_place_grads) = run(None, true)?;
    let (user, user_grads) = run(Some(Box::new(PlainSoftmax)), false)?;
    for (name, (out, grads)) in [("fused kernel", (&kernel, &kernel_grads)), ("in place", (&in_place, &in_place_grads))] {
        let d = f64::try_from((out - &user).abs().max())?;
        assert!(d < 1e-12, "{name}: outputs differ from the general path by {d}");
        for (i, (a, b)) in grads.iter().zip(&user_grads).enumerate() {
            let d = f64::try_from((a - b).abs().max())?;
            assert!(d < 1e-12, "{name}: gradient {i} differs from the general path's by {d}");
        }
    }
    // tch's ModuleT: self-attention without masks, the same context as the inherent forward.
    let vs = nn::VarStore::new(Device::Cpu);
    let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(16, 4))?;
    let x = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu));
    let via_trait = x.apply_t(&mha, false);
    assert!(via_trait.equal(&mha.forward_t(&MhaInput::self_attention(&x), false)?.context));
    Ok(())
}

/// Softmax without weights takes SDPA's kernel (`Route::Kernel`) wherever it serves the call, and
/// equals the eager form there, output and gradients in float64: on every device without a mask,
/// with the causal mask alone (S_q below and above S_k), with a scale and with grouped key/value
/// heads. A mask that can leave a query without keys (key padding) keeps the kernel on the CPU,
/// whose zero rows are checked, and the eager form on CUDA, where they are not yet.
#[test]
fn softmax_takes_sdpas_kernel_wherever_it_gives_the_eager_result() -> Result<()> {
    use probattn::attend_with_choice;
    use probattn::backend::{Backend, Route};
    let _serial = common::serial();
    tch::manual_seed(31);
    let mut compared = 0;
    for device in devices() {
        for (sq, sk, kv_heads, causal, scale) in
            [(5, 7, 4, false, None), (5, 7, 4, true, None), (7, 5, 4, true, Some(0.3)), (5, 7, 2, false, Some(0.7)), (6, 6, 1, true, None)]
        {
            let x = |s: i64, h: i64| randn(&[2, h, s, 8], Kind::Double, device).set_requires_grad(true);
            let (q, k, v) = (x(sq, 4), x(sk, kv_heads), x(sk, kv_heads));
            let padding =
                Tensor::from_slice(&[0u8, 0, 0, 1, 1, 1, 1][..sk as usize]).ne(0).to_device(device).view([1, sk]).expand([2, sk], false);
            for padded in [false, true] {
                let masks = Masks { causal, key_padding: padded.then_some(&padding), ..Default::default() };
                let what = format!("{device:?} S_q {sq} S_k {sk} kv heads {kv_heads} causal {causal} scale {scale:?} padded {padded}");
                let run = |backend| -> Result<(Tensor, Vec<Tensor>, Route)> {
                    let opts = AttendOptions { need_weights: false, scale, enable_gqa: kv_heads != 4, backend, ..Default::default() };
                    let (out, choice) = attend_with_choice(&q, &k, &v, &masks, &probattn::normalize::Softmax, opts)?;
                    let grads = Tensor::run_backward(&[(&out.output * &out.output.cos()).sum(Kind::Double)], &[&q, &k, &v], false, false);
                    Ok((out.output, grads, choice.route))
                };
                let (out, grads, route) = run(Backend::Auto)?;
                let (eager, eager_grads, _) = run(Backend::Eager)?;
                let expected = if padded && device.is_cuda() { Route::Eager } else { Route::Kernel };
                assert_eq!(route, expected, "{what}");
                let d = f64::try_from((&out - &eager).abs().max())?;
                assert!(d < 1e-12, "{what}: the output differs from the eager form's by {d:e}");
                for (i, (a, b)) in grads.iter().zip(&eager_grads).enumerate() {
                    let d = f64::try_from((a - b).abs().max())?;
                    assert!(d < 1e-12, "{what}: gradient {i} differs from the eager form's by {d:e}");
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 10 * devices().len());
    Ok(())
}
