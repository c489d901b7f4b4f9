//! What `probattn vqa` reports beyond accuracy: the explained-away histograms (the DNAS paper's
//! Fig. 1) and the results table.

use probattn::diagnostics::{received_mass, EXPLAINED_AWAY_EPS};
use probattn::Mode;
use probattn_models::vqa::VqaModel;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::{Prepared, VqaResults};
use crate::report::{markdown_table, mean_std};
use anyhow::Result;

/// Fig. 1's statistics: the mass `Σ_i π_ij` each secondary box receives, over the test images.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExplainedAway {
    /// Boxes counted (test images x secondary boxes of every view).
    pub boxes: usize,
    /// The share with mass below 1e-8 (the paper's ε-explained-away).
    pub share_below_1e8: f64,
    /// The share with `log mass < -20` (a reading of Fig. 1's cut).
    pub share_log_below_minus20: f64,
    /// The smallest mass times the number of keys (DNAS guarantees >= 1: Theorem 2).
    pub min_mass_times_keys: f64,
    /// The histogram of `log mass` (natural log): bin edges and counts.
    pub log_mass_edges: Vec<f64>,
    pub log_mass_counts: Vec<u64>,
}

const LOG_MASS_BINS: (f64, f64, usize) = (-60.0, 5.0, 65);

fn histogram(values: &[f64]) -> (Vec<f64>, Vec<u64>) {
    let (lo, hi, n) = LOG_MASS_BINS;
    let width = (hi - lo) / n as f64;
    let mut counts = vec![0u64; n];
    for &v in values {
        let b = ((v.clamp(lo, hi - 1e-9) - lo) / width) as usize;
        counts[b.min(n - 1)] += 1;
    }
    ((0..=n).map(|i| lo + width * i as f64).collect(), counts)
}

/// Fig. 1's curve: `(bin centre, share of boxes)` over one or more runs' histograms (same bins).
pub(super) fn log_mass_points(reports: &[&ExplainedAway]) -> Vec<(f64, f64)> {
    let Some(first) = reports.first() else { return vec![] };
    let total: f64 = reports.iter().map(|e| e.boxes as f64).sum::<f64>().max(1.0);
    (0..first.log_mass_counts.len())
        .map(|i| {
            (
                0.5 * (first.log_mass_edges[i] + first.log_mass_edges[i + 1]),
                reports.iter().map(|e| e.log_mass_counts[i] as f64).sum::<f64>() / total,
            )
        })
        .collect()
}

/// Fig. 1: the received mass of every secondary box on the test images, per view summed over
/// the primary's boxes (eval mode: deterministic weights).
pub(super) fn explained_away(model: &VqaModel, p: &Prepared) -> Result<Option<ExplainedAway>> {
    if model.config().fusion.is_none() {
        return Ok(None);
    }
    let q = &p.data.splits["test"];
    let images = q.image.unique_dim(0, true, false, false).0; // the test images, once each
    let (mut logs, mut min_scaled) = (vec![], f64::INFINITY);
    tch::no_grad(|| -> Result<()> {
        for start in (0..images.size()[0]).step_by(256) {
            let rows = images.narrow(0, start, 256.min(images.size()[0] - start));
            let fused = model.fusion.forward(&p.views.gather(&rows)?, Mode::EVAL)?;
            // (B, 1, N_s) per view, in float64 (the log of a float32 underflow is -inf); from the
            // weights, or from the memory-efficient fusion's received mass.
            let masses: Vec<Tensor> = if fused.weights.is_empty() {
                fused.received_mass.iter().map(|m| m.to_kind(Kind::Double)).collect()
            } else {
                fused.weights.iter().map(|w| received_mass(&w.to_kind(Kind::Double))).collect()
            };
            for mass in &masses {
                let mass = mass.squeeze_dim(1);
                let keys = mass.size()[1] as f64;
                min_scaled = min_scaled.min(f64::try_from(mass.min())? * keys);
                logs.extend(Vec::<f64>::try_from(mass.log().clamp_min(-745.0).flatten(0, -1).to_device(Device::Cpu))?);
            }
        }
        Ok(())
    })?;
    let n = logs.len().max(1) as f64;
    let (edges, counts) = histogram(&logs);
    let report = ExplainedAway {
        boxes: logs.len(),
        share_below_1e8: logs.iter().filter(|&&l| l < EXPLAINED_AWAY_EPS.ln()).count() as f64 / n,
        share_log_below_minus20: logs.iter().filter(|&&l| l < -20.0).count() as f64 / n,
        min_mass_times_keys: min_scaled,
        log_mass_edges: edges,
        log_mass_counts: counts,
    };
    Ok(Some(report))
}

/// The markdown table of several fusions' results.
pub fn table(results: &[VqaResults]) -> String {
    let pct = |m: Option<f64>, s: Option<f64>| m.map_or("-".into(), |m| format!("{:.2} ± {:.2}", 100.0 * m, 100.0 * s.unwrap_or(0.0)));
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let ea = r.runs.iter().filter_map(|x| x.explained_away.as_ref()).map(|e| e.share_below_1e8).collect::<Vec<_>>();
            let min_mass =
                r.runs.iter().filter_map(|x| x.explained_away.as_ref()).map(|e| e.min_mass_times_keys).fold(f64::INFINITY, f64::min);
            let pavpu =
                r.runs.iter().filter_map(|x| x.uncertainty.as_ref()).map(|u| (u.clean.pavpu_05, u.noisy.pavpu_05)).collect::<Vec<_>>();
            vec![
                r.fusion.clone(),
                pct(Some(r.test_acc_mean), Some(r.test_acc_std)),
                pct(r.test_acc_relational_mean, r.test_acc_relational_std),
                pct(r.test_acc_nonrelational_mean, r.test_acc_nonrelational_std),
                format!("{:.2}", 100.0 * r.val_acc_mean),
                if ea.is_empty() { "-".into() } else { format!("{:.1}", 100.0 * mean_std(&ea).0) },
                if min_mass.is_finite() { format!("{min_mass:.3}") } else { "-".into() },
                if pavpu.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "{:.2} / {:.2}",
                        100.0 * mean_std(&pavpu.iter().map(|p| p.0).collect::<Vec<_>>()).0,
                        100.0 * mean_std(&pavpu.iter().map(|p| p.1).collect::<Vec<_>>()).0
                    )
                },
                r.runs.len().to_string(),
                format!("{:.1}", r.epoch_seconds_mean),
            ]
        })
        .collect();
    markdown_table(
        &[
            "fusion",
            "test acc (%)",
            "relational (%)",
            "non-relational (%)",
            "val acc (%)",
            "ε-explained-away boxes (%)",
            "min mass × keys",
            "PAvPU clean / noisy (%)",
            "seeds",
            "s/epoch",
        ],
        &rows,
    )
}
