//! What a translate run measures besides its training loss: validation loss, BLEU of decoded
//! splits (split across ranks and gathered), the encoder's head diversity and explained-away
//! share, and the run's plots.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use probattn_models::translation::Seq2Seq;
use tch::{Device, Kind};
use tokenizers::Tokenizer;

use super::loss::label_smoothed_loss;
use super::{EpochMetrics, TranslateConfig};
use crate::bleu::{corpus_bleu, BleuConfig};
use crate::ranks::Ranks;
use crate::report::progress_bar;
use crate::seq2seq::data::{self, batch_tensors, token_batches, Encoded, PAD};
use crate::seq2seq::decode::{self, DecodeConfig};

/// Sentences per decoding batch during training (validation and test).
const DECODE_BATCH: usize = 64;

/// Translates `data`'s sources and scores them against `refs` (sacreBLEU's default and the
/// tokenized, lowercased kind); returns (hypotheses, BLEU, BLEU tok-lc, sentences/s).
/// Under several ranks each decodes its share of the sentences and every rank gets them all.
#[allow(clippy::too_many_arguments)]
pub(super) fn translate_and_score(
    model: &Seq2Seq,
    tokenizer: &Tokenizer,
    data: &Encoded,
    refs: &[String],
    cfg: &DecodeConfig,
    device: Device,
    label: &str,
    ranks: &Ranks,
) -> Result<(Vec<String>, crate::bleu::BleuScore, crate::bleu::BleuScore, f64)> {
    let share = ranks.shard(data.len()).len();
    let bar = progress_bar(share as u64, format!("{label} decoding"))?;
    let start = Instant::now();
    let ids = ranks.split_sequences(data.len(), |range| {
        decode::translate(model, &data.src[range], cfg, DECODE_BATCH, device, |n| bar.inc(n as u64))
    })?;
    let seconds = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let hyps: Vec<String> = ids.iter().map(|h| data::decode(tokenizer, h)).collect::<Result<_>>()?;
    let bleu = corpus_bleu(&hyps, refs, &BleuConfig::default())?;
    let tok = corpus_bleu(&hyps, refs, &BleuConfig::tokenized_lowercase())?;
    Ok((hyps, bleu, tok, data.len() as f64 / seconds.max(1e-9)))
}

/// Validation loss (label-smoothed and nll, per target token) in eval mode; each rank takes its
/// share of the batches.
pub(super) fn valid_loss(model: &Seq2Seq, data: &Encoded, cfg: &TranslateConfig, device: Device, ranks: &Ranks) -> Result<(f64, f64)> {
    let (batches, _) = token_batches(data, cfg.max_tokens, usize::MAX);
    let (mut loss, mut nll, mut tokens) = (0.0, 0.0, 0usize);
    tch::no_grad(|| -> Result<()> {
        for b in &batches[ranks.shard(batches.len())] {
            let t = batch_tensors(data, b, device);
            let (logits, _) = model.forward_t(&t.src, &t.prev, false)?;
            let (l, n) = label_smoothed_loss(&logits, &t.target, cfg.label_smoothing);
            loss += f64::try_from(l)?;
            nll += f64::try_from(n)?;
            tokens += t.ntokens;
        }
        Ok(())
    })?;
    let [loss, nll, tokens] = ranks.sum(&[loss, nll, tokens as f64])?[..] else { unreachable!("three sums") };
    Ok((loss / tokens.max(1.0), nll / tokens.max(1.0)))
}

/// HNAS's mean `u` per encoder layer.
pub(super) fn hnas_gates(model: &Seq2Seq) -> Option<Vec<f64>> {
    model.transformer()?.encoder.iter().map(|l| l.self_attn.hybrid_u().and_then(|u| f64::try_from(u.mean(Kind::Double)).ok())).collect()
}

