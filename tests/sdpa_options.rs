//! The options `scaled_dot_product_attention` has and the library shares: an additive float mask
//! (`Masks::bias`, `-inf` excluding), a score scale (`AttendOptions::scale`) and grouped key/value
//! heads (`AttendOptions::enable_gqa`), on every route (eager, the softmax kernel, the tiles, the
//! fused CPU kernel where it applies), for softmax, DNAS, Sinkhorn-3 and HNAS. Each is compared in
//! float64 with the formula written here from libtorch reductions, keys and values repeated per
//! group as the formula reads them: output and the gradients in q, k, v, the bias and HNAS's gate.
//! float16 joins the memory-efficient path.

use probattn::backend::{Backend, Route};
use probattn::normalize::{Dnas, Hnas, Normalizer, Sinkhorn, Softmax};
use probattn::tiled::{attend_tiled, Tiled, TiledOptions};
use probattn::{attend, attend_with_choice, AttendOptions, Masks, Result};
use tch::{nn, Device, Kind, Tensor};

const F64: (Kind, Device) = (Kind::Double, Device::Cpu);

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// The normalizers' weights from the formula, over the entries `allowed` leaves (a row with none
/// is all zeros): `sweeps` column/row log-normalizations, then the row softmax; HNAS mixes DNAS and
/// softmax by `u` per head.
fn weights(z: &Tensor, allowed: &Tensor, sweeps: u32) -> Tensor {
    // Excluded entries are a large finite negative through the sweeps (a column with no allowed
    // entry, a padded key's, stays finite), then -inf for the last softmax.
    let excluded = allowed.logical_not();
    let mut y = z.masked_fill(&excluded, -1e200);
    for t in 0..sweeps {
        if t > 0 {
            y = (&y - y.logsumexp([-1i64].as_slice(), true)).masked_fill(&excluded, -1e200);
        }
        y = (&y - y.logsumexp([-2i64].as_slice(), true)).masked_fill(&excluded, -1e200);
    }
    y.masked_fill(&excluded, f64::NEG_INFINITY).softmax(-1, Kind::Double).nan_to_num(0.0, None, None)
}

/// One case: the variant's formula and the library's normalizer.
struct Variant {
    name: &'static str,
    sweeps: u32,
    hnas: bool,
}

const VARIANTS: [Variant; 4] = [
    Variant { name: "softmax", sweeps: 0, hnas: false },
    Variant { name: "dnas", sweeps: 1, hnas: false },
    Variant { name: "sinkhorn-3", sweeps: 3, hnas: false },
    Variant { name: "hnas", sweeps: 1, hnas: true },
];

/// `z = scale · q·kᵀ + bias` with `k`, `v` repeated per group; the weights over `allowed` (and the
/// bias's finite entries); the output.
fn formula(q: &Tensor, k: &Tensor, v: &Tensor, (bias, allowed): (&Tensor, &Tensor), scale: f64, variant: &Variant, u: &Tensor) -> Tensor {
    let g = q.size()[1] / k.size()[1];
    let (k, v) = (k.repeat_interleave_self_int(g, Some(1), None), v.repeat_interleave_self_int(g, Some(1), None));
    let z = q.matmul(&k.transpose(-2, -1)) * scale + bias;
    let allowed = allowed.logical_and(&bias.isneginf().logical_not());
    let w = if variant.hnas {
        let u = u.sigmoid().view([1, -1, 1, 1]);
        &u * weights(&z, &allowed, 1) + (1.0 - &u) * weights(&z, &allowed, 0)
    } else {
        weights(&z, &allowed, variant.sweeps)
    };
    w.matmul(&v)
}

/// The gradients of `sum(out · ct)` in `inputs`.
fn grads(out: &Tensor, ct: &Tensor, inputs: &[&Tensor]) -> Vec<Tensor> {
    Tensor::run_backward(&[(out * ct).sum(Kind::Double)], inputs, false, false)
}

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    /// Boolean, true = may attend (the formula's), from a key padding mask.
    allowed: Tensor,
    pad: Tensor,
    ct: Tensor,
}

