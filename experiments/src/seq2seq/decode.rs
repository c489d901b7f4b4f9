//! Batched beam search and greedy decoding with incremental (cached) decoder states.
//!
//! Beam search follows fairseq's `SequenceGenerator`: every sentence keeps `beam` hypotheses; each
//! step scores `2·beam` candidates per sentence, a candidate ending in `</s>` among the first
//! `beam` is finished with score `Σ log p / len^lenpen` (len counting `</s>`), the others refill
//! the beam; a sentence is done once it has `beam` finished hypotheses, and at the maximum length
//! `a·|src| + b` (source tokens without `</s>`) `</s>` is forced. Padding and `<s>` are never
//! produced. The decoder's keys and values are cached and reordered with the beams, so a step
//! costs O(current length).

use anyhow::Result;
use probattn_models::translation::Seq2Seq;
use tch::{Device, Kind, Tensor};

use super::data::{pad_rows, EOS, PAD};

/// Decoding settings.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecodeConfig {
    /// Beam size; 1 = greedy.
    pub beam: usize,
    /// Length penalty exponent of the final score.
    pub lenpen: f64,
    /// Maximum target length `a·|src| + b`.
    pub max_len_a: f64,
    pub max_len_b: usize,
}

fn max_len(cfg: &DecodeConfig, src_len: usize) -> usize {
    (cfg.max_len_a * src_len as f64).floor() as usize + cfg.max_len_b
}

/// A finished hypothesis.
#[derive(Clone, Debug)]
struct Finished {
    tokens: Vec<i64>,
    score: f64,
}

/// Translates `sources` (token ids ending in `</s>`) in batches of `batch_size` sentences; returns
/// the best hypothesis of each (token ids without `</s>`), in input order.
pub fn translate(
    model: &Seq2Seq,
    sources: &[Vec<i64>],
    cfg: &DecodeConfig,
    batch_size: usize,
    device: Device,
    mut progress: impl FnMut(usize),
) -> Result<Vec<Vec<i64>>> {
    // Sort by length so batches pad little; restore the order at the end.
    let mut order: Vec<usize> = (0..sources.len()).collect();
    order.sort_by_key(|&i| sources[i].len());
    let mut out = vec![vec![]; sources.len()];
    tch::no_grad(|| -> Result<()> {
        for chunk in order.chunks(batch_size.max(1)) {
            let batch: Vec<&[i64]> = chunk.iter().map(|&i| sources[i].as_slice()).collect();
            let hyps = if cfg.beam <= 1 { greedy(model, &batch, cfg, device)? } else { beam_search(model, &batch, cfg, device)? };
            for (&i, h) in chunk.iter().zip(hyps) {
                out[i] = h;
            }
            progress(chunk.len());
        }
        Ok(())
    })?;
    Ok(out)
}

