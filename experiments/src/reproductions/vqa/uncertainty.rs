//! Uncertainty of stochastic fusions (BAM), as the BAM group's VQA code measures it
//! (Bayesian_Attention_Belief_Networks `utils/vqaEval.py`; docs/formulas.md §4): Monte Carlo
//! prediction with sampled attention and no dropout; an answer is *uncertain* when Welch's t-test
//! between the sampled probabilities of the two most probable answers gives p above a threshold;
//! `PAvPU = mean(uncertain · (1 - accurate) + (1 - uncertain) · accurate)`. Also the expected
//! calibration error of the mean prediction (15 equal-width confidence bins). "Noisy": the BAM
//! paper's setting, `scale · N(0, 1)` drawn once per view and added to every test example's
//! features (the same draw for every fusion of one seed). "Accurate" is 1 or 0 for single-answer
//! data and VQA-v2's soft score of the answer.
//! `--image-noise S` adds a third pass: Gaussian pixel noise of standard deviation S (images in
//! [0, 1], clipped) on the test images, run through the detectors again.
//! The same clean and noisy measures on the validation split (`val`, its noise drawn from another
//! seed than the test's) are what a stochastic fusion's settings (k, KL weight) are chosen on.
//!
//! Every attention fusion gets the report. For a deterministic one (softmax, DNAS, HNAS) the
//! samples agree, the t-test calls every answer certain, and PAvPU equals accuracy: the baseline
//! the BAM paper compares against (its softmax rows), measured rather than assumed.

use anyhow::{Context, Result};
use probattn::mc::monte_carlo;
use probattn::Mode;
use probattn_models::vqa::VqaModel;
use serde::{Deserialize, Serialize};
use statrs::distribution::{ContinuousCDF, StudentsT};
use tch::{Device, Kind, Tensor};

use super::data::Views;
use super::train::{accuracy_of, batch_of, chunks};
use super::Prepared;

/// Monte Carlo settings.
pub struct McSettings {
    pub samples: usize,
    pub eval_noise: f64,
    pub seed: u64,
}

impl McSettings {
    /// Samples for a fusion: `mc_samples` when it samples attention, two otherwise (all equal).
    pub fn samples_for(stochastic: bool, mc_samples: usize) -> usize {
        if stochastic {
            mc_samples
        } else {
            2
        }
    }
}

/// The measures of one test pass.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct McMetrics {
    /// Accuracy of the Monte Carlo mean.
    pub accuracy: f64,
    /// PAvPU at the t-test thresholds p > 0.01, 0.05, 0.1.
    pub pavpu_01: f64,
    pub pavpu_05: f64,
    pub pavpu_10: f64,
    /// The share of answers called uncertain at p > 0.05.
    pub uncertain_05: f64,
    /// Expected calibration error of the mean prediction (15 bins).
    pub ece: f64,
}

/// Clean and noisy test measures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct McReport {
    pub samples: usize,
    pub eval_noise: f64,
    pub clean: McMetrics,
    pub noisy: McMetrics,
    /// `--image-noise`: the pixel noise's standard deviation and the measures under it.
    #[serde(default)]
    pub image_noise: Option<f64>,
    #[serde(default)]
    pub noisy_image: Option<McMetrics>,
    /// The clean and noisy measures on the validation split, for choosing settings.
    #[serde(default)]
    pub val: Option<ValReport>,
}

/// Clean and noisy validation measures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ValReport {
    pub clean: McMetrics,
    pub noisy: McMetrics,
}

/// Two-sided p-value of Welch's t-test between two samples of size `n` given their means and
/// sample variances (scipy's `ttest_ind(equal_var=False)`). Equal samples with no spread: 1;
/// different ones with no spread: 0.
pub fn welch_p(m1: f64, v1: f64, m2: f64, v2: f64, n: usize) -> f64 {
    let n = n as f64;
    let (a, b) = (v1 / n, v2 / n);
    if a + b <= 0.0 {
        return if m1 == m2 { 1.0 } else { 0.0 };
    }
    let t = (m1 - m2) / (a + b).sqrt();
    let df = (a + b).powi(2) / (a * a / (n - 1.0) + b * b / (n - 1.0));
    match StudentsT::new(0.0, 1.0, df) {
        Ok(dist) => (2.0 * (1.0 - dist.cdf(t.abs()))).clamp(0.0, 1.0),
        Err(_) => 1.0,
    }
}