/// B 2, 4 query heads over `kv_heads` key/value heads, 6 queries over 7 keys, d 5, d_v 3. The
/// bias is a full (S_q, S_k) float mask with one query's keys all `-inf` but one and one entry of
/// another query `-inf`; the key padding leaves every column and row something.
fn inputs(kv_heads: i64, bias_shape: &[i64]) -> Inputs {
    let (b, h, sq, sk, d, dv) = (2, 4, 6, 7, 5, 3);
    let q = Tensor::randn([b, h, sq, d], F64).set_requires_grad(true);
    let k = Tensor::randn([b, kv_heads, sk, d], F64).set_requires_grad(true);
    let v = Tensor::randn([b, kv_heads, sk, dv], F64).set_requires_grad(true);
    let bias = Tensor::randn(bias_shape, F64);
    let rows = bias_shape[bias_shape.len() - 2];
    if rows > 2 {
        let _ = bias.narrow(-2, 1, 1).narrow(-1, 1, sk - 1).fill_(f64::NEG_INFINITY);
        let _ = bias.narrow(-2, 2, 1).narrow(-1, 0, 1).fill_(f64::NEG_INFINITY);
    }
    let bias = bias.set_requires_grad(true);
    let pad = Tensor::zeros([b, sk], (Kind::Bool, Device::Cpu));
    let _ = pad.narrow(0, 1, 1).narrow(1, sk - 2, 2).fill_(1);
    let allowed = pad.logical_not().view([b, 1, 1, sk]);
    let ct = Tensor::randn([b, h, sq, dv], F64);
    Inputs { q, k, v, bias, allowed, pad, ct }
}

fn normalizer(variant: &Variant, vs: &nn::VarStore) -> Result<Box<dyn Normalizer>> {
    Ok(match variant.name {
        "softmax" => Box::new(Softmax),
        "dnas" => Box::new(Dnas),
        "sinkhorn-3" => Box::new(Sinkhorn::new(3)?),
        _ => Box::new(Hnas::new(&vs.root(), 4, 0.3)?),
    })
}

