//! `probattn::tiled`: the memory-efficient path equals the eager path (`probattn::attend`) in
//! float64 within 1e-10 (the stated tolerance; the differences seen are float rounding, ~1e-15):
//! output, received mass, and the gradients of `sum(output · G)` with respect to q, k, v and
//! HNAS's gate logits, for softmax, DNAS, HNAS and Sinkhorn-N, under every mask layout (none, key
//! padding with a fully padded sequence, query padding, a boolean (B, H, S_q, S_k) pattern with
//! fully excluded rows and columns, causal for softmax), at tile sizes that do and do not divide
//! S_q; and BAM's five variants over four bases, sampled with the same counter-based draws on
//! both paths, with their KL terms and the gradients of the contextual prior's parameters.

mod common;

use anyhow::{ensure, Result};
use probattn::normalize::{Bam, BamConfig, BamKind, Dnas, Hnas, Normalizer, NormalizerConfig, Sinkhorn, Softmax};
use probattn::tiled::{attend_tiled, counter_noise, counter_noise_rows, Tiled, TiledOptions};
use probattn::{attend, AttendOptions, Masks, Mode, Variant};
use tch::{nn, Device, Kind, Tensor};

const B: i64 = 2;
const H: i64 = 3;
const L: i64 = 13;
const S: i64 = 11;
const D: i64 = 8;

/// Random q (B, H, L, D), k (B, H, S, D) at twice the spread, and v (B, H, S, D), drawn in that
/// order from libtorch's generator.
fn qkv(opts: (Kind, Device)) -> [Tensor; 3] {
    [Tensor::randn([B, H, L, D], opts), Tensor::randn([B, H, S, D], opts) * 2.0, Tensor::randn([B, H, S, D], opts)]
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

struct Case {
    name: &'static str,
    key_padding: Option<Tensor>,
    query_padding: Option<Tensor>,
    attn_mask: Option<Tensor>,
    causal: bool,
}

impl Case {
    fn to(&self, device: Device) -> Case {
        let to = |t: &Option<Tensor>| t.as_ref().map(|t| t.to_device(device));
        Case {
            name: self.name,
            key_padding: to(&self.key_padding),
            query_padding: to(&self.query_padding),
            attn_mask: to(&self.attn_mask),
            causal: self.causal,
        }
    }

    fn masks(&self) -> Masks<'_> {
        Masks {
            key_padding: self.key_padding.as_ref(),
            query_padding: self.query_padding.as_ref(),
            attn_mask: self.attn_mask.as_ref(),
            causal: self.causal,
            bias: None,
        }
    }
}

fn cases() -> Vec<Case> {
    // Sequence 1 has every key padded: its rows are all zero in both paths.
    let key_padding = Tensor::arange(S, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&[7i64, 0]).unsqueeze(1));
    let partial_padding =
        Tensor::arange(S, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&[7i64, 3]).unsqueeze(1));
    let query_padding = Tensor::arange(L, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&[9i64, 12]).unsqueeze(1));
    let pattern = Tensor::rand([B, H, L, S], (Kind::Double, Device::Cpu)).lt(0.3);
    let _ = pattern.narrow(2, 4, 1).fill_(1); // a fully excluded row in every head
    let _ = pattern.narrow(3, 2, 1).fill_(1); // a fully excluded column
    vec![
        Case { name: "none", key_padding: None, query_padding: None, attn_mask: None, causal: false },
        Case { name: "key padding", key_padding: Some(key_padding.shallow_clone()), query_padding: None, attn_mask: None, causal: false },
        // Every sequence keeps a key: the fused CPU kernel takes it (above it falls back).
        Case {
            name: "key padding, no empty sequence",
            key_padding: Some(partial_padding),
            query_padding: None,
            attn_mask: None,
            causal: false,
        },
        Case {
            name: "key and query padding",
            key_padding: Some(key_padding),
            query_padding: Some(query_padding),
            attn_mask: None,
            causal: false,
        },
        Case {
            name: "boolean pattern",
            key_padding: None,
            query_padding: None,
            attn_mask: Some(pattern.to_kind(Kind::Bool)),
            causal: false,
        },
        Case { name: "causal", key_padding: None, query_padding: None, attn_mask: None, causal: true },
    ]
}

