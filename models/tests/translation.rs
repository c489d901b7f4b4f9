//! The translation model's incremental decoder against the full decoder: feeding a prefix one
//! token at a time through `Seq2Seq::step` (cached keys and values, one query per step) gives the
//! log-probabilities of the teacher-forced `forward_t` at every position, in float64, for every
//! kind of encoder attention; and `DecoderState::reorder` moves a beam's cache with it. The same
//! for the attentional LSTM, whose bidirectional encoder must also not read the padding.

use anyhow::Result;
use probattn::Variant;
use probattn_models::lstm::LstmConfig;
use probattn_models::transformer::TransformerConfig;
use probattn_models::translation::{DecodingState, Seq2Seq, Seq2SeqConfig};
use std::sync::{Mutex, MutexGuard};
use tch::{nn, Device, Kind, Tensor};

const PAD: i64 = 1;
const EOS: i64 = 2;

fn model(variant: Variant) -> Result<(nn::VarStore, Seq2Seq)> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let transformer = TransformerConfig {
        encoder_layers: 2,
        decoder_layers: 2,
        embed_dim: 16,
        heads: 4,
        ffn_dim: 32,
        variant,
        ..TransformerConfig::iwslt()
    };
    let cfg =
        Seq2SeqConfig { transformer: Some(transformer), lstm: None, vocab: 30, pad: PAD, share_all_embeddings: true, max_positions: 64 };
    let m = Seq2Seq::new(&vs.root(), cfg)?;
    vs.double();
    Ok((vs, m))
}

/// Seeds libtorch's generator and holds a process-wide lock for the test's duration. The generator
/// is global and tests run in parallel threads: without the lock another test's draws (its model's
/// initial weights) interleave with this one's, and its data changes from run to run.
fn seeded(seed: i64) -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(seed);
    guard
}

/// `(B, S)` random source ids with `</s>` last and right padding of different lengths.
fn sources() -> Tensor {
    let rows: [&[i64]; 3] = [&[5, 9, 11, 7, EOS], &[8, 4, EOS, PAD, PAD], &[12, 3, 3, 6, EOS]];
    Tensor::from_slice(&rows.concat()).view([3, 5])
}

#[test]
fn cached_steps_equal_the_teacher_forced_decoder() -> Result<()> {
    let _serial = seeded(5);
    for name in ["softmax", "dnas", "hnas", "sinkhorn-3", "bam-wc", "bam-lf"] {
        let (_vs, m) = model(name.parse()?)?;
        let src = sources();
        let prefix = Tensor::from_slice(&[EOS, 7, 9, 4, 20, 5, EOS, 3, 3, 8, 8, 10, EOS, 25, 6, 7, 11, 12]).view([3, 6]);
        let (logits, _) = m.forward_t(&src, &prefix, false)?;
        let full = logits.log_softmax(-1, Kind::Double); // (B, T, V)
        let (mut state, src_pad) = m.start(&src)?;
        for t in 0..6 {
            let step = m.step(&prefix.select(1, t), t, &mut state, &src_pad)?; // (B, V)
            let err = f64::try_from((&step - full.select(1, t)).abs().max())?;
            assert!(err < 1e-10, "{name}: step {t} differs from the full decoder by {err}");
        }
        let DecodingState::Transformer(state) = &state else { panic!("{name}: not a Transformer's state") };
        assert_eq!(state.own[0].as_ref().map(|(k, _)| k.size()), Some(vec![3, 4, 6, 4]), "{name}: the cache holds 6 positions");
    }
    Ok(())
}

fn lstm(variant: Variant) -> Result<(nn::VarStore, Seq2Seq)> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let lstm = LstmConfig { embed_dim: 8, encoder_hidden: 6, decoder_hidden: 10, variant, ..LstmConfig::deng2018() };
    let cfg = Seq2SeqConfig { transformer: None, lstm: Some(lstm), vocab: 30, pad: PAD, share_all_embeddings: false, max_positions: 64 };
    let m = Seq2Seq::new(&vs.root(), cfg)?;
    vs.double();
    Ok((vs, m))
}