/// Every route the library offers for these options against the formula, outputs and gradients.
#[test]
fn bias_scale_and_grouped_heads_equal_the_formula_on_every_route() -> Result<()> {
    tch::manual_seed(7);
    let mut compared = 0;
    let mut largest: f64 = 0.0;
    for (kv_heads, bias_shape, scale) in [(4, vec![6, 7], None), (2, vec![2, 1, 6, 7], Some(0.37)), (1, vec![1, 4, 1, 7], Some(1.6))] {
        let x = inputs(kv_heads, &bias_shape);
        let masks = Masks { key_padding: Some(&x.pad), bias: Some(&x.bias), ..Default::default() };
        for variant in &VARIANTS {
            let mut vs = nn::VarStore::new(Device::Cpu);
            let norm = normalizer(variant, &vs)?;
            vs.double(); // HNAS's gate logits in float64, as everything else here
            let u = vs.variables().into_values().next().unwrap_or_else(|| Tensor::zeros([4], F64));
            let mut inputs: Vec<&Tensor> = vec![&x.q, &x.k, &x.v, &x.bias];
            if variant.hnas {
                inputs.push(&u);
            }
            let s = scale.unwrap_or(1.0 / 5f64.sqrt());
            let reference = formula(&x.q, &x.k, &x.v, (&x.bias, &x.allowed), s, variant, &u);
            let expected = grads(&reference, &x.ct, &inputs);
            let routes: [(Backend, Option<i64>); 4] =
                [(Backend::Eager, None), (Backend::Auto, None), (Backend::Tiles, Some(4)), (Backend::Auto, Some(4))];
            for (backend, tile) in routes {
                let opts = AttendOptions { need_weights: false, tile, scale, enable_gqa: true, backend, ..Default::default() };
                let (out, choice) = attend_with_choice(&x.q, &x.k, &x.v, &masks, norm.as_ref(), opts)?;
                let got = grads(&out.output, &x.ct, &inputs);
                let what = format!("{} over {kv_heads} kv heads, bias {bias_shape:?}, scale {scale:?}, {:?}", variant.name, choice.route);
                let mut diff = max_diff(&out.output, &reference);
                for (name, (a, b)) in ["q", "k", "v", "bias", "gate"].iter().zip(got.iter().zip(&expected)) {
                    let d = max_diff(a, b);
                    assert!(d < 1e-10, "{what}: d{name} differs by {d:e}");
                    diff = diff.max(d);
                }
                assert!(diff < 1e-10, "{what}: output differs by {diff:e}");
                // With a bias or grouped heads the fused CPU kernel does not apply: the tiles serve.
                if tile.is_some() {
                    assert_eq!(choice.route, Route::Tiles, "{what}");
                }
                largest = largest.max(diff);
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 3 * 4 * 4);
    eprintln!("{compared} comparisons, largest difference {largest:.1e}");
    Ok(())
}

/// The scale alone keeps the fused CPU kernel under DNAS and SDPA's kernel under softmax, and
/// both equal the formula; the comparison can fail (the default scale gives other numbers).
#[test]
fn a_scale_alone_keeps_the_fused_routes() -> Result<()> {
    tch::manual_seed(8);
    let x = inputs(4, &[6, 7]);
    let none = Tensor::zeros([1, 1, 1, 1], F64);
    let everyone = Tensor::ones([1, 1, 1, 1], (Kind::Bool, Device::Cpu));
    for (variant, norm, tile, route) in [
        (&VARIANTS[1], Box::new(Dnas) as Box<dyn Normalizer>, Some(3), Route::FusedCpu),
        (&VARIANTS[0], Box::new(Softmax), None, Route::Kernel),
    ] {
        // The fused CPU kernel takes d_v = d: the keys are the values.
        let reference = formula(&x.q, &x.k, &x.k, (&none, &everyone), 0.8, variant, &none);
        let opts = AttendOptions { need_weights: false, tile, scale: Some(0.8), ..Default::default() };
        let (out, choice) = attend_with_choice(&x.q, &x.k, &x.k, &Masks::default(), norm.as_ref(), opts)?;
        assert_eq!(choice.route, route, "{}", variant.name);
        let d = max_diff(&out.output, &reference);
        assert!(d < 1e-12, "{}: differs by {d:e}", variant.name);
        let default =
            attend(&x.q, &x.k, &x.k, &Masks::default(), norm.as_ref(), AttendOptions { tile, need_weights: false, ..Default::default() })?;
        assert!(max_diff(&default.output, &reference) > 1e-3, "{}: the scale changed nothing", variant.name);
    }
    Ok(())
}

/// A padding mask broadcast over the queries (transformers builds one for a padded batch, by
/// `expand`) runs as key padding: DNAS takes the fused CPU kernel, as under the key padding itself,
/// with the same numbers; the same mask stored whole is a pattern, on the tiles. Both equal the
/// eager path, output and gradient in q.
#[test]
fn a_padding_mask_broadcast_over_the_queries_runs_as_key_padding() -> Result<()> {
    tch::manual_seed(12);
    let x = inputs(4, &[6, 7]);
    let (b, sq, sk) = (2, 6, 7);
    let expanded = x.pad.view([b, 1, 1, sk]).expand([b, 1, sq, sk], false);
    let stored = expanded.contiguous();
    // The fused CPU kernel takes d_v = d: the keys are the values.
    let run = |masks: Masks, backend: Backend, tile: Option<i64>| {
        let opts = AttendOptions { need_weights: false, tile, backend, ..Default::default() };
        attend_with_choice(&x.q, &x.k, &x.k, &masks, &Dnas, opts)
    };
    let (padded, by_padding) = run(Masks { key_padding: Some(&x.pad), ..Default::default() }, Backend::Auto, Some(3))?;
    let (broadcast, by_broadcast) = run(Masks { attn_mask: Some(&expanded), ..Default::default() }, Backend::Auto, Some(3))?;
    let (pattern, by_pattern) = run(Masks { attn_mask: Some(&stored), ..Default::default() }, Backend::Auto, Some(3))?;
    assert_eq!([by_padding.route, by_broadcast.route, by_pattern.route], [Route::FusedCpu, Route::FusedCpu, Route::Tiles]);
    assert_eq!(max_diff(&broadcast.output, &padded.output), 0.0);
    let (eager, _) = run(Masks { attn_mask: Some(&stored), ..Default::default() }, Backend::Eager, None)?;
    let ct = Tensor::randn_like(&eager.output);
    let want = grads(&eager.output, &ct, &[&x.q]).remove(0);
    for (out, what) in [(&broadcast, "broadcast"), (&pattern, "stored")] {
        let d = max_diff(&out.output, &eager.output);
        assert!(d < 1e-12, "{what}: the output differs from the eager path's by {d:e}");
        let d = max_diff(&grads(&out.output, &ct, &[&x.q]).remove(0), &want);
        assert!(d < 1e-12, "{what}: the gradient in q differs from the eager path's by {d:e}");
    }
    Ok(())
}

/// A query whose keys are all `-inf` gets a zero output and zero gradients, as SDPA gives.
#[test]
fn a_row_the_bias_excludes_wholly_is_zero() -> Result<()> {
    tch::manual_seed(9);
    let x = inputs(4, &[6, 7]);
    let _ = x.bias.detach().narrow(0, 3, 1).fill_(f64::NEG_INFINITY);
    let masks = Masks { bias: Some(&x.bias), ..Default::default() };
    for (backend, tile) in [(Backend::Eager, None), (Backend::Auto, None), (Backend::Tiles, Some(2))] {
        let opts = AttendOptions { need_weights: false, tile, backend, ..Default::default() };
        let out = attend(&x.q, &x.k, &x.v, &masks, &Softmax, opts)?.output;
        let row = out.narrow(2, 3, 1);
        assert_eq!(row.abs().max().double_value(&[]), 0.0, "{backend:?}");
        let dq = grads(&out, &x.ct, &[&x.q]).remove(0);
        assert_eq!(dq.narrow(2, 3, 1).abs().max().double_value(&[]), 0.0, "{backend:?}");
        assert_eq!(out.isnan().any().int64_value(&[]), 0, "{backend:?}");
    }
    Ok(())
}

/// float16 takes the memory-efficient path (statistics in float32) and agrees with the eager path
/// from the same float16 inputs, for each plan, with a bias and grouped heads.
#[test]
fn float16_takes_the_memory_efficient_path() -> Result<()> {
    tch::manual_seed(10);
    let x = inputs(2, &[6, 7]);
    let half = |t: &Tensor| t.detach().to_kind(Kind::Half);
    let (q, k, v, bias) = (half(&x.q), half(&x.k), half(&x.v), x.bias.detach().to_kind(Kind::Float));
    let masks = Masks { key_padding: Some(&x.pad), bias: Some(&bias), ..Default::default() };
    for plan in [Tiled::softmax(), Tiled::dnas(), Tiled::sinkhorn(3)] {
        let opts = TiledOptions { enable_gqa: true, ..TiledOptions::new(4) };
        let tiled = attend_tiled(&q, &k, &v, &masks, &plan, opts)?.output;
        assert_eq!(tiled.kind(), Kind::Half);
        let norm: Box<dyn Normalizer> = match plan.sweeps {
            0 => Box::new(Softmax),
            1 => Box::new(Dnas),
            n => Box::new(Sinkhorn::new(n)?),
        };
        let eager =
            attend(&q, &k, &v, &masks, norm.as_ref(), AttendOptions { enable_gqa: true, backend: Backend::Eager, ..Default::default() })?
                .output;
        let d = max_diff(&tiled.to_kind(Kind::Float), &eager.to_kind(Kind::Float));
        assert!(d < 2e-3, "{}: float16 tiles and eager differ by {d:e}", plan.name);
    }
    Ok(())
}

/// Each bad option is an error that names it.
#[test]
fn bad_options_are_named() -> Result<()> {
    let x = inputs(2, &[6, 7]);
    let run =
        |masks: &Masks, opts: AttendOptions| attend(&x.q, &x.k, &x.v, masks, &Dnas, opts).err().map(|e| e.to_string()).unwrap_or_default();
    let m = run(&Masks::default(), AttendOptions::default());
    assert!(m.contains("equal heads are required unless grouped-query attention is enabled"), "{m}");
    let three = Tensor::randn([2, 3, 7, 5], F64);
    let m =
        attend(&x.q, &three, &three.narrow(3, 0, 3), &Masks::default(), &Dnas, AttendOptions { enable_gqa: true, ..Default::default() })
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
    assert!(m.contains("divide the query heads"), "{m}");
    let gqa = AttendOptions { enable_gqa: true, ..Default::default() };
    let m = run(&Masks::default(), AttendOptions { scale: Some(f64::NAN), ..gqa });
    assert!(m.contains("score scale must be finite"), "{m}");
    let nan = Tensor::zeros([6, 7], F64);
    let _ = nan.narrow(0, 1, 1).fill_(f64::NAN);
    let m = run(&Masks { bias: Some(&nan), ..Default::default() }, gqa);
    assert!(m.contains("additive mask (bias) holds NaN"), "{m}");
    let inf = Tensor::zeros([6, 7], F64);
    let _ = inf.narrow(0, 2, 1).fill_(f64::INFINITY);
    let m = run(&Masks { bias: Some(&inf), ..Default::default() }, gqa);
    assert!(m.contains("+inf"), "{m}");
    let wrong = Tensor::zeros([5, 7], F64);
    let m = run(&Masks { bias: Some(&wrong), ..Default::default() }, gqa);
    assert!(m.contains("additive mask (bias) has shape [5, 7]"), "{m}");
    let boolean = Tensor::zeros([6, 7], (Kind::Bool, Device::Cpu));
    let m = run(&Masks { bias: Some(&boolean), ..Default::default() }, gqa);
    assert!(m.contains("must be floating-point"), "{m}");
    Ok(())
}

/// BAM-WC and BAM-LC sampling under grouped heads: the contextual prior's networks read each
/// query head's keys, so the grouped call equals the call with `k` and `v` repeated per group
/// (output, KL and the gradients in q, k, v and the prior), on the eager path and the tiles, given
/// one draw.
#[test]
fn grouped_heads_under_bam_equal_repeated_heads() -> Result<()> {
    use probattn::normalize::{Bam, BamConfig, BamKind, NormalizerConfig};
    tch::manual_seed(11);
    let x = inputs(2, &[6, 7]);
    let repeat = |t: &Tensor| t.detach().repeat_interleave_self_int(2, Some(1), None).set_requires_grad(true);
    let (k4, v4) = (repeat(&x.k), repeat(&x.v));
    let masks = Masks { key_padding: Some(&x.pad), ..Default::default() };
    for kind in [BamKind::WeibullContextual, BamKind::LognormalContextual] {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let bam = BamConfig { k: 5.0, sigma: 0.7, ..Default::default() };
        let normalizer = Bam::new(&vs.root(), kind, 4, 5, &NormalizerConfig { bam, ..Default::default() })?;
        vs.double();
        let prior = vs.trainable_variables();
        let noise = if kind.is_weibull() { Tensor::rand([2, 4, 6, 7], F64) } else { Tensor::randn([2, 4, 6, 7], F64) };
        for tile in [None, Some(4)] {
            let run = |k: &Tensor, v: &Tensor| -> Result<Vec<Tensor>> {
                let opts = AttendOptions {
                    mode: probattn::Mode::TRAIN,
                    noise: Some(&noise),
                    need_weights: false,
                    tile,
                    enable_gqa: true,
                    ..Default::default()
                };
                let out = attend(&x.q, k, v, &masks, &normalizer, opts)?;
                let kl = out.kl.expect("a contextual BAM samples a KL");
                let loss = (&out.output * &x.ct).sum(Kind::Double) + &kl * 0.37;
                let mut wrt: Vec<&Tensor> = vec![&x.q, k, v];
                wrt.extend(prior.iter());
                let mut all = vec![out.output.detach(), kl.detach()];
                all.extend(Tensor::run_backward(&[loss], &wrt, false, false));
                Ok(all)
            };
            let (grouped, repeated) = (run(&x.k, &x.v)?, run(&k4, &v4)?);
            let what = format!("{kind:?}, tile {tile:?}");
            for (i, (a, b)) in grouped.iter().zip(&repeated).enumerate() {
                // The repeated call's dk and dv are per query head: summed over each group.
                let b = if i == 3 || i == 4 { b.view([2, 2, 2, 7, -1]).sum_dim_intlist(2, false, Kind::Double) } else { b.shallow_clone() };
                let d = max_diff(a, &b);
                assert!(d < 1e-10, "{what}: entry {i} differs by {d:e}");
            }
        }
    }
    Ok(())
}