/// Where the fused CPU kernel applies (no mask, or key padding with a key in every sequence) it
/// computes differently from the tiles (equal to 1e-10, not bit for bit); elsewhere `fused_cpu`
/// changes nothing. Either way round is an error naming the case.
fn check_fused_route(inputs: &[Tensor; 3], case: &Case, variant: &Tiled, options: TiledOptions) -> Result<()> {
    let route = |fused_cpu| {
        let opts = TiledOptions { fused_cpu, ..options };
        attend_tiled(&inputs[0], &inputs[1], &inputs[2], &case.masks(), variant, opts).map(|t| t.output)
    };
    let applies = matches!(case.name, "none" | "key padding, no empty sequence");
    ensure!(
        route(true)?.equal(&route(false)?) != applies,
        "{variant:?}, {}: the fused CPU kernel {}",
        case.name,
        if applies { "was not taken" } else { "was taken" }
    );
    Ok(())
}

#[test]
fn tiled_attention_equals_the_eager_path() -> Result<()> {
    tch::manual_seed(0);
    let opts = (Kind::Double, Device::Cpu);
    let inputs = qkv(opts);
    let g = Tensor::randn([B, H, L, D], opts);
    let vs = nn::VarStore::new(Device::Cpu);
    let hnas = Hnas::new(&vs.root(), H, 0.5)?;
    // Gates away from 0.5, one per head.
    tch::no_grad(|| hnas.logit().shallow_clone().copy_(&Tensor::from_slice(&[-1.0f64, 0.3, 2.0]).to_kind(Kind::Float)));
    let mut vs = vs;
    vs.double();
    let logit = hnas.logit().shallow_clone();
    let (sinkhorn2, sinkhorn3) = (Sinkhorn::new(2)?, Sinkhorn::new(3)?);
    let (mut checked, mut largest) = (0, 0.0f64);
    for case in cases() {
        let masks = case.masks();
        let variants: Vec<(&str, Tiled, &dyn Normalizer, Vec<Tensor>)> = vec![
            ("softmax", Tiled::softmax(), &Softmax, vec![]),
            ("dnas", Tiled::dnas(), &Dnas, vec![]),
            ("hnas", Tiled::hnas(&logit), &hnas, vec![logit.shallow_clone()]),
            ("sinkhorn-2", Tiled::sinkhorn(2), &sinkhorn2, vec![]),
            ("sinkhorn-3", Tiled::sinkhorn(3), &sinkhorn3, vec![]),
        ];
        for (name, tiled, eager, params) in variants {
            if case.causal && name != "softmax" {
                ensure!(
                    attend_tiled(&inputs[0], &inputs[1], &inputs[2], &masks, &tiled, TiledOptions::new(4)).is_err(),
                    "{name} ran under a causal mask"
                );
                continue;
            }
            let reference = outputs_and_grads(&inputs, &g, &params, |q, k, v| {
                let a = attend(q, k, v, &masks, eager, Default::default())?;
                let mass = a.weights()?.sum_dim_intlist(&[-2i64][..], false, Kind::Double);
                Ok((a.output, mass, None))
            })?;
            // The tiles at sizes that do and do not divide S, and the fused CPU kernel where it applies.
            for (tile, fused_cpu) in [(1, false), (4, false), (5, false), (L, false), (64, false), (4, true)] {
                let ours = outputs_and_grads(&inputs, &g, &params, |q, k, v| {
                    let t = attend_tiled(q, k, v, &masks, &tiled, TiledOptions { fused_cpu, ..TiledOptions::new(tile) })?;
                    Ok((t.output, t.received_mass, None))
                })?;
                let what = format!("{name}, {}, tile {tile}{}", case.name, if fused_cpu { ", fused CPU kernel" } else { "" });
                largest = largest.max(all_within_1e10(&what, Device::Cpu, &ours, &reference)?);
                checked += 1;
            }
        }
    }
    ensure!(checked == 5 * 5 * 6 + 6, "{checked} comparisons");
    eprintln!("{checked} comparisons, largest difference {largest:.1e}");
    // The fused CPU kernel is taken exactly where it applies.
    for case in cases().iter().filter(|c| !c.causal) {
        for variant in [Tiled::dnas(), Tiled::sinkhorn(3)] {
            check_fused_route(&inputs, case, &variant, TiledOptions::new(4))?;
        }
    }
    // The comparison can fail: tiled softmax is not eager DNAS.
    let softmax = attend_tiled(&inputs[0], &inputs[1], &inputs[2], &Masks::default(), &Tiled::softmax(), TiledOptions::new(4))?.output;
    let dnas = attend(&inputs[0], &inputs[1], &inputs[2], &Masks::default(), &Dnas, Default::default())?.output;
    ensure!(max_diff(&softmax, &dnas) > 1e-3, "softmax and DNAS agree to {}", max_diff(&softmax, &dnas));
    Ok(())
}

