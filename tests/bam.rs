//! Bayesian attention modules: the statistics of the samplers, their limits, the analytic KL
//! terms against Monte Carlo, Monte Carlo prediction, and the KL's gradient. (Extreme inputs with
//! masked rows and columns: tests/normalizers.rs, for every variant.)
//! (Parity with the PyTorch reference, fixed noise included, is in tests/parity.rs.)

mod common;

use anyhow::Result;
use common::devices;
use probattn::mc::monte_carlo;
use probattn::normalize::{
    lognormal_kl, lognormal_log_sample, weibull_gamma_kl, weibull_log_sample, BamConfig, BamKind, ContextualPrior, PriorScope, Support,
};
use probattn::{attend, AttendOptions, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention, Normalizer, NormalizerConfig, Variant};
use tch::{nn, Device, Kind, Tensor};

const DRAWS: i64 = 100_000;

fn f64_of(t: &Tensor) -> f64 {
    f64::try_from(t).expect("a scalar")
}

fn bam(kind: BamKind, heads: i64, key_dim: i64, cfg: BamConfig, device: Device) -> Result<(nn::VarStore, Box<dyn Normalizer>)> {
    let vs = nn::VarStore::new(device);
    let n = Variant::Bam(kind).build(&vs.root(), heads, key_dim, &NormalizerConfig { bam: cfg, ..Default::default() })?;
    Ok((vs, n))
}

/// Mean and standard error of the mean of `x` (1-d).
fn mean_and_se(x: &Tensor) -> (f64, f64) {
    let n = x.numel() as f64;
    (f64_of(&x.mean(Kind::Double)), f64_of(&x.std(true)) / n.sqrt())
}

#[test]
fn unnormalized_samples_have_mean_pi() -> Result<()> {
    let _serial = common::serial();
    // E[S] = π for both distributions; the sample mean over 1e5 draws must lie within 4 standard
    // errors (a two-sided bound that a correct sampler violates with probability 6e-5).
    tch::manual_seed(10);
    for pi in [0.6f64, 0.05, 1e-3] {
        let log_pi = Tensor::full([DRAWS], pi.ln(), (Kind::Double, Device::Cpu));
        for k in [0.8, 2.0, 10.0, 1000.0] {
            let eps = Tensor::rand([DRAWS], (Kind::Double, Device::Cpu));
            let (mean, se) = mean_and_se(&weibull_log_sample(&log_pi, k, &eps).exp());
            assert!((mean - pi).abs() <= 4.0 * se + 1e-15, "Weibull k={k}, π={pi}: mean {mean}, se {se}");
        }
        for sigma in [0.1, 0.5, 1.0] {
            let eps = Tensor::randn([DRAWS], (Kind::Double, Device::Cpu));
            let (mean, se) = mean_and_se(&lognormal_log_sample(&log_pi, sigma, &eps).exp());
            assert!((mean - pi).abs() <= 4.0 * se, "Lognormal σ={sigma}, π={pi}: mean {mean}, se {se}");
        }
    }
    Ok(())
}

#[test]
fn sharp_limits_give_the_softmax_and_eval_gives_it_exactly() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(11);
    for device in devices() {
        let q = Tensor::randn([2, 3, 5, 4], (Kind::Float, device)) * 2.0;
        let k = Tensor::randn([2, 3, 7, 4], (Kind::Float, device)) * 2.0;
        let v = Tensor::randn([2, 3, 7, 6], (Kind::Float, device));
        let pad = Tensor::zeros([2, 7], (Kind::Bool, device));
        let _ = pad.get(1).narrow(0, 5, 2).fill_(1);
        let masks = Masks { key_padding: Some(&pad), ..Default::default() };
        let (_s, softmax) = (0, Variant::Softmax.build(&nn::VarStore::new(device).root(), 3, 4, &NormalizerConfig::default())?);
        let reference = attend(&q, &k, &v, &masks, softmax.as_ref(), AttendOptions::default())?.into_weights()?;
        for kind in BamKind::ALL {
            // At σ the weights move by about σ·|ε|·π(1 − π): σ = 1e-6 keeps that far below the
            // bound at any draw (1e-4 passed the CPU's draws and failed CUDA's).
            let cfg = BamConfig { k: 1e7, sigma: 1e-6, ..Default::default() };
            let (_vs, n) = bam(kind, 3, 4, cfg, device)?;
            let sampled = AttendOptions { mode: Mode::TRAIN, ..Default::default() };
            let w = attend(&q, &k, &v, &masks, n.as_ref(), sampled)?.into_weights()?;
            let err = f64_of(&(&w - &reference).abs().max());
            assert!(err < 1e-4, "{kind:?} in training mode at k = 1e7 / σ = 1e-6 differs from softmax by {err}");
            // Eval mode returns the mean, bit for bit, at the default (noisy) settings too.
            let (_vs, n) = bam(kind, 3, 4, BamConfig::default(), device)?;
            let w = attend(&q, &k, &v, &masks, n.as_ref(), AttendOptions::default())?.into_weights()?;
            assert!(w.equal(&reference), "{kind:?} in eval mode is not exactly the softmax");
        }
    }
    Ok(())
}

