//! fairseq's Adam with decoupled weight decay and the inverse-square-root schedule, written out so
//! that its state (step, first and second moments) can be checkpointed and restored exactly; tch's
//! optimizers keep theirs inside libtorch, out of reach.
//!
//! Per parameter, as fairseq's `optim/adam.py`: `m ← β1 m + (1−β1) g`, `v ← β2 v + (1−β2) g²`,
//! `p ← p − lr·wd·p`, `p ← p − lr·sqrt(1−β2^t)/(1−β1^t) · m / (sqrt(v) + ε)`.

use std::collections::BTreeMap;

use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

/// Adam's settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay (fairseq's `--weight-decay`).
    pub weight_decay: f64,
}

/// fairseq's `inverse_sqrt` schedule: linear warm-up from `warmup_init_lr` to `lr` over
/// `warmup_updates`, then `lr · sqrt(warmup_updates / update)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct InverseSqrt {
    pub lr: f64,
    pub warmup_updates: u64,
    pub warmup_init_lr: f64,
}

impl InverseSqrt {
    /// The rate the schedule sets once `update` updates are done, i.e. the rate of update
    /// `update + 1` (fairseq's `step_update`); `lr_at(0) = warmup_init_lr`.
    pub fn lr_at(&self, update: u64) -> f64 {
        let w = self.warmup_updates.max(1);
        if update < w {
            self.warmup_init_lr + (self.lr - self.warmup_init_lr) * update as f64 / w as f64
        } else {
            self.lr * (w as f64 / update as f64).sqrt()
        }
    }
}

/// The optimizer over a VarStore's trainable variables, by name.
#[derive(Debug)]
pub struct Adam {
    pub cfg: AdamConfig,
    /// Updates taken.
    pub step: u64,
    params: BTreeMap<String, Tensor>,
    exp_avg: BTreeMap<String, Tensor>,
    exp_avg_sq: BTreeMap<String, Tensor>,
}

impl Adam {
    pub fn new(vs: &nn::VarStore, cfg: AdamConfig) -> Self {
        let params: BTreeMap<String, Tensor> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        let zeros = |p: &BTreeMap<String, Tensor>| p.iter().map(|(n, t)| (n.clone(), t.zeros_like())).collect();
        Self { cfg, step: 0, exp_avg: zeros(&params), exp_avg_sq: zeros(&params), params }
    }

    pub fn zero_grad(&self) {
        for p in self.params.values() {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// One update at learning rate `lr`; parameters without a gradient are left alone.
    pub fn step(&mut self, lr: f64) {
        self.step += 1;
        let (b1, b2, eps, wd) = (self.cfg.beta1, self.cfg.beta2, self.cfg.eps, self.cfg.weight_decay);
        let t = self.step as i32;
        let step_size = lr * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t));
        tch::no_grad(|| {
            for (name, p) in &self.params {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let (mut m, mut v) = (self.exp_avg[name].shallow_clone(), self.exp_avg_sq[name].shallow_clone());
                m *= b1;
                m += &g * (1.0 - b1);
                v *= b2;
                let _ = v.addcmul_(&g, &(&g * (1.0 - b2)));
                let denom = v.sqrt() + eps;
                let mut p = p.shallow_clone();
                if wd != 0.0 {
                    p *= 1.0 - lr * wd;
                }
                let _ = p.addcdiv_(&(&m * -step_size), &denom);
            }
        });
    }

    /// The state as named tensors (`adam.exp_avg.<param>`, `adam.exp_avg_sq.<param>`).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![];
        for (name, m) in &self.exp_avg {
            out.push((format!("adam.exp_avg.{name}"), m.shallow_clone()));
            out.push((format!("adam.exp_avg_sq.{name}"), self.exp_avg_sq[name].shallow_clone()));
        }
        out
    }

    /// Restores the moments from `tensors` (as [`Self::state_tensors`] names them) and the step.
    pub fn load_state(&mut self, tensors: &std::collections::HashMap<String, Tensor>, step: u64) -> Result<()> {
        for (kind, map) in [("exp_avg", &mut self.exp_avg), ("exp_avg_sq", &mut self.exp_avg_sq)] {
            for (name, t) in map.iter_mut() {
                let key = format!("adam.{kind}.{name}");
                let saved = tensors.get(&key).ok_or_else(|| anyhow::anyhow!("the checkpoint lacks {key}"))?;
                ensure!(saved.size() == t.size(), "{key} has shape {:?} in the checkpoint, {:?} in the model", saved.size(), t.size());
                tch::no_grad(|| t.copy_(saved));
            }
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays() {
        let s = InverseSqrt { lr: 5e-4, warmup_updates: 4000, warmup_init_lr: 1e-7 };
        assert_eq!(s.lr_at(0), 1e-7);
        assert!((s.lr_at(2000) - (1e-7 + (5e-4 - 1e-7) / 2.0)).abs() < 1e-15);
        assert!((s.lr_at(4000) - 5e-4).abs() < 1e-15);
        assert!((s.lr_at(16000) - 2.5e-4).abs() < 1e-15);
    }

    #[test]
    fn adam_matches_the_formula() -> Result<()> {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var("w", &[3], nn::Init::Const(1.0));
        let cfg = AdamConfig { beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = Adam::new(&vs, cfg);
        let loss = (&w * Tensor::from_slice(&[1.0f32, 2.0, 3.0])).sum(tch::Kind::Float);
        loss.backward();
        opt.step(0.01);
        // t = 1: m = 0.1 g, v = 0.02 g², step = 0.01·sqrt(0.02)/0.1; p = 1·(1 − 0.001) − step·m/(sqrt(v)+eps).
        let got: Vec<f32> = Vec::try_from(&w)?;
        for (i, g) in [1.0f64, 2.0, 3.0].iter().enumerate() {
            let (m, v) = (0.1 * g, 0.02 * g * g);
            let expected = 0.999 - 0.01 * 0.02f64.sqrt() / 0.1 * m / (v.sqrt() + 1e-8);
            assert!((f64::from(got[i]) - expected).abs() < 1e-6, "{i}: {} vs {expected}", got[i]);
        }
        Ok(())
    }
}