#[test]
fn bad_input_to_the_tiled_path_is_named() -> Result<()> {
    let opts = (Kind::Float, Device::Cpu);
    let (q, k) = (Tensor::randn([1, 2, 5, 4], opts), Tensor::randn([1, 2, 6, 4], opts));
    let m =
        attend_tiled(&q, &k, &k, &Masks::default(), &Tiled::dnas(), TiledOptions::new(0)).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("tile size must be at least 1"), "{m}");
    let m = attend_tiled(&q.view([2, 5, 4]), &k, &k, &Masks::default(), &Tiled::dnas(), TiledOptions::new(2))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(m.contains("rank 4"), "{m}");
    let fewer = k.narrow(1, 0, 1);
    let m = attend_tiled(&q, &fewer, &fewer, &Masks::default(), &Tiled::softmax(), TiledOptions::new(2))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(m.contains("unless grouped-query attention is enabled"), "{m}");
    let logit = Tensor::zeros([3], opts);
    let m = attend_tiled(&q, &k, &k, &Masks::default(), &Tiled::hnas(&logit), TiledOptions::new(2))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(m.contains("HNAS logits have shape [3]"), "{m}");
    Ok(())
}

#[test]
fn a_layer_with_tiles_equals_the_layer_without() -> Result<()> {
    // MultiHeadAttention takes the tiled path from its configuration (the normalizer's `tiled`
    // hook); same weights, same output and parameter gradients, float64, key padding.
    use probattn::{MhaConfig, MhaInput, MultiHeadAttention};
    let opts = (Kind::Double, Device::Cpu);
    let x = Tensor::randn([B, L, 16], opts);
    let pad = Tensor::arange(L, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&[10i64, 13]).unsqueeze(1));
    for variant in [Variant::Softmax, Variant::Dnas, Variant::Hnas, Variant::Sinkhorn(2)] {
        // Both layers get the weights of one store, copied: the tests of this file run on
        // parallel threads and share libtorch's generator, so reseeding it cannot promise
        // equal initialisations.
        let mut reference = nn::VarStore::new(Device::Cpu);
        MultiHeadAttention::new(&reference.root(), MhaConfig::new(16, 4).with_variant(variant))?;
        reference.double();
        let grads = |tile: Option<i64>| -> Result<(Tensor, Vec<(String, Tensor)>)> {
            let mut vs = nn::VarStore::new(Device::Cpu);
            let mut cfg = MhaConfig::new(16, 4).with_variant(variant);
            cfg.tile = tile;
            let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
            vs.double();
            vs.copy(&reference)?;
            let masks = Masks { key_padding: Some(&pad), ..Default::default() };
            let out = mha.forward_t(&MhaInput::self_attention(&x).with_masks(masks), true)?.context;
            (&out * &out).sum(Kind::Double).backward();
            let mut g: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.grad())).collect();
            g.sort_by(|a, b| a.0.cmp(&b.0));
            Ok((out.detach(), g))
        };
        let (eager, eager_grads) = grads(None)?;
        let (tiled, tiled_grads) = grads(Some(3))?;
        ensure!(max_diff(&eager, &tiled) <= 1e-10, "{variant:?}: output differs by {}", max_diff(&eager, &tiled));
        ensure!(eager_grads.len() == tiled_grads.len() && eager_grads.len() >= 4, "{variant:?}: parameters");
        for ((name, a), (_, b)) in eager_grads.iter().zip(&tiled_grads) {
            ensure!(max_diff(a, b) <= 1e-10, "{variant:?}: gradient of {name} differs by {}", max_diff(a, b));
        }
    }
    // BAM sampling over an HNAS base tiles too; what cannot be tiled is refused by name.
    let vs = nn::VarStore::new(Device::Cpu);
    let mut cfg = MhaConfig::new(16, 4).with_variant(Variant::Bam(BamKind::WeibullContextual)).with_tile(4);
    cfg.normalizer.bam.base = Variant::Hnas;
    let mha = MultiHeadAttention::new(&vs.root(), cfg)?;
    let x = x.to_kind(Kind::Float);
    ensure!(mha.forward_t(&MhaInput::self_attention(&x), true).is_ok(), "BAM sampling over HNAS on the tiles");
    ensure!(mha.forward_t(&MhaInput::self_attention(&x), false).is_ok(), "BAM over HNAS without sampling is HNAS, which tiles");
    let mut cfg = MhaConfig::new(16, 4).with_tile(4);
    cfg.dropout = 0.1;
    let mha = MultiHeadAttention::new(&vs.root().sub("d"), cfg)?;
    let m = mha.forward_t(&MhaInput::self_attention(&x), true).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("no attention dropout"), "{m}");
    Ok(())
}