#[test]
fn lstm_cached_steps_equal_the_teacher_forced_decoder() -> Result<()> {
    let _serial = seeded(7);
    for name in ["softmax", "dnas", "bam-wc", "bam-lc"] {
        let (_vs, m) = lstm(name.parse()?)?;
        let src = sources();
        let prefix = Tensor::from_slice(&[EOS, 7, 9, 4, 20, 5, EOS, 3, 3, 8, PAD, PAD, EOS, 25, 6, 7, 11, 12]).view([3, 6]);
        let (logits, kl) = m.forward_t(&src, &prefix, false)?;
        assert!(kl.is_none(), "{name}: no KL in eval mode");
        let full = logits.log_softmax(-1, Kind::Double);
        let (mut state, src_pad) = m.start(&src)?;
        // Past a sentence's end (its padded steps) the teacher-forced pass leaves the attention
        // out, and nothing reads those positions: compare the live ones.
        let live = prefix.ne(PAD).unsqueeze(-1).to_kind(Kind::Double);
        for t in 0..6 {
            let step = m.step(&prefix.select(1, t), t, &mut state, &src_pad)?;
            let err = f64::try_from(((&step - full.select(1, t)) * live.select(1, t)).abs().max())?;
            assert!(err < 1e-10, "{name}: step {t} differs from the full decoder by {err}");
        }
        // Training: BAM samples and returns a finite, differentiable KL; softmax none.
        let (logits, kl) = m.forward_t(&src, &prefix, true)?;
        assert_eq!(kl.is_some(), name.starts_with("bam"), "{name}");
        let loss = logits.sum(Kind::Double) + kl.unwrap_or_else(|| Tensor::zeros([], (Kind::Double, Device::Cpu)));
        assert!(f64::try_from(&loss)?.is_finite(), "{name}");
        loss.backward();
    }
    Ok(())
}

#[test]
fn lstm_encoder_reads_no_padding_and_its_cache_reorders() -> Result<()> {
    let _serial = seeded(8);
    // Causal DNAS too: its carried column logsumexps must skip the padding and move with the beams.
    for variant in [Variant::Softmax, Variant::Dnas] {
        let (_vs, m) = lstm(variant)?;
        // Sentence 1 alone, and inside the padded batch: the same log-probabilities at every step,
        // so neither encoder direction (nor the attention) saw the padding.
        let src = sources();
        let alone = src.narrow(0, 1, 1).narrow(1, 0, 3);
        let prefix = Tensor::from_slice(&[EOS, 7, 9, EOS, 3, 3, EOS, 25, 6]).view([3, 3]);
        let (batched, _) = m.forward_t(&src, &prefix, false)?;
        let (single, _) = m.forward_t(&alone, &prefix.narrow(0, 1, 1), false)?;
        let err = f64::try_from((batched.narrow(0, 1, 1) - single).abs().max())?;
        assert!(err < 1e-12, "{variant}: the padded sentence's outputs moved by {err}");
        // Reorder after two steps, as beam search does.
        assert_reorder_moves_each_hypothesis(&m, &src, &prefix)?;
    }
    Ok(())
}

#[test]
fn lstm_refuses_what_normalizes_over_queries_beyond_causal_dnas() {
    let _serial = seeded(10); // building the models draws their weights
    for name in ["hnas", "sinkhorn-2"] {
        let err = lstm(name.parse().unwrap()).unwrap_err().to_string();
        assert!(err.contains("one decoder state at a time") && err.contains(name), "{name}: {err}");
    }
}

#[test]
fn reordering_the_cache_moves_each_hypothesis_with_its_beam() -> Result<()> {
    let _serial = seeded(6);
    let (_vs, m) = model(Variant::Softmax)?;
    let prefix = Tensor::from_slice(&[EOS, 7, 9, EOS, 3, 3, EOS, 25, 6]).view([3, 3]);
    assert_reorder_moves_each_hypothesis(&m, &sources(), &prefix)
}

