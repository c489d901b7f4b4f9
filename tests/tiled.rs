//! `probattn::tiled`: the memory-efficient path equals the eager path (`probattn::attend`) in
//! float64 within 1e-10 (the tolerance; the differences seen are float rounding, ~1e-15):
//! output, received mass, and the gradients of `sum(output · G)` with respect to q, k, v and
//! HNAS's gate logits, for softmax, DNAS and HNAS, under every mask layout (none, key padding
//! with a fully padded sequence, query padding, a boolean (B, H, S_q, S_k) pattern with fully
//! excluded rows and columns, causal for softmax), at tile sizes that do and do not divide S_q.

use anyhow::{ensure, Result};
use probattn::normalize::{Dnas, Hnas, Normalizer, Softmax};
use probattn::tiled::{attend_tiled, Tiled};
use probattn::{attend, Masks};
use tch::{nn, Device, Kind, Tensor};

const B: i64 = 2;
const H: i64 = 3;
const L: i64 = 13;
const S: i64 = 11;
const D: i64 = 8;

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
    fn masks(&self) -> Masks<'_> {
        Masks { key_padding: self.key_padding.as_ref(), query_padding: self.query_padding.as_ref(), attn_mask: self.attn_mask.as_ref(), causal: self.causal }
    }
}

fn cases() -> Vec<Case> {
    // Sequence 1 has every key padded: its rows are all zero in both paths.
    let key_padding = Tensor::arange(S, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&[7i64, 0]).unsqueeze(1));
    let query_padding = Tensor::arange(L, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&[9i64, 12]).unsqueeze(1));
    let pattern = Tensor::rand([B, H, L, S], (Kind::Double, Device::Cpu)).lt(0.3);
    let _ = pattern.narrow(2, 4, 1).fill_(1); // a fully excluded row in every head
    let _ = pattern.narrow(3, 2, 1).fill_(1); // a fully excluded column
    vec![
        Case { name: "none", key_padding: None, query_padding: None, attn_mask: None, causal: false },
        Case { name: "key padding", key_padding: Some(key_padding.shallow_clone()), query_padding: None, attn_mask: None, causal: false },
        Case { name: "key and query padding", key_padding: Some(key_padding), query_padding: Some(query_padding), attn_mask: None, causal: false },
        Case { name: "boolean pattern", key_padding: None, query_padding: None, attn_mask: Some(pattern.to_kind(Kind::Bool)), causal: false },
        Case { name: "causal", key_padding: None, query_padding: None, attn_mask: None, causal: true },
    ]
}

/// Output, received mass and gradients (q, k, v, then the extra parameters) of one path.
fn run(path: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>, inputs: &[Tensor; 3], params: &[Tensor], g: &Tensor) -> Result<(Tensor, Tensor, Vec<Tensor>)> {
    let leaves: Vec<Tensor> = inputs.iter().map(|t| t.detach().set_requires_grad(true)).collect();
    let (out, mass) = path(&leaves[0], &leaves[1], &leaves[2])?;
    let wrt: Vec<Tensor> = leaves.iter().chain(params).map(Tensor::shallow_clone).collect();
    let grads = Tensor::run_backward(&[(&out * g).sum(Kind::Double)], &wrt, false, false);
    Ok((out.detach(), mass.detach(), grads))
}

