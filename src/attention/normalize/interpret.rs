//! The eager interpreter of a plan ([`Tiled`]): the weights of a deterministic plan formed whole,
//! `(B, H, S_q, S_k)` (or `(H, E)` over a graph's edges), in the log domain. It is how every
//! built-in deterministic normalizer (softmax, DNAS, HNAS, Sinkhorn-N) and any variant defined by
//! a plan alone normalizes: [`Normalizer`](super::Normalizer)'s `normalize` and `log_weights` call
//! it by default, so the eager path and the tiles read one definition.
//!
//! With `z` the filled scores times the plan's score scale, N = `sweeps`:
//! - `log w ← z`, then N times `log w ← row_log_softmax(col_log_softmax(log w))`; with N = 0 one
//!   `row_log_softmax`: these are the log-weights;
//! - the weights take the same steps but end in a fused row softmax (rows then sum to one to
//!   working precision, where `exp(z − logsumexp)` drifts by 1e-4 in float32 at |z| = 1e4);
//! - a hybrid plan (HNAS) mixes per head, `u · π_plan + (1 − u) · π_softmax` with
//!   `u = sigmoid(logit)`, and in the log domain
//!   `logaddexp(log u + log π_plan, log(1 − u) + log π_softmax)`.

use tch::Tensor;

use super::{NormalizeInput, Support};
use crate::plan::Tiled;
use crate::{Error, Result};

/// The plan's scores: filled on excluded entries, times the score scale (skipped at 1, so the
/// built-in variants' scores are the caller's bit for bit).
fn filled_scores(plan: &Tiled, input: &NormalizeInput) -> Tensor {
    let s = input.support;
    if plan.score_scale == 1.0 {
        s.fill(input.scores)
    } else {
        s.fill(&(input.scores * plan.score_scale))
    }
}

/// `sweeps` column/row sweeps of filled log-scores, the last row sweep left out: the logits whose
/// row softmax is the plan's weights and whose row log-softmax its log-weights.
fn before_last_row(z: &Tensor, sweeps: u32, s: &Support) -> Tensor {
    if sweeps == 0 {
        return z.shallow_clone();
    }
    let mut log_w = z.shallow_clone();
    for _ in 1..sweeps {
        log_w = s.row_log_softmax(&s.col_log_softmax(&log_w));
    }
    s.col_log_softmax(&log_w)
}

/// A hybrid plan's gate logits shaped to broadcast against the scores, in their dtype, after
/// checking the head count.
fn gate_logits(plan: &Tiled, logit: &Tensor, input: &NormalizeInput) -> Result<Tensor> {
    let (scores, s) = (input.scores, input.support);
    s.check_scores(scores)?;
    let heads = logit.size()[0];
    if s.heads(scores) != heads {
        return Err(Error::Shape(format!("{} has {heads} head gate(s) but the scores have shape {:?}", plan.name, scores.size())));
    }
    Ok(s.per_head(&logit.to_kind(scores.kind())))
}

/// What both forms start from: the plan's filled, scaled scores and, for a hybrid plan, its gate
/// logits shaped against them; a sampling plan is refused (`what` names the form asked for).
fn prepared(plan: &Tiled, input: &NormalizeInput, what: &str) -> Result<(Tensor, Option<Tensor>)> {
    if plan.sampling.is_some() {
        return Err(Error::Unsupported(format!(
            "{}: a sampling plan has no eager {what} of its own; its normalizer forms them (as BAM's does)",
            plan.name
        )));
    }
    let gate = plan.hybrid_logit.map(|l| gate_logits(plan, l, input)).transpose()?;
    Ok((filled_scores(plan, input), gate))
}

/// The plan's weights, zero on excluded entries.
pub(crate) fn weights(plan: &Tiled, input: &NormalizeInput) -> Result<Tensor> {
    let (z, gate) = prepared(plan, input, "weights")?;
    let s = input.support;
    let w = s.row_softmax(&before_last_row(&z, plan.sweeps, s));
    Ok(match gate {
        // u·π_plan + (1 − u)·π_softmax as one fused lerp (one pass instead of three).
        Some(logit) => s.row_softmax(&z).lerp_tensor(&w, &logit.sigmoid()),
        None => w,
    })
}

/// The plan's log-weights, excluded entries filled.
pub(crate) fn log_weights(plan: &Tiled, input: &NormalizeInput) -> Result<Tensor> {
    let (z, gate) = prepared(plan, input, "log-weights")?;
    let s = input.support;
    let log_w = s.row_log_softmax(&before_last_row(&z, plan.sweeps, s));
    Ok(match gate {
        Some(logit) => {
            let own = logit.log_sigmoid() + log_w;
            let softmax = (-&logit).log_sigmoid() + s.row_log_softmax(&z);
            s.fill(&own.logaddexp(&softmax))
        }
        None => log_w,
    })
}