/// Two cached steps of `prefix (3, 3)`, then sentences 0 and 2 swapped in the cache (and the
/// source padding) and the last step taken: it must equal the teacher-forced decoder's, swapped.
fn assert_reorder_moves_each_hypothesis(m: &Seq2Seq, src: &Tensor, prefix: &Tensor) -> Result<()> {
    let (mut state, src_pad) = m.start(src)?;
    for t in 0..2 {
        let _ = m.step(&prefix.select(1, t), t, &mut state, &src_pad)?;
    }
    let order = Tensor::from_slice(&[2i64, 1, 0]);
    state.reorder(&order);
    let swapped = m.step(&prefix.select(1, 2).index_select(0, &order), 2, &mut state, &src_pad.index_select(0, &order))?;
    let (logits, _) = m.forward_t(src, prefix, false)?;
    let full = logits.select(1, 2).log_softmax(-1, Kind::Double).index_select(0, &order);
    assert!(f64::try_from((&swapped - &full).abs().max())? < 1e-10);
    Ok(())
}

#[test]
fn cross_attention_stays_row_wise() {
    let cfg = |v: &str| TransformerConfig { variant: v.parse().unwrap(), ..TransformerConfig::iwslt() };
    assert_eq!(cfg("dnas").cross_variant(), Variant::Softmax);
    assert_eq!(cfg("sinkhorn-2").cross_variant(), Variant::Softmax);
    assert_eq!(cfg("bam-wc").cross_variant(), "bam-wc".parse().unwrap());
    assert_eq!(cfg("softmax").cross_variant(), Variant::Softmax);
}

/// A row-wise variant registered outside the library and defined by its plan alone (softmax at a
/// temperature, as `warm-N`: no sweeps, a score scale of `1/N`), which no model names: its
/// properties alone let it into the decoder's causal self-attention and the cross-attention, and
/// a model with it trains; the same with a doubly normalized variant is refused by the decoder
/// and kept out of the cross-attention.
mod registered {
    use probattn::normalize::registry::VariantSpec;
    use probattn::normalize::Normalizer;
    use probattn::tiled::Tiled;
    use probattn::Variant;

    #[derive(Debug)]
    struct Warm(u32);

    impl Normalizer for Warm {
        fn name(&self) -> String {
            format!("warm-{}", self.0)
        }
        fn tiled(&self) -> Option<Tiled<'_>> {
            Some(Tiled { score_scale: 1.0 / f64::from(self.0), ..Tiled::sweeps(self.name(), 0) })
        }
    }

    pub static WARM: VariantSpec = VariantSpec {
        name: "warm-N",
        aliases: &[],
        example: "warm-2",
        summary: "softmax of the scores divided by N",
        source: "a test",
        benchmarked: false,
        settings: &[],
        parse: |s| s.strip_prefix("warm-")?.parse().ok().map(|n| Variant::Registered { spec: &WARM, n }),
        build: |_, _, _, _, n| Ok(Box::new(Warm(n))),
    };
}

#[test]
fn a_registered_row_wise_variant_trains_in_the_decoder_and_the_cross_attention() -> Result<()> {
    let _serial = seeded(8);
    let warm = Variant::Registered { spec: &registered::WARM, n: 2 };
    let config = |variant: Variant| TransformerConfig {
        encoder_layers: 1,
        decoder_layers: 1,
        embed_dim: 16,
        heads: 4,
        ffn_dim: 32,
        variant,
        decoder_self_variant: variant,
        ..TransformerConfig::iwslt()
    };
    assert_eq!(config(warm).cross_variant(), warm);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg =
        Seq2SeqConfig { transformer: Some(config(warm)), lstm: None, vocab: 30, pad: PAD, share_all_embeddings: true, max_positions: 64 };
    let m = Seq2Seq::new(&vs.root(), cfg)?;
    let mut opt = nn::OptimizerConfig::build(nn::Adam::default(), &vs, 1e-2)?;
    let (src, prev) = (sources(), Tensor::from_slice(&[EOS, 7, 9, EOS, 4, 20, EOS, 5, 6]).view([3, 3]));
    let target = Tensor::from_slice(&[7i64, 9, 4, 4, 20, 5, 5, 6, 11]).view([3, 3]);
    let loss = |m: &Seq2Seq| -> Result<Tensor> {
        let (logits, _) = m.forward_t(&src, &prev, true)?;
        Ok(logits.view([-1, 30]).cross_entropy_for_logits(&target.view([-1])))
    };
    let before = f64::try_from(loss(&m)?)?;
    for _ in 0..20 {
        opt.backward_step(&loss(&m)?);
    }
    let after = f64::try_from(loss(&m)?)?;
    assert!(after < before, "twenty steps did not lower the loss: {before} -> {after}");
    // A doubly normalized variant: refused by the decoder, kept out of the cross-attention.
    let dnas = Variant::Dnas;
    assert_eq!(config(dnas).cross_variant(), Variant::Softmax);
    let cfg =
        Seq2SeqConfig { transformer: Some(config(dnas)), lstm: None, vocab: 30, pad: PAD, share_all_embeddings: true, max_positions: 64 };
    let refused = Seq2Seq::new(&nn::VarStore::new(Device::Cpu).root(), cfg).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(refused.contains("normalizes each query over the keys alone") && refused.contains("dnas"), "{refused}");
    Ok(())
}