/// A BAM normalizer of `kind` over `base` with settings away from the defaults (k = 5: the
/// Weibull noise matters), its parameters in float64.
fn bam(kind: BamKind, base: Variant) -> Result<(nn::VarStore, Bam)> {
    bam_on(kind, base, Device::Cpu)
}

fn bam_on(kind: BamKind, base: Variant, device: Device) -> Result<(nn::VarStore, Bam)> {
    let mut vs = nn::VarStore::new(device);
    let bam =
        BamConfig { k: 5.0, sigma: 0.7, prior_alpha: 0.8, prior_beta: 1.3, prior_mu: -0.5, prior_sigma: 1.2, base, ..Default::default() };
    let normalizer = Bam::new(&vs.root(), kind, H, D, &NormalizerConfig { bam, ..Default::default() })?;
    vs.double();
    Ok((vs, normalizer))
}

/// One BAM call of `sampled_bam_equals_the_eager_path_given_the_same_draws`: its inputs, the
/// cotangent `g`, the masks, the normalizer with its parameters, and the draws the eager path takes.
struct BamCall<'a> {
    inputs: &'a [Tensor; 3],
    g: &'a Tensor,
    masks: &'a Masks<'a>,
    normalizer: &'a probattn::normalize::Bam,
    params: &'a [Tensor],
    draws: &'a Tensor,
    kind: BamKind,
}

impl BamCall<'_> {
    /// `outputs_and_grads` of one path: the tiles with `tiled`'s options, else the eager path given
    /// the draws.
    fn run(&self, tiled: Option<TiledOptions>) -> Result<Vec<Tensor>> {
        outputs_and_grads(self.inputs, self.g, self.params, |q, k, v| {
            let (out, mass, kl) = match tiled {
                Some(options) => {
                    let t = attend_tiled(q, k, v, self.masks, &self.normalizer.tiled().expect("BAM has a plan"), options)?;
                    (t.output, t.received_mass, t.kl)
                }
                None => {
                    let opts = AttendOptions { mode: Mode::MONTE_CARLO, noise: Some(self.draws), ..Default::default() };
                    let a = attend(q, k, v, self.masks, self.normalizer, opts)?;
                    let mass = a.weights()?.sum_dim_intlist(&[-2i64][..], false, Kind::Double);
                    (a.output, mass, a.kl)
                }
            };
            ensure!(kl.is_some() == self.kind.has_kl(), "{}: KL present: {}", self.kind.name(), kl.is_some());
            Ok((out, mass, kl))
        })
    }
}

#[test]
fn sampled_bam_equals_the_eager_path_given_the_same_draws() -> Result<()> {
    // Loss = Σ output · G + 0.37 KL: output, received mass, KL, and the gradients of q, k, v and of
    // every parameter (the contextual prior's), eager given the counter-based draws of the seed
    // against tiled given the seed; once more tiled given the draws as a tensor.
    tch::manual_seed(7);
    let opts = (Kind::Double, Device::Cpu);
    let inputs = qkv(opts);
    let g = Tensor::randn([B, H, L, D], opts);
    let seed = 0x5eed_1234_abcd_u64;
    let (mut checked, mut largest) = (0, 0.0f64);
    for kind in BamKind::ALL {
        let draws = counter_noise(kind, [B, H, L, S], seed, opts)?;
        for base in [Variant::Softmax, Variant::Dnas, Variant::Sinkhorn(2), Variant::Hnas] {
            let (vs, normalizer) = bam(kind, base)?;
            let params: Vec<Tensor> = vs.trainable_variables();
            let expected = if kind.is_contextual() { 4 } else { 0 } + usize::from(base == Variant::Hnas); // HNAS's gate logits
            ensure!(params.len() == expected, "{} parameters", params.len());
            for case in cases() {
                let masks = case.masks();
                if case.causal && base != Variant::Softmax {
                    continue;
                }
                let call = BamCall { inputs: &inputs, g: &g, masks: &masks, normalizer: &normalizer, params: &params, draws: &draws, kind };
                let eager = call.run(None)?;
                let counter = TiledOptions { sample: true, seed: Some(seed), ..TiledOptions::new(4) };
                let given = TiledOptions { sample: true, noise: Some(&draws), ..TiledOptions::new(5) };
                let whole = TiledOptions { sample: true, seed: Some(seed), ..TiledOptions::new(L) };
                // Over a softmax base with a key mask, the three above take the fused CPU kernel; this one keeps the tiles.
                let tiles = TiledOptions { sample: true, seed: Some(seed), fused_cpu: false, ..TiledOptions::new(4) };
                let runs =
                    [("counter, tile 4", counter), ("given draws, tile 5", given), ("counter, tile 13", whole), ("tiles only", tiles)];
                for (how, options) in runs {
                    let ours = call.run(Some(options))?;
                    let what = format!("{} over {base}, {}, {how}", kind.name(), case.name);
                    largest = largest.max(all_within_1e10(&what, Device::Cpu, &ours, &eager)?);
                    checked += 1;
                }
            }
        }
    }
    ensure!(checked == 5 * (4 * 5 + 1) * 4, "{checked} comparisons");
    eprintln!("{checked} BAM comparisons, largest difference {largest:.1e}");
    // Sampling over a softmax base takes the fused CPU kernel exactly where the mask allows it.
    let (_, normalizer) = bam(BamKind::WeibullContextual, Variant::Softmax)?;
    for case in cases() {
        let options = TiledOptions { sample: true, seed: Some(seed), ..TiledOptions::new(4) };
        check_fused_route(&inputs, &case, &normalizer.tiled().expect("BAM has a plan"), options)?;
    }
    Ok(())
}