/// Expected calibration error over `bins` equal-width confidence bins (`accurate` in [0, 1]).
pub fn ece(confidence: &[f64], accurate: &[f64], bins: usize) -> f64 {
    let mut sums = vec![(0.0f64, 0.0f64, 0usize); bins];
    for (&c, &a) in confidence.iter().zip(accurate) {
        let b = ((c * bins as f64) as usize).min(bins - 1);
        sums[b].0 += c;
        sums[b].1 += a;
        sums[b].2 += 1;
    }
    let n = confidence.len().max(1) as f64;
    sums.iter().filter(|s| s.2 > 0).map(|(c, a, k)| (*k as f64 / n) * ((a - c) / *k as f64).abs()).sum()
}

/// PAvPU of `uncertain` flags and `accurate` in [0, 1]: `mean(u (1 - a) + (1 - u) a)`.
pub fn pavpu(uncertain: &[bool], accurate: &[f64]) -> f64 {
    let sum: f64 = uncertain.iter().zip(accurate).map(|(&u, &a)| if u { 1.0 - a } else { a }).sum();
    sum / uncertain.len().max(1) as f64
}

fn measure(
    model: &VqaModel,
    p: &Prepared,
    split: &str,
    views: &Views,
    noise: Option<&[Tensor]>,
    samples: usize,
    device: Device,
) -> Result<McMetrics> {
    let q = p.data.splits.get(split).with_context(|| format!("the data has no {split} split"))?;
    let (mut accurate, mut confidence, mut pvals) = (vec![], vec![], vec![]);
    tch::no_grad(|| -> Result<()> {
        for idx in chunks(q, 1024) {
            let mut b = batch_of(views, q, &idx, device)?;
            if let Some(noise) = noise {
                b.views = b.views.iter().zip(noise).map(|(v, n)| v + n).collect();
            }
            let pred =
                monte_carlo(samples, |_| Ok(model.forward(&b.views, &b.tokens, Mode::MONTE_CARLO)?.logits.softmax(-1, Kind::Double)))?;
            let (top, ids) = pred.mean.topk(2, -1, true, true); // (B, 2)
            let std = pred.std.gather(1, &ids, false); // (B, 2), population std
            let var = std.square() * (samples as f64 / (samples as f64 - 1.0));
            let m = Vec::<f64>::try_from(top.flatten(0, -1).to_device(Device::Cpu))?;
            let v = Vec::<f64>::try_from(var.flatten(0, -1).to_device(Device::Cpu))?;
            let acc = accuracy_of(&b, &ids.select(1, 0))?;
            for (i, a) in acc.into_iter().enumerate() {
                accurate.push(a);
                confidence.push(m[2 * i]);
                pvals.push(welch_p(m[2 * i], v[2 * i], m[2 * i + 1], v[2 * i + 1], samples));
            }
        }
        Ok(())
    })?;
    let uncertain = |threshold: f64| pvals.iter().map(|&p| p > threshold).collect::<Vec<_>>();
    let u05 = uncertain(0.05);
    Ok(McMetrics {
        accuracy: accurate.iter().sum::<f64>() / accurate.len().max(1) as f64,
        pavpu_01: pavpu(&uncertain(0.01), &accurate),
        pavpu_05: pavpu(&u05, &accurate),
        pavpu_10: pavpu(&uncertain(0.1), &accurate),
        uncertain_05: u05.iter().filter(|&&u| u).count() as f64 / u05.len().max(1) as f64,
        ece: ece(&confidence, &accurate, 15),
    })
}

/// The BAM paper's test noise: `scale · N(0, 1)`, one `(boxes, dim)` draw per view (`shapes`),
/// broadcast over the test set. It is drawn on the CPU from `seed` alone before any Monte Carlo
/// sample is taken, so every fusion run with one seed, stochastic or not, on any device, is
/// measured on the same draw (one draw moves accuracy by points: fusions are compared on it).
pub fn eval_noise(shapes: &[(i64, i64)], scale: f64, seed: u64, device: Device) -> Vec<Tensor> {
    noise_draw(shapes, scale, seed as i64 + 7_777, device)
}

/// The validation split's noise: as [`eval_noise`], from another seed, so that settings chosen on
/// it have not seen the test's draw.
pub fn val_noise(shapes: &[(i64, i64)], scale: f64, seed: u64, device: Device) -> Vec<Tensor> {
    noise_draw(shapes, scale, seed as i64 + 8_888, device)
}