/// Greedy decoding with the cache.
fn greedy(model: &Seq2Seq, batch: &[&[i64]], cfg: &DecodeConfig, device: Device) -> Result<Vec<Vec<i64>>> {
    let b = batch.len();
    let src = pad_rows(batch, device);
    let (mut state, src_pad) = model.start(&src)?;
    let limits: Vec<usize> = batch.iter().map(|s| max_len(cfg, s.len() - 1)).collect();
    let longest = *limits.iter().max().unwrap_or(&1);
    let mut token = Tensor::full([b as i64], EOS, (Kind::Int64, device));
    let mut out: Vec<Vec<i64>> = vec![vec![]; b];
    let mut done = vec![false; b];
    for step in 0..=longest {
        let lprobs = model.step(&token, step as i64, &mut state, &src_pad)?; // (B, V)
        let _ = lprobs.narrow(1, 0, 2).fill_(f64::NEG_INFINITY); // never <s> or <pad>
        let next: Vec<i64> = Vec::try_from(lprobs.argmax(-1, false))?;
        for i in 0..b {
            if done[i] {
                continue;
            }
            if next[i] == EOS || out[i].len() >= limits[i] {
                done[i] = true;
            } else {
                out[i].push(next[i]);
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
        token = Tensor::from_slice(&next).to_device(device);
    }
    Ok(out)
}

/// Greedy decoding *without* the cache: every step re-runs the decoder over the whole prefix.
/// Only for measuring what the cache saves (`probattn translate --decode-bench`); the output
/// equals [`translate`] with beam 1 up to floating-point ties.
pub fn greedy_uncached(
    model: &Seq2Seq,
    sources: &[Vec<i64>],
    cfg: &DecodeConfig,
    batch_size: usize,
    device: Device,
) -> Result<Vec<Vec<i64>>> {
    greedy_with(|src, prev| Ok(model.forward_t(src, prev, false)?.0), sources, cfg, batch_size, device)
}

/// [`greedy_uncached`] with any model that maps `(src (B, S), prev (B, T))` token ids to logits
/// `(B, T, V)`: a TorchScript translation model (`probattn compare --native translation`), say.
pub fn greedy_with(
    logits_of: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    sources: &[Vec<i64>],
    cfg: &DecodeConfig,
    batch_size: usize,
    device: Device,
) -> Result<Vec<Vec<i64>>> {
    let mut out = vec![];
    tch::no_grad(|| -> Result<()> {
        for chunk in sources.chunks(batch_size.max(1)) {
            let batch: Vec<&[i64]> = chunk.iter().map(Vec::as_slice).collect();
            let b = batch.len();
            let src = pad_rows(&batch, device);
            let limits: Vec<usize> = batch.iter().map(|s| max_len(cfg, s.len() - 1)).collect();
            let longest = *limits.iter().max().unwrap_or(&1);
            let mut prefix: Vec<Vec<i64>> = vec![vec![EOS]; b];
            let mut hyp: Vec<Vec<i64>> = vec![vec![]; b];
            let mut done = vec![false; b];
            for _ in 0..=longest {
                let rows: Vec<&[i64]> = prefix.iter().map(Vec::as_slice).collect();
                let logits = logits_of(&src, &pad_rows(&rows, device))?; // (B, T, V)
                let last = logits.select(1, -1).log_softmax(-1, logits.kind());
                let _ = last.narrow(1, 0, 2).fill_(f64::NEG_INFINITY);
                let next: Vec<i64> = Vec::try_from(last.argmax(-1, false))?;
                for i in 0..b {
                    if !done[i] && (next[i] == EOS || hyp[i].len() >= limits[i]) {
                        done[i] = true;
                    } else if !done[i] {
                        hyp[i].push(next[i]);
                    }
                    prefix[i].push(if done[i] { PAD } else { next[i] });
                }
                if done.iter().all(|&d| d) {
                    break;
                }
            }
            out.extend(hyp);
        }
        Ok(())
    })?;
    Ok(out)
}

/// Batched beam search (see the module documentation). Every live row of a sentence holds a
/// hypothesis of `step` tokens.
fn beam_search(model: &Seq2Seq, batch: &[&[i64]], cfg: &DecodeConfig, device: Device) -> Result<Vec<Vec<i64>>> {
    let (b, k) = (batch.len(), cfg.beam);
    let src = pad_rows(batch, device);
    // Every sentence's source repeated beam times: rows i·k .. i·k + k − 1.
    let expand = Tensor::arange(b as i64, (Kind::Int64, device)).repeat_interleave_self_int(k as i64, 0, None);
    let (mut state, src_pad) = model.start(&src.index_select(0, &expand))?;
    let limits: Vec<usize> = batch.iter().map(|s| max_len(cfg, s.len() - 1)).collect();
    let longest = *limits.iter().max().unwrap_or(&1);
    // Beam hypotheses and their summed log-probabilities; at the start only beam 0 is live.
    let mut tokens: Vec<Vec<i64>> = vec![vec![]; b * k];
    let mut scores: Vec<f64> = (0..b * k).map(|r| if r % k == 0 { 0.0 } else { f64::NEG_INFINITY }).collect();
    let mut finished: Vec<Vec<Finished>> = vec![vec![]; b];
    let mut done = vec![false; b];
    let mut input = Tensor::full([(b * k) as i64], EOS, (Kind::Int64, device));
    let vocab = model.config().vocab;
    for step in 0..=longest {
        let lprobs = model.step(&input, step as i64, &mut state, &src_pad)?.to_kind(Kind::Double); // (B·k, V)
        let _ = lprobs.narrow(1, 0, 2).fill_(f64::NEG_INFINITY); // never <s> or <pad>
        let lprobs = force_eos_at_limits(lprobs, step, &limits, k, device);
        let cand = lprobs + Tensor::from_slice(&scores).to_device(device).unsqueeze(1); // (B·k, V)
        let (top, idx) = cand.view([b as i64, -1]).topk((2 * k) as i64, -1, true, true); // (B, 2k)
        let top: Vec<f64> = Vec::try_from(top.view([-1]).to_device(Device::Cpu))?;
        let idx: Vec<i64> = Vec::try_from(idx.view([-1]).to_device(Device::Cpu))?;
        let mut next = NextBeams::default();
        for s in 0..b {
            let mut kept = 0;
            for c in 0..2 * k {
                let (score, flat) = (top[s * 2 * k + c], idx[s * 2 * k + c]);
                let (beam, token) = ((flat / vocab) as usize, flat % vocab);
                let row = s * k + beam;
                if done[s] || !score.is_finite() {
                    break;
                }
                if token == EOS {
                    // fairseq finishes an </s> candidate only among the first k.
                    if c < k && finished[s].len() < k {
                        let len = tokens[row].len() + 1;
                        finished[s].push(Finished { tokens: tokens[row].clone(), score: score / (len as f64).powf(cfg.lenpen) });
                    }
                    continue;
                }
                if kept < k {
                    let mut h = tokens[row].clone();
                    h.push(token);
                    next.push(row as i64, token, score, h);
                    kept += 1;
                }
            }
            if finished[s].len() >= k {
                done[s] = true;
            }
            // Pad a done (or exhausted) sentence's beam with dead rows that keep the shapes.
            while next.rows.len() < (s + 1) * k {
                next.push((s * k) as i64, EOS, f64::NEG_INFINITY, vec![]);
            }
            if !done[s] && next.scores[s * k..(s + 1) * k].iter().all(|x| !x.is_finite()) {
                done[s] = true;
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
        state.reorder(&Tensor::from_slice(&next.rows).to_device(device));
        input = Tensor::from_slice(&next.tokens).to_device(device);
        (tokens, scores) = (next.hyps, next.scores);
    }
    Ok(finished
        .into_iter()
        .enumerate()
        .map(|(s, f)| {
            let best = f.into_iter().max_by(|a, b| a.score.total_cmp(&b.score));
            // No finished hypothesis (cannot happen: </s> is forced at the limit): the best live one.
            best.map(|h| h.tokens).unwrap_or_else(|| tokens[s * k].clone())
        })
        .collect())
}

/// The beams of the next step: the rows of the current ones they continue, their new tokens,
/// summed log-probabilities and hypotheses.
#[derive(Default)]
struct NextBeams {
    rows: Vec<i64>,
    tokens: Vec<i64>,
    scores: Vec<f64>,
    hyps: Vec<Vec<i64>>,
}

impl NextBeams {
    fn push(&mut self, row: i64, token: i64, score: f64, hyp: Vec<i64>) {
        self.rows.push(row);
        self.tokens.push(token);
        self.scores.push(score);
        self.hyps.push(hyp);
    }
}

/// At a sentence's maximum length only </s> may follow: the rows (`k` per sentence) of sentences
/// at their limit `limits[s]` by `step` keep </s>'s log-probability and nothing else.
fn force_eos_at_limits(mut lprobs: Tensor, step: usize, limits: &[usize], k: usize, device: Device) -> Tensor {
    let forced: Vec<i64> = (0..limits.len() * k).filter(|&r| step >= limits[r / k]).map(|r| r as i64).collect();
    if !forced.is_empty() {
        let rows = Tensor::from_slice(&forced).to_device(device);
        let eos = lprobs.index_select(0, &rows).select(1, EOS);
        lprobs = lprobs.index_fill(0, &rows, f64::NEG_INFINITY);
        let _ = lprobs.index_put_(&[Some(&rows), Some(&Tensor::full([forced.len() as i64], EOS, (Kind::Int64, device)))], &eos, false);
    }
    lprobs
}