/// The draws matter: another seed gives another output, and the mean (no sampling) is the base.
#[test]
fn bam_draws_follow_the_seed_and_its_mean_is_the_base() -> Result<()> {
    tch::manual_seed(7);
    let opts = (Kind::Double, Device::Cpu);
    let inputs = qkv(opts);
    let (_, normalizer) = bam(BamKind::LognormalContextual, Variant::Dnas)?;
    let run = |options: TiledOptions| {
        attend_tiled(&inputs[0], &inputs[1], &inputs[2], &Masks::default(), &normalizer.tiled().expect("BAM has a plan"), options)
    };
    let a = run(TiledOptions { seed: Some(1), sample: true, ..TiledOptions::new(4) })?.output;
    let b = run(TiledOptions { seed: Some(2), sample: true, ..TiledOptions::new(4) })?.output;
    ensure!(max_diff(&a, &b) > 1e-3, "two seeds agree to {}", max_diff(&a, &b));
    let mean = run(TiledOptions::new(4))?;
    let dnas = attend(&inputs[0], &inputs[1], &inputs[2], &Masks::default(), &Dnas, Default::default())?.output;
    ensure!(max_diff(&mean.output, &dnas) <= 1e-12 && mean.kl.is_none(), "without sampling BAM is its base");
    Ok(())
}

/// The eager path of one variant, given q, k and v.
/// Output, received mass, KL (0 without one) and the gradients of Σ output · G + 0.37 KL in q, k, v
/// and `params`, from the path `run`.
fn outputs_and_grads(
    inputs: &[Tensor; 3],
    g: &Tensor,
    params: &[Tensor],
    run: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor, Option<Tensor>)>,
) -> Result<Vec<Tensor>> {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.detach().set_requires_grad(true)).collect();
    let (out, mass, kl) = run(&leaves[0], &leaves[1], &leaves[2])?;
    let kl = kl.unwrap_or_else(|| Tensor::zeros([], (Kind::Double, g.device())));
    let wrt: Vec<Tensor> = leaves.iter().chain(params).map(Tensor::shallow_clone).collect();
    let loss = (&out * g).sum(Kind::Double) + &kl * 0.37;
    let mut all = vec![out.detach(), mass.detach(), kl.detach()];
    all.extend(Tensor::run_backward(&[loss], &wrt, false, false));
    Ok(all)
}

/// The largest difference between `outputs_and_grads` of a path and of its reference, each held
/// to 1e-10 and to `device`.
fn all_within_1e10(what: &str, device: Device, ours: &[Tensor], reference: &[Tensor]) -> Result<f64> {
    ensure!(ours.len() == reference.len(), "{what}: gradients");
    let mut largest = 0.0f64;
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        ensure!(a.device() == device, "{what}: left {device:?}");
        let d = max_diff(a, b);
        let name = ["output", "received mass", "KL", "gradient of q", "gradient of k", "gradient of v"]
            .get(i)
            .copied()
            .unwrap_or("gradient of a parameter");
        ensure!(d <= 1e-10, "{what}: {name} differs by {d}");
        largest = largest.max(d);
    }
    Ok(largest)
}