/// log-density of Weibull(k, λ) and Gamma(α, β) (rate β) at x.
fn weibull_log_pdf(x: &Tensor, k: f64, lambda: f64) -> Tensor {
    (x / lambda).log() * (k - 1.0) + (k / lambda).ln() - (x / lambda).pow_tensor_scalar(k)
}

fn gamma_log_pdf(x: &Tensor, alpha: f64, beta: f64) -> Tensor {
    x.log() * (alpha - 1.0) - x * beta + alpha * beta.ln() - f64_of(&Tensor::from(alpha).lgamma())
}

fn normal_log_pdf(y: &Tensor, mu: f64, sigma: f64) -> Tensor {
    -((y - mu) / sigma).square() / 2.0 - (sigma * (2.0 * std::f64::consts::PI).sqrt()).ln()
}

#[test]
fn analytic_kl_terms_agree_with_monte_carlo() -> Result<()> {
    let _serial = common::serial();
    // KL(q‖p) = E_q[log q(S) − log p(S)], estimated from 1e6 draws of q; within 2 percent.
    tch::manual_seed(12);
    let n = 1_000_000;
    let opts = (Kind::Double, Device::Cpu);
    let lgamma = |x: f64| f64_of(&Tensor::from(x).lgamma());
    for (pi, k, alpha, beta) in [(0.3f64, 2.0, 1.0, 1.0), (0.05, 10.0, 0.5, 2.0), (0.6, 1000.0, 1.0, 1.0), (0.2, 0.9, 2.0, 3.0)] {
        let lambda = pi / lgamma(1.0 + 1.0 / k).exp();
        let s = weibull_log_sample(&Tensor::full([n], pi.ln(), opts), k, &Tensor::rand([n], opts)).exp();
        let mc = f64_of(&(weibull_log_pdf(&s, k, lambda) - gamma_log_pdf(&s, alpha, beta)).mean(Kind::Double));
        let analytic = f64_of(&weibull_gamma_kl(&Tensor::from(pi.ln()), k, &Tensor::from(alpha), beta));
        assert!((mc - analytic).abs() <= 0.02 * analytic.abs(), "Weibull‖Gamma π={pi} k={k}: analytic {analytic}, MC {mc}");
    }
    for (pi, sigma, mu_p, sigma_p) in [(0.3f64, 1.0, 0.0, 1.0), (0.05, 0.3, -1.0, 0.5), (0.7, 2.0, -2.0, 1.5)] {
        let mu_q = pi.ln() - sigma * sigma / 2.0;
        // In log space both are normal; the KL of the Lognormals equals that of the normals.
        let y = lognormal_log_sample(&Tensor::full([n], pi.ln(), opts), sigma, &Tensor::randn([n], opts));
        let mc = f64_of(&(normal_log_pdf(&y, mu_q, sigma) - normal_log_pdf(&y, mu_p, sigma_p)).mean(Kind::Double));
        let analytic = f64_of(&lognormal_kl(&Tensor::from(mu_q), sigma, &Tensor::from(mu_p), sigma_p));
        assert!((mc - analytic).abs() <= 0.02 * analytic.abs(), "Lognormal π={pi} σ={sigma}: analytic {analytic}, MC {mc}");
    }
    Ok(())
}

