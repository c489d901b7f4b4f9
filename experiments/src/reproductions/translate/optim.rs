//! fairseq's Adam with decoupled weight decay and the inverse-square-root schedule (the
//! Transformer's), OpenNMT-py's learning-rate decay on a validation plateau (the attentional
//! LSTM's) and gradient-norm clipping, written out so that the optimizer's state (step, first and
//! second moments) can be checkpointed and restored exactly; tch's optimizers keep theirs inside
//! libtorch, out of reach.
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

/// OpenNMT-py's `Optim.update_learning_rate` (the recipe of Deng et al. 2018): a constant rate,
/// multiplied by `decay` after every epoch from the one where decaying started on: epoch
/// `start_decay_at` (1-based), or the first epoch whose validation loss was above the epoch
/// before's, whichever comes first.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlateauDecay {
    pub lr: f64,
    pub decay: f64,
    /// `None`: only the validation loss starts the decay.
    pub start_decay_at: Option<usize>,
}

impl PlateauDecay {
    /// The rate of the epoch after those whose validation losses are `valid_losses` (in order).
    pub fn lr_after(&self, valid_losses: &[f64]) -> f64 {
        let mut decaying = false;
        let mut lr = self.lr;
        for (i, loss) in valid_losses.iter().enumerate() {
            let epoch = i + 1;
            decaying |= self.start_decay_at.is_some_and(|s| epoch >= s) || (i > 0 && *loss > valid_losses[i - 1]);
            if decaying {
                lr *= self.decay;
            }
        }
        lr
    }
}

/// The learning-rate schedule: fairseq's inverse square root (by update) or OpenNMT-py's decay
/// (by epoch). Written to config.json as its fields alone, so a Transformer run's config reads
/// as it always has.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Schedule {
    InverseSqrt(InverseSqrt),
    PlateauDecay(PlateauDecay),
}

impl Schedule {
    /// The rate of the update after `updates` updates, in the epoch after those whose
    /// validation losses are `valid_losses`.
    pub fn lr(&self, updates: u64, valid_losses: &[f64]) -> f64 {
        match self {
            Self::InverseSqrt(s) => s.lr_at(updates),
            Self::PlateauDecay(s) => s.lr_after(valid_losses),
        }
    }
}

/// Scales the gradients of `params` so that their joint L2 norm is at most `max_norm`
/// (`torch.nn.utils.clip_grad_norm_`, as OpenNMT-py's `-max_grad_norm`); returns the norm before,
/// a scalar on the gradients' device. Nothing is read back to the CPU: a training step stays free
/// of a synchronisation.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Option<Tensor> {
    let grads: Vec<Tensor> = params.iter().map(Tensor::grad).filter(Tensor::defined).collect();
    if grads.is_empty() {
        return None;
    }
    let squares: Vec<Tensor> = grads.iter().map(|g| g.square().sum(tch::Kind::Float)).collect();
    let norm = Tensor::stack(&squares, 0).sum(tch::Kind::Float).sqrt();
    // In float64, as the scalar the clipping used to compute on the CPU: the same factor.
    let scale = (max_norm / (norm.to_kind(tch::Kind::Double) + 1e-6)).clamp_max(1.0);
    tch::no_grad(|| {
        for g in &grads {
            let mut g = g.shallow_clone();
            g *= scale.to_kind(g.kind());
        }
    });
    Some(norm)
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

    /// The parameters it updates.
    pub fn params(&self) -> Vec<Tensor> {
        self.params.values().map(Tensor::shallow_clone).collect()
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
    fn plateau_decay_halves_from_the_first_worse_epoch_or_start_decay_at() {
        let s = PlateauDecay { lr: 1.0, decay: 0.5, start_decay_at: None };
        assert_eq!(s.lr_after(&[]), 1.0);
        assert_eq!(s.lr_after(&[5.0, 4.0, 3.0]), 1.0);
        // Epoch 3 is worse: decaying starts there and goes on every epoch after.
        assert_eq!(s.lr_after(&[5.0, 4.0, 4.5, 3.0, 2.0]), 0.125);
        let s = PlateauDecay { start_decay_at: Some(2), ..s };
        assert_eq!(s.lr_after(&[5.0]), 1.0);
        assert_eq!(s.lr_after(&[5.0, 4.0, 3.0]), 0.25);
        let json = serde_json::to_value(Schedule::PlateauDecay(s)).unwrap();
        assert_eq!(serde_json::from_value::<Schedule>(json).unwrap(), Schedule::PlateauDecay(s));
        let old = serde_json::json!({"lr": 5e-4, "warmup_updates": 4000, "warmup_init_lr": 1e-7});
        assert!(matches!(serde_json::from_value::<Schedule>(old).unwrap(), Schedule::InverseSqrt(_)));
    }

    #[test]
    fn clipping_scales_the_joint_norm() {
        let a = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let b = Tensor::from_slice(&[4.0f32]).set_requires_grad(true);
        (&a * &a / 2.0 + &b * &b / 2.0).sum(tch::Kind::Float).backward(); // gradients 3 and 4: norm 5
        let norm = |n: Option<Tensor>| n.map_or(f64::NAN, |t| t.double_value(&[]));
        assert!((norm(clip_grad_norm(&[a.shallow_clone(), b.shallow_clone()], 1.0)) - 5.0).abs() < 1e-6);
        assert!((f64::try_from(a.grad()).unwrap() - 0.6).abs() < 1e-5 && (f64::try_from(b.grad()).unwrap() - 0.8).abs() < 1e-5);
        assert!((norm(clip_grad_norm(&[a, b], 10.0)) - 1.0).abs() < 1e-5, "under the bound nothing changes");
    }

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