type Eager<'a> = Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> probattn::Result<probattn::Attended> + 'a>;

#[test]
fn on_every_device_the_tiles_equal_the_eager_path() -> Result<()> {
    // The comparisons above once more on each device (CUDA where present: the tiles' ATen route,
    // not the fused CPU kernel), in float64 within 1e-10: every deterministic variant and every BAM
    // variant over a DNAS base given the same counter-based draws, under every mask layout, at a
    // tile that does not divide S_q. Output, received mass, KL and the gradients of q, k, v and
    // of the variant's parameters.
    for device in common::devices() {
        tch::manual_seed(3);
        let opts = (Kind::Double, device);
        let inputs = qkv(opts);
        let g = Tensor::randn([B, H, L, D], opts);
        let mut vs = nn::VarStore::new(device);
        let hnas = Hnas::new(&vs.root(), H, 0.5)?;
        vs.double();
        tch::no_grad(|| hnas.logit().shallow_clone().copy_(&Tensor::from_slice(&[-1.0f64, 0.3, 2.0]).to_device(device)));
        let logit = hnas.logit().shallow_clone();
        let sinkhorn = Sinkhorn::new(3)?;
        let seed = 0x5eed_0042_u64;
        let bams = BamKind::ALL
            .into_iter()
            .map(|kind| {
                let (vs, normalizer) = bam_on(kind, Variant::Dnas, device)?;
                Ok((kind, vs, normalizer, counter_noise(kind, [B, H, L, S], seed, opts)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let (mut checked, mut largest) = (0, 0.0f64);
        for case in cases().iter().map(|c| c.to(device)) {
            let masks = case.masks();
            let mut variants: Vec<(String, Tiled, Eager<'_>, Vec<Tensor>)> = vec![
                ("softmax".into(), Tiled::softmax(), Box::new(|q, k, v| attend(q, k, v, &masks, &Softmax, Default::default())), vec![]),
                ("dnas".into(), Tiled::dnas(), Box::new(|q, k, v| attend(q, k, v, &masks, &Dnas, Default::default())), vec![]),
                (
                    "hnas".into(),
                    Tiled::hnas(&logit),
                    Box::new(|q, k, v| attend(q, k, v, &masks, &hnas, Default::default())),
                    vec![logit.shallow_clone()],
                ),
                (
                    "sinkhorn-3".into(),
                    Tiled::sinkhorn(3),
                    Box::new(|q, k, v| attend(q, k, v, &masks, &sinkhorn, Default::default())),
                    vec![],
                ),
            ];
            for (kind, vs, normalizer, draws) in &bams {
                let options = AttendOptions { mode: Mode::MONTE_CARLO, noise: Some(draws), ..Default::default() };
                let masks = &masks;
                variants.push((
                    kind.name().to_string(),
                    normalizer.tiled().expect("BAM has a plan"),
                    Box::new(move |q, k, v| attend(q, k, v, masks, normalizer, options)),
                    vs.trainable_variables(),
                ));
            }
            for (name, tiled, eager, params) in &variants {
                if case.causal && name != "softmax" {
                    continue;
                }
                let ours = outputs_and_grads(&inputs, &g, params, |q, k, v| {
                    let options = TiledOptions { sample: true, seed: Some(seed), ..TiledOptions::new(5) };
                    let t = attend_tiled(q, k, v, &masks, tiled, options)?;
                    Ok((t.output, t.received_mass, t.kl))
                })?;
                let reference = outputs_and_grads(&inputs, &g, params, |q, k, v| {
                    let a = eager(q, k, v)?;
                    let mass = a.weights()?.sum_dim_intlist(&[-2i64][..], false, Kind::Double);
                    Ok((a.output, mass, a.kl))
                })?;
                largest = largest.max(all_within_1e10(&format!("{device:?}, {name}, {}", case.name), device, &ours, &reference)?);
                checked += 1;
            }
        }
        ensure!(checked == (4 + 5) * 5 + 1, "{device:?}: {checked} comparisons");
        eprintln!("{device:?}: {checked} comparisons, largest difference {largest:.1e}");
    }
    Ok(())
}

#[test]
fn counter_based_draws_have_their_distributions() -> Result<()> {
    // 2 × 4 × 500 × 500 draws: moments, range, and independence of neighbours and of seeds.
    let shape = [2, 4, 500, 500];
    for options in [(Kind::Double, Device::Cpu), (Kind::Float, Device::Cpu)] {
        let u = counter_noise(BamKind::WeibullFixed, shape, 3, options)?.to_kind(Kind::Double);
        let (mean, var) = (u.mean(Kind::Double).double_value(&[]), u.var(false).double_value(&[]));
        ensure!((mean - 0.5).abs() < 2e-3 && (var - 1.0 / 12.0).abs() < 1e-3, "uniform: mean {mean}, variance {var}");
        ensure!(u.min().double_value(&[]) > 0.0 && u.max().double_value(&[]) < 1.0, "uniform outside (0, 1)");
        // Their form, (2m + 1) / 2^bits with m below 2^(bits - 1): every value, the largest
        // included, is exact in the dtype and below 1 (float32 once drew 1 - 2^-25, which rounds
        // to 1.0, and the Weibull transform of 1 is infinite).
        let bits = if options.0 == Kind::Float { 24 } else { 33 };
        let scaled = &u * 2f64.powi(bits);
        ensure!(scaled.eq_tensor(&scaled.round()).all().int64_value(&[]) == 1, "draws not on the (2m + 1) / 2^{bits} grid");
        ensure!(scaled.remainder(2.0).eq(1.0).all().int64_value(&[]) == 1, "draws not odd multiples of 2^-{bits}");
        let e = -(-&u).log1p(); // Exp(1)
        ensure!((e.mean(Kind::Double).double_value(&[]) - 1.0).abs() < 5e-3, "Exp(1) mean {}", e.mean(Kind::Double).double_value(&[]));
        let n = counter_noise(BamKind::LognormalFixed, shape, 3, options)?.to_kind(Kind::Double);
        let (mean, var) = (n.mean(Kind::Double).double_value(&[]), n.var(false).double_value(&[]));
        let kurtosis = n.pow_tensor_scalar(4).mean(Kind::Double).double_value(&[]);
        ensure!(mean.abs() < 3e-3 && (var - 1.0).abs() < 5e-3 && (kurtosis - 3.0).abs() < 0.05, "normal: {mean} {var} {kurtosis}");
        // Neighbours along keys and queries, and two seeds, are uncorrelated.
        let corr = |a: &Tensor, b: &Tensor| (a * b).mean(Kind::Double).double_value(&[]);
        ensure!(corr(&n.narrow(3, 0, 499), &n.narrow(3, 1, 499)).abs() < 5e-3, "keys correlated");
        ensure!(corr(&n.narrow(2, 0, 499), &n.narrow(2, 1, 499)).abs() < 5e-3, "queries correlated");
        let other = counter_noise(BamKind::LognormalFixed, shape, 4, options)?.to_kind(Kind::Double);
        ensure!(corr(&n, &other).abs() < 5e-3, "seeds correlated");
        ensure!(n.equal(&counter_noise(BamKind::LognormalFixed, shape, 3, options)?.to_kind(Kind::Double)), "not reproducible");
    }
    // The CPU's loop and the ATen integer ops (CUDA's way) give the same draws, bit for bit, also
    // past position 2^32 (the counter's high word): the last rows of a (2, 4, 2^20, 2^12) tensor.
    // The ops take a shortcut where every position is below 2^32: at that boundary (2^32 entries),
    // and one row past it, whose rows straddle position 2^32. The loop takes 8 float32 draws at a
    // time on a CPU with AVX2: a row of 4,103 keys that reaches position 2^32 at key 235 (8 × 29 + 3).
    let cases = [
        ([2, 3, 70, 90], 0..70),
        ([2, 3, 70, 90], 13..40),
        ([2, 4, 1 << 20, 1 << 12], (1 << 20) - 3..1 << 20),
        ([1, 1, 1 << 16, 1 << 16], (1 << 16) - 2..1 << 16),
        ([1, 1, (1 << 16) + 1, 1 << 16], (1 << 16) - 1..(1 << 16) + 1),
        ([1, 1, 1 << 20, 4103], 1_046_787..1_046_789),
    ];
    for (shape, rows) in cases {
        for kind in [Kind::Double, Kind::Float] {
            for bam in [BamKind::WeibullContextual, BamKind::LognormalFixed] {
                let options = (kind, Device::Cpu);
                let fast = counter_noise_rows(bam, shape, 11, options, rows.clone(), false)?;
                let ops = counter_noise_rows(bam, shape, 11, options, rows.clone(), true)?;
                ensure!(fast.size() == [shape[0], shape[1], rows.end - rows.start, shape[3]], "rows {rows:?}: {:?}", fast.size());
                ensure!(fast.equal(&ops), "{bam:?} {shape:?} {rows:?} {kind:?}: the loop and the ops differ");
                // On a GPU the same ops run there, and Lognormal's float32 ε comes from the
                // device's table of every draw's value: the CPU loop's bits. Lognormal's float64
                // ε is the device's own erfinv, whose last bits need not be the CPU's.
                for device in common::devices().into_iter().filter(|d| d.is_cuda()) {
                    let there = counter_noise_rows(bam, shape, 11, (kind, device), rows.clone(), false)?.to_device(Device::Cpu);
                    if kind == Kind::Double && bam == BamKind::LognormalFixed {
                        let off = f64::try_from((&there - &fast).abs().max())?;
                        ensure!(off < 1e-13, "{bam:?} {shape:?} {rows:?} on {device:?}: {off:e} from the CPU's draws");
                    } else {
                        ensure!(there.equal(&fast), "{bam:?} {shape:?} {rows:?} {kind:?}: {device:?} and the CPU draw differently");
                    }
                }
            }
        }
        if rows.start == 0 {
            let whole = counter_noise(BamKind::WeibullFixed, shape, 11, (Kind::Double, Device::Cpu))?;
            let part = counter_noise_rows(BamKind::WeibullFixed, shape, 11, (Kind::Double, Device::Cpu), 5..9, false)?;
            ensure!(whole.narrow(2, 5, 4).equal(&part), "rows drawn alone differ from the same rows of the whole");
        }
    }
    Ok(())
}

#[test]
fn the_fused_cpu_lognormal_kl_holds_in_float32_where_the_scores_sit_far_from_0() -> Result<()> {
    // Scores of about 100: the fused CPU route forms the Lognormal KL part from sums over the
    // sequence about the keys' means, whose float32 rounding grows with the scores as the tiles'
    // does. Expanded about 0, as they were (when the route left scores past 64 to the tiles), they
    // took this KL 9.2e-6 from float64's. Against the same call in float64: the KL and its
    // gradients in q and k, the fused route's and the tiles' alike.
    tch::manual_seed(5);
    let opts = (Kind::Double, Device::Cpu);
    let [q, k, v] = qkv(opts);
    let (q, k) = (q * 0.3 + 6.0, k * 0.15 + 6.0);
    let z = q.matmul(&k.transpose(-2, -1)) / (D as f64).sqrt();
    let (low, high) = (z.min().double_value(&[]), z.max().double_value(&[]));
    ensure!(low > 80.0 && high < 140.0, "scores from {low} to {high}");
    let (_vs, normalizer) = bam(BamKind::LognormalFixed, Variant::Softmax)?;
    let plan = normalizer.tiled().expect("BAM has a plan");
    // (output, KL, ∂KL/∂q, ∂KL/∂k) in float64
    let run = |kind: Kind, fused_cpu: bool| -> Result<[Tensor; 4]> {
        let leaf = |t: &Tensor| t.detach().to_kind(kind).requires_grad_(true);
        let (q, k, v) = (leaf(&q), leaf(&k), v.to_kind(kind));
        let options = TiledOptions { sample: true, seed: Some(0x5eed_0077), fused_cpu, ..TiledOptions::new(4) };
        let t = attend_tiled(&q, &k, &v, &Masks::default(), &plan, options)?;
        let kl = t.kl.ok_or_else(|| anyhow::anyhow!("no KL term"))?;
        kl.backward();
        Ok([t.output, kl, q.grad(), k.grad()].map(|x| x.detach().to_kind(Kind::Double)))
    };
    let exact = run(Kind::Double, true)?;
    let fused = run(Kind::Float, true)?;
    let tiles = run(Kind::Float, false)?;
    ensure!(!fused[0].equal(&tiles[0]), "the fused CPU route was not taken in float32");
    let rel = |a: &Tensor, b: &Tensor| max_diff(a, b) / b.abs().max().double_value(&[]);
    // (measured: KL 2.2e-7, 6.0e-6 and 3.1e-6 in the gradients; the tiles 4.1e-7, 4.0e-5, 2.2e-6)
    for (i, name, bound) in [(1, "KL", 2e-6), (2, "dKL/dq", 5e-5), (3, "dKL/dk", 5e-5)] {
        let (f, t) = (rel(&fused[i], &exact[i]), rel(&tiles[i], &exact[i]));
        eprintln!("{name}: fused route {f:.1e}, tiles {t:.1e} of float64's");
        ensure!(f <= bound, "{name}: the fused route differs from float64's by {f:e} (the tiles by {t:e})");
    }
    Ok(())
}