/// A training step's loss in bfloat16 (an autocast region over the forward pass) against float32,
/// on the same float32 weights: within `LOSS_TOL` of the float32 loss, and the gradients, which
/// stay float32 like the weights, within `GRAD_TOL` in norm (‖Δg‖ / ‖g‖ over every parameter).
/// The norm, not the largest entry: at initialization a gradient entry is a sum that largely
/// cancels, so single entries carry bfloat16's error many times over while the step's direction
/// holds. Seeded 0–39 instead, the loss errors reached 9e-4 and the gradient errors 0.086.
const LOSS_TOL: f64 = 0.002;
const GRAD_TOL: f64 = 0.15;

#[test]
fn a_bfloat16_step_agrees_with_float32_and_keeps_float32_weights() -> Result<()> {
    use probattn::precision::Precision;
    let _serial = seeded(9);
    for name in ["softmax", "dnas", "bam-wc"] {
        // The float64 model of the tests above, its weights in float32 as a training run keeps them.
        let (mut vs, m) = model(name.parse()?)?;
        vs.float();
        let src = sources();
        let prefix = Tensor::from_slice(&[EOS, 7, 9, 4, 20, 5, EOS, 3, 3, 8, 8, 10, EOS, 25, 6, 7, 11, 12]).view([3, 6]);
        let target = prefix.roll([-1], [1]);
        let step = |precision: Precision| -> Result<(f64, Vec<Tensor>)> {
            for v in vs.trainable_variables() {
                let _ = v.grad().f_zero_();
            }
            let (logits, _) = precision.run(Device::Cpu, || m.forward_t(&src, &prefix, false))??;
            let lprobs = logits.log_softmax(-1, Kind::Float);
            let loss = -lprobs.gather(-1, &target.unsqueeze(-1), false).mean(Kind::Float);
            loss.backward();
            // Parameters the eval pass does not reach (BAM's prior) have no gradient.
            let grads = vs.trainable_variables().iter().map(|v| v.grad()).filter(Tensor::defined).map(|g| g.copy()).collect();
            Ok((f64::try_from(&loss)?, grads))
        };
        let (want, want_grads) = step(Precision::F32)?;
        let (got, got_grads) = step(Precision::Bf16)?;
        let err = (got - want).abs() / want.abs();
        assert!(err <= LOSS_TOL, "{name}: bfloat16 loss {got} against float32 {want}: {err:.2e} > {LOSS_TOL}");
        assert!(got != want, "{name}: the same loss in both precisions: the region did nothing");
        assert_eq!(got_grads.len(), want_grads.len(), "{name}: the two steps reached different parameters");
        let (mut off, mut norm) = (0.0f64, 0.0f64);
        for (a, b) in got_grads.iter().zip(&want_grads) {
            assert_eq!(a.kind(), Kind::Float, "{name}: a gradient left float32");
            off += f64::try_from((a - b).square().sum(Kind::Double))?;
            norm += f64::try_from(b.square().sum(Kind::Double))?;
        }
        let grad_err = (off / norm).sqrt();
        assert!(grad_err <= GRAD_TOL, "{name}: gradients off by {grad_err:.3} of their norm > {GRAD_TOL}");
        assert!(vs.trainable_variables().iter().all(|v| v.kind() == Kind::Float), "{name}: weights left float32");
        println!("{name}: loss {want:.6} (f32) {got:.6} (bf16), relative {err:.2e}; gradients {grad_err:.2e} of their norm");
    }
    Ok(())
}