fn noise_draw(shapes: &[(i64, i64)], scale: f64, seed: i64, device: Device) -> Vec<Tensor> {
    tch::manual_seed(seed);
    shapes.iter().map(|&(boxes, dim)| (Tensor::randn([boxes, dim], (Kind::Float, Device::Cpu)) * scale).to_device(device)).collect()
}

/// Monte Carlo test measures of `model`, clean, with the BAM paper's feature noise, and with
/// pixel noise when `p` holds features of noised images; then the clean and noisy measures on the
/// validation split. Both noise draws come before any sample.
pub(super) fn report(model: &VqaModel, p: &Prepared, settings: &McSettings, device: Device) -> Result<McReport> {
    let shapes = p.views.shapes();
    let noise = eval_noise(&shapes, settings.eval_noise, settings.seed, device);
    let val_noise = val_noise(&shapes, settings.eval_noise, settings.seed, device);
    let clean = measure(model, p, "test", &p.views, None, settings.samples, device)?;
    let noisy = measure(model, p, "test", &p.views, Some(&noise), settings.samples, device)?;
    let noisy_image =
        p.noisy_image.as_ref().map(|(_, views)| measure(model, p, "test", views, None, settings.samples, device)).transpose()?;
    let val = ValReport {
        clean: measure(model, p, "val", &p.views, None, settings.samples, device)?,
        noisy: measure(model, p, "val", &p.views, Some(&val_noise), settings.samples, device)?,
    };
    Ok(McReport {
        samples: settings.samples,
        eval_noise: settings.eval_noise,
        clean,
        noisy,
        image_noise: p.noisy_image.as_ref().map(|(s, _)| *s),
        noisy_image,
        val: Some(val),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_noise_depends_on_the_seed_alone() {
        let shapes = [(6, 64), (6, 64), (4, 8)];
        let first = eval_noise(&shapes, 1.5, 3, Device::Cpu);
        let _ = Tensor::randn([1000], (Kind::Float, Device::Cpu)); // a stochastic fusion's samples
        let again = eval_noise(&shapes, 1.5, 3, Device::Cpu);
        let other = eval_noise(&shapes, 1.5, 4, Device::Cpu);
        let val = val_noise(&shapes, 1.5, 3, Device::Cpu);
        for (((a, b), c), v) in first.iter().zip(&again).zip(&other).zip(&val) {
            assert!(a.equal(b));
            assert!(!a.equal(c));
            assert!(!a.equal(v), "the validation split must not see the test's draw");
        }
        assert_eq!(first[2].size(), [4, 8]);
        let std = f64::try_from(first[0].std(true)).unwrap();
        assert!((std - 1.5).abs() < 0.2, "scale 1.5 gave a standard deviation of {std}");
    }

    #[test]
    fn welch_matches_scipy() {
        // scipy 1.17.1: ttest_ind([1, 2, 3, 4], [2, 4, 6, 9], equal_var=False).pvalue = 0.16470207962805658
        let (a, b) = ([1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 9.0]);
        let stats = |x: &[f64]| {
            let m = x.iter().sum::<f64>() / 4.0;
            (m, x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / 3.0)
        };
        let ((m1, v1), (m2, v2)) = (stats(&a), stats(&b));
        let p = welch_p(m1, v1, m2, v2, 4);
        assert!((p - 0.164_702_079_628_056_58).abs() < 1e-9, "{p}");
        assert_eq!(welch_p(0.5, 0.0, 0.5, 0.0, 20), 1.0);
        assert_eq!(welch_p(0.6, 0.0, 0.4, 0.0, 20), 0.0);
    }

    #[test]
    fn calibration_and_pavpu() {
        // Two bins: confidence 0.95 right once of two (gap 0.45), 0.25 wrong (gap 0.25).
        let e = ece(&[0.95, 0.95, 0.25], &[1.0, 0.0, 0.0], 15);
        assert!((e - (2.0 / 3.0 * 0.45 + 1.0 / 3.0 * 0.25)).abs() < 1e-12, "{e}");
        assert_eq!(pavpu(&[true, false, false, true], &[0.0, 1.0, 0.0, 1.0]), 0.5);
        // Soft accuracy (VQA-v2): an uncertain answer worth 0.3 counts 0.7, a certain one 0.3.
        assert!((pavpu(&[true, false], &[0.3, 0.3]) - 0.5).abs() < 1e-12);
        assert!((pavpu(&[true, true], &[0.3, 0.6]) - 0.55).abs() < 1e-12);
    }
}