#[test]
fn the_kl_keeps_its_gradient_to_scores_and_prior() -> Result<()> {
    let _serial = common::serial();
    // The authors' released ALBERT code detached the KL; here it must reach q, k and the prior.
    tch::manual_seed(14);
    for kind in [BamKind::WeibullContextual, BamKind::LognormalContextual, BamKind::WeibullFixed, BamKind::LognormalFixed] {
        let (vs, n) = bam(kind, 2, 4, BamConfig { k: 3.0, ..Default::default() }, Device::Cpu)?;
        let q = Tensor::randn([1, 2, 3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let k = Tensor::randn([1, 2, 5, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let v = Tensor::randn([1, 2, 5, 4], (Kind::Float, Device::Cpu));
        let out = attend(&q, &k, &v, &Masks::default(), n.as_ref(), AttendOptions { mode: Mode::TRAIN, ..Default::default() })?;
        let kl = out.kl.expect("KL in training mode");
        assert!(kl.requires_grad(), "{kind:?}: KL is detached");
        kl.backward();
        assert!(f64_of(&q.grad().abs().sum(Kind::Double)) > 0.0, "{kind:?}: no KL gradient to q");
        for (name, p) in vs.variables() {
            let grad = f64_of(&p.grad().abs().sum(Kind::Double));
            if name.ends_with("f2.bias") {
                // One constant per head under a softmax over the keys: the prior cannot depend on
                // it, so its gradient is zero up to rounding.
                assert!(grad < 1e-5, "{kind:?}: the softmax-invariant {name} has gradient {grad}");
            } else {
                assert!(grad > 0.0, "{kind:?}: no KL gradient to {name}");
            }
        }
        // No KL in eval mode, and none for bam-nokl.
        assert!(attend(&q, &k, &v, &Masks::default(), n.as_ref(), AttendOptions::default())?.kl.is_none());
    }
    let (_vs, nokl) = bam(BamKind::NoKl, 2, 4, BamConfig::default(), Device::Cpu)?;
    let x = Tensor::randn([1, 2, 3, 4], (Kind::Float, Device::Cpu));
    assert!(attend(&x, &x, &x, &Masks::default(), nokl.as_ref(), AttendOptions { mode: Mode::TRAIN, ..Default::default() })?.kl.is_none());
    Ok(())
}

#[test]
fn monte_carlo_prediction_spreads_only_with_stochastic_attention() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(15);
    let x = Tensor::randn([3, 6, 16], (Kind::Float, Device::Cpu)) * 3.0;
    let mut spreads = vec![];
    for variant in [Variant::Softmax, Variant::Bam(BamKind::WeibullContextual)] {
        let vs = nn::VarStore::new(Device::Cpu);
        let mut cfg = MhaConfig::new(16, 4).with_variant(variant);
        cfg.dropout = 0.5; // off under Mode::MONTE_CARLO
        cfg.normalizer.bam.k = 2.0;
        let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
        let prediction = tch::no_grad(|| {
            monte_carlo(20, |_| {
                let out = mha.forward_mode(&MhaInput::self_attention(&x), Mode::MONTE_CARLO)?;
                Ok(out.context.mean_dim(&[1i64][..], false, Kind::Float).softmax(-1, Kind::Float))
                // (B, E)
            })
        })?;
        assert_eq!(prediction.mean.size(), vec![3, 16]);
        assert_eq!(prediction.spread.size(), vec![3]);
        spreads.push(f64_of(&prediction.spread.max()));
    }
    assert_eq!(spreads[0], 0.0, "softmax without dropout must be deterministic");
    assert!(spreads[1] > 0.0, "BAM samples did not differ");
    assert!(monte_carlo(0, |_| Ok(Tensor::zeros([1], (Kind::Float, Device::Cpu)))).is_err());
    Ok(())
}

#[test]
fn drawn_noise_has_the_distribution_of_the_formula() -> Result<()> {
    let _serial = common::serial();
    // BAM draws Weibull noise as Exp(1) variates (−log(1−ε) for ε ~ U(0,1)); the mean normalized
    // weights must equal those from explicit uniform ε, within 4 standard errors per entry.
    tch::manual_seed(16);
    let n = 20_000;
    let q = Tensor::from_slice(&[1.0f64, -0.5]).view([1, 1, 1, 2]).expand([n, 1, 1, 2], true);
    let k = Tensor::from_slice(&[1.0f64, 0.0, 0.3, 1.0, -1.0, -0.2, 0.0, 0.5]).view([1, 1, 4, 2]).expand([n, 1, 4, 2], true);
    for kind in [BamKind::WeibullFixed, BamKind::LognormalFixed] {
        let (mut vs, b) = bam(kind, 1, 2, BamConfig { k: 2.0, sigma: 0.7, ..Default::default() }, Device::Cpu)?;
        vs.double();
        let train = AttendOptions { mode: Mode::TRAIN, ..Default::default() };
        let drawn = attend(&q, &k, &k, &Masks::default(), b.as_ref(), train)?.into_weights()?.view([n, 4]);
        let eps = if kind.is_weibull() {
            Tensor::rand([n, 1, 1, 4], (Kind::Double, Device::Cpu))
        } else {
            Tensor::randn([n, 1, 1, 4], (Kind::Double, Device::Cpu))
        };
        let explicit =
            attend(&q, &k, &k, &Masks::default(), b.as_ref(), AttendOptions { noise: Some(&eps), ..train })?.into_weights()?.view([n, 4]);
        let se = ((drawn.var_dim(&[0i64][..], true, false) + explicit.var_dim(&[0i64][..], true, false)) / n as f64).sqrt();
        let diff = (drawn.mean_dim(&[0i64][..], false, Kind::Double) - explicit.mean_dim(&[0i64][..], false, Kind::Double)).abs();
        assert!(bool::try_from(diff.le_tensor(&(se * 4.0)).all())?, "{kind:?}: drawn and explicit noise differ: {diff}");
    }
    Ok(())
}

#[test]
fn the_contextual_prior_takes_16_bit_keys_at_their_float32_values() -> Result<()> {
    let _serial = common::serial();
    // Over bfloat16 or float16 keys the prior's network runs in float32 from the keys' exact
    // float32 values, through a product that keeps the 16-bit keys for its backward pass: its
    // output and every gradient must be autograd's over keys widened first. Two examples (the
    // first weight's gradient sums over them) and grouped keys (two key heads for four networks).
    tch::manual_seed(17);
    for kind in [Kind::BFloat16, Kind::Half] {
        let vs = nn::VarStore::new(Device::Cpu);
        let prior = ContextualPrior::new(&vs.root(), 4, 8, 10, PriorScope::AllNodes)?;
        let keys = Tensor::randn([2, 2, 33, 8], (Kind::Float, Device::Cpu)).to_kind(kind);
        let narrow = keys.detach().set_requires_grad(true);
        let wide = keys.to_kind(Kind::Float).set_requires_grad(true);
        let support = Support::dense(None);
        let (ours, widened) = (prior.log_psi(&narrow, &support)?, prior.log_psi(&wide, &support)?);
        assert_eq!(ours.kind(), Kind::Float, "{kind:?}: the prior's dtype");
        assert!(ours.equal(&widened), "{kind:?}: the prior differs from the widened keys' by {}", f64_of(&(&ours - &widened).abs().max()));
        // Grouped keys as grouped-query attention reads them: query head h takes key head h / 2.
        let repeated = prior.log_psi(&wide.repeat_interleave_self_int(2, Some(1), None), &support)?;
        let diff = f64_of(&(&widened - &repeated).abs().max());
        assert!(diff <= 1e-5, "{kind:?}: the grouped keys' prior differs from the repeated keys' by {diff:e}");
        let weights = Tensor::randn_like(&widened);
        let params: Vec<Tensor> = vs.trainable_variables();
        let grads_of = |out: &Tensor, keys: &Tensor| {
            let inputs: Vec<Tensor> = std::iter::once(keys.shallow_clone()).chain(params.iter().map(Tensor::shallow_clone)).collect();
            Tensor::run_backward(&[(out * &weights).sum(Kind::Float)], &inputs, false, false)
        };
        let (g_ours, g_widened) = (grads_of(&ours, &narrow), grads_of(&widened, &wide));
        assert_eq!(g_ours[0].kind(), kind, "{kind:?}: the keys' gradient takes their dtype");
        // The keys' gradient, formed in float32 and rounded once to their dtype: within a unit in
        // the last place of the widened keys' float32 gradient (the two products' float32 sums
        // may round apart).
        let ulp = if kind == Kind::BFloat16 { 2f64.powi(-7) } else { 2f64.powi(-10) };
        let excess = ((&g_ours[0].to_kind(Kind::Float) - &g_widened[0]).abs() - g_widened[0].abs() * ulp).max();
        assert!(f64_of(&excess) <= 0.0, "{kind:?}: the keys' gradients differ by more than a unit in the last place");
        for (i, (a, b)) in g_ours.iter().zip(&g_widened).enumerate().skip(1) {
            let err = f64_of(&(a - b).abs().max()) / f64_of(&b.abs().max()).max(1e-30);
            assert!(err <= 1e-6, "{kind:?}: parameter {i}'s gradient differs by {err:e} of its size");
        }
    }
    Ok(())
}
