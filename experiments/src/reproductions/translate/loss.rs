//! The training loss, shared by training and validation (`train.rs`, `evaluate.rs`).

use tch::{Kind, Tensor};

use crate::seq2seq::data::PAD;

/// Label-smoothed cross-entropy, fairseq 0.6: `Σ_t (1−ε)·nll_t + ε/V · Σ_v −log p_t(v)` over
/// non-padding targets; returns (loss sum, nll sum).
pub fn label_smoothed_loss(logits: &Tensor, target: &Tensor, eps: f64) -> (Tensor, Tensor) {
    let lprobs = logits.log_softmax(-1, Kind::Float); // (B, T, V)
    let v = lprobs.size()[2] as f64;
    let keep = target.ne(PAD).to_kind(Kind::Float); // (B, T)
    let nll = -lprobs.gather(-1, &target.unsqueeze(-1), false).squeeze_dim(-1) * &keep;
    let smooth = -lprobs.sum_dim_intlist(&[-1i64][..], false, Kind::Float) * &keep;
    let nll = nll.sum(Kind::Float);
    ((&nll * (1.0 - eps)) + smooth.sum(Kind::Float) * (eps / v), nll)
}