#[test]
fn tiled_attention_equals_the_eager_path() -> Result<()> {
    tch::manual_seed(0);
    let opts = (Kind::Double, Device::Cpu);
    let inputs = [Tensor::randn([B, H, L, D], opts), Tensor::randn([B, H, S, D], opts) * 2.0, Tensor::randn([B, H, S, D], opts)];
    let g = Tensor::randn([B, H, L, D], opts);
    let vs = nn::VarStore::new(Device::Cpu);
    let hnas = Hnas::new(&vs.root(), H, 0.5)?;
    // Gates away from 0.5, one per head.
    tch::no_grad(|| hnas.logit().shallow_clone().copy_(&Tensor::from_slice(&[-1.0f64, 0.3, 2.0]).to_kind(Kind::Float)));
    let mut vs = vs;
    vs.double();
    let logit = hnas.logit().shallow_clone();
    let (mut checked, mut largest) = (0, 0.0f64);
    for case in cases() {
        let masks = case.masks();
        let variants: Vec<(&str, Tiled, &dyn Normalizer, Vec<Tensor>)> = vec![
            ("softmax", Tiled::Softmax, &Softmax, vec![]),
            ("dnas", Tiled::Dnas, &Dnas, vec![]),
            ("hnas", Tiled::Hnas { logit: &logit }, &hnas, vec![logit.shallow_clone()]),
        ];
        for (name, tiled, eager, params) in variants {
            if case.causal && name != "softmax" {
                ensure!(attend_tiled(&inputs[0], &inputs[1], &inputs[2], &masks, tiled, 4).is_err(), "{name} ran under a causal mask");
                continue;
            }
            let reference = run(
                |q, k, v| {
                    let a = attend(q, k, v, &masks, eager, Default::default())?;
                    Ok((a.output, a.weights.sum_dim_intlist(&[-2i64][..], false, Kind::Double)))
                },
                &inputs,
                &params,
                &g,
            )?;
            for tile in [1, 4, 5, L, 64] {
                let ours = run(
                    |q, k, v| {
                        let t = attend_tiled(q, k, v, &masks, tiled, tile)?;
                        Ok((t.output, t.received_mass))
                    },
                    &inputs,
                    &params,
                    &g,
                )?;
                let what = format!("{name}, {}, tile {tile}", case.name);
                largest = [max_diff(&ours.0, &reference.0), max_diff(&ours.1, &reference.1)]
                    .into_iter()
                    .chain(ours.2.iter().zip(&reference.2).map(|(a, b)| max_diff(a, b)))
                    .fold(largest, f64::max);
                ensure!(max_diff(&ours.0, &reference.0) <= 1e-10, "{what}: output differs by {}", max_diff(&ours.0, &reference.0));
                ensure!(max_diff(&ours.1, &reference.1) <= 1e-10, "{what}: received mass differs by {}", max_diff(&ours.1, &reference.1));
                for (i, (a, b)) in ours.2.iter().zip(&reference.2).enumerate() {
                    let d = max_diff(a, b);
                    ensure!(d <= 1e-10, "{what}: gradient {} differs by {d}", ["q", "k", "v", "hybrid_logit"][i]);
                }
                checked += 1;
            }
        }
    }
    ensure!(checked == 4 * 3 * 5 + 5, "{checked} comparisons");
    eprintln!("{checked} comparisons, largest difference {largest:.1e}");
    // The comparison can fail: tiled softmax is not eager DNAS.
    let softmax = attend_tiled(&inputs[0], &inputs[1], &inputs[2], &Masks::default(), Tiled::Softmax, 4)?.output;
    let dnas = attend(&inputs[0], &inputs[1], &inputs[2], &Masks::default(), &Dnas, Default::default())?.output;
    ensure!(max_diff(&softmax, &dnas) > 1e-3, "softmax and DNAS agree to {}", max_diff(&softmax, &dnas));
    Ok(())
}

#[test]
fn bad_input_to_the_tiled_path_is_named() -> Result<()> {
    let opts = (Kind::Float, Device::Cpu);
    let (q, k) = (Tensor::randn([1, 2, 5, 4], opts), Tensor::randn([1, 2, 6, 4], opts));
    let m = attend_tiled(&q, &k, &k, &Masks::default(), Tiled::Dnas, 0).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("tile size must be at least 1"), "{m}");
    let m = attend_tiled(&q.view([2, 5, 4]), &k, &k, &Masks::default(), Tiled::Dnas, 2).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("rank 4"), "{m}");
    let half = q.to_kind(Kind::Half);
    let m = attend_tiled(&half, &k.to_kind(Kind::Half), &k.to_kind(Kind::Half), &Masks::default(), Tiled::Softmax, 2).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("float32 and float64"), "{m}");
    let logit = Tensor::zeros([3], opts);
    let m = attend_tiled(&q, &k, &k, &Masks::default(), Tiled::Hnas { logit: &logit }, 2).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("HNAS logits have shape [3]"), "{m}");
    Ok(())
}

#[test]
fn a_layer_with_tiles_equals_the_layer_without() -> Result<()> {
    // MultiHeadAttention takes the tiled path from its configuration (the normalizer's `tiled`
    // hook); same weights, same output and parameter gradients, float64, key padding.
    use probattn::{MhaConfig, MhaInput, MultiHeadAttention, Variant};
    let opts = (Kind::Double, Device::Cpu);
    let x = Tensor::randn([B, L, 16], opts);
    let pad = Tensor::arange(L, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&[10i64, 13]).unsqueeze(1));
    for variant in [Variant::Softmax, Variant::Dnas, Variant::Hnas] {
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
    // What has no tiled form, or cannot be tiled, is refused by name.
    let vs = nn::VarStore::new(Device::Cpu);
    let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(16, 4).with_variant(Variant::Sinkhorn(3)).with_tile(4))?;
    let x = x.to_kind(Kind::Float);
    let m = mha.forward_t(&MhaInput::self_attention(&x), false).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("no memory-efficient path yet"), "{m}");
    let mut cfg = MhaConfig::new(16, 4).with_tile(4);
    cfg.dropout = 0.1;
    let mha = MultiHeadAttention::new(&vs.root().sub("d"), cfg)?;
    let m = mha.forward_t(&MhaInput::self_attention(&x), true).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(m.contains("no attention dropout"), "{m}");
    Ok(())
}