/// The run's SVG plots: loss and validation BLEU over epochs, HNAS's u per encoder layer over
/// epochs (hnas runs), and the test set's head diversity and explained-away share per layer.
pub(super) fn plots(dir: &Path, history: &[EpochMetrics], dist: &[f64], away: &[f64]) -> Result<()> {
    use crate::plot::{line_chart, Series};
    let curve = |name: &str, f: &dyn Fn(&EpochMetrics) -> f64| Series {
        name: name.into(),
        points: history.iter().map(|m| (m.epoch as f64, f(m))).collect(),
    };
    line_chart(
        &dir.join("loss.svg"),
        "label-smoothed loss per target token",
        "epoch",
        "loss",
        &[curve("train", &|m| m.train_loss), curve("valid", &|m| m.valid_loss)],
    )?;
    line_chart(&dir.join("valid_bleu.svg"), "validation BLEU (sacreBLEU, beam)", "epoch", "BLEU", &[curve("valid", &|m| m.valid_bleu)])?;
    if let Some(layers) = history.first().and_then(|m| m.hnas_u.as_ref()).map(Vec::len) {
        let series: Vec<Series> = (0..layers)
            .map(|l| Series {
                name: format!("encoder layer {l}"),
                points: history.iter().filter_map(|m| m.hnas_u.as_ref().map(|u| (m.epoch as f64, u[l]))).collect(),
            })
            .collect();
        line_chart(&dir.join("hnas_u.svg"), "HNAS mixing weight u (mean over heads)", "epoch", "u", &series)?;
    }
    let per_layer = |v: &[f64]| v.iter().enumerate().map(|(l, &x)| (l as f64, x)).collect::<Vec<_>>();
    line_chart(
        &dir.join("head_diversity.svg"),
        "head diversity (Dist) of encoder self-attention, test set",
        "encoder layer",
        "Dist",
        &[Series { name: "Dist".into(), points: per_layer(dist) }],
    )?;
    line_chart(
        &dir.join("explained_away.svg"),
        "share of source tokens explained away (mass < 1e-8), test set",
        "encoder layer",
        "share",
        &[Series { name: "explained away".into(), points: per_layer(away) }],
    )?;
    Ok(())
}

/// Head diversity and the explained-away share of each encoder layer on `data`'s sources (none
/// for the LSTM, whose encoder has no attention).
pub(super) fn encoder_diagnostics(model: &Seq2Seq, data: &Encoded, device: Device) -> Result<(Vec<f64>, Vec<f64>)> {
    let Some(transformer) = model.config().transformer.as_ref() else { return Ok((vec![], vec![])) };
    let layers = transformer.encoder_layers;
    let (mut dist, mut weight) = (vec![0.0; layers], 0.0);
    let (mut away, mut keys) = (vec![0.0; layers], 0.0);
    tch::no_grad(|| -> Result<()> {
        for chunk in (0..data.len()).collect::<Vec<_>>().chunks(64) {
            let rows: Vec<&[i64]> = chunk.iter().map(|&i| data.src[i].as_slice()).collect();
            let src = data::pad_rows(&rows, device);
            let valid = src.ne(PAD); // (B, S)
            let tokens = f64::try_from(valid.sum(Kind::Double))?;
            let heads = transformer.heads as f64;
            for (l, (w, h)) in model.encoder_attention(&src)?.into_iter().enumerate() {
                dist[l] += probattn::repulsive::head_diversity(&h, Some(&valid))? * tokens;
                let mass = probattn::diagnostics::received_mass(&w); // (B, H, S)
                let counted = valid.unsqueeze(1).expand_as(&mass);
                away[l] += f64::try_from(mass.lt(probattn::diagnostics::EXPLAINED_AWAY_EPS).logical_and(&counted).sum(Kind::Double))?;
                if l == 0 {
                    keys += tokens * heads;
                }
            }
            weight += tokens;
        }
        Ok(())
    })?;
    Ok((dist.iter().map(|d| d / weight.max(1.0)).collect(), away.iter().map(|a| a / keys.max(1.0)).collect()))
}
