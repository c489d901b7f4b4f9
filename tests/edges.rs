//! The edge-list support (GAT's neighbourhoods, O(E) memory) against the dense support with the
//! adjacency as mask, which tests/parity.rs checks against PyTorch: every variant, BAM with the
//! same noise, the KL, the contextual prior, and gradients, in float64.

mod common;

use anyhow::Result;
use common::devices;
use probattn::normalize::{BamConfig, EdgeList, NormalizeInput, Support};
use probattn::{NormalizerConfig, Variant};
use tch::{nn, Device, Kind, Tensor};

/// A random directed graph on `n` nodes with self-loops, except the last node, which has no edge
/// at all (nothing to attend, and nobody attends it).
fn random_graph(n: i64, device: Device) -> (Tensor, Tensor) {
    let adjacency = Tensor::rand([n, n], (Kind::Float, device)).lt(0.3).logical_or(&Tensor::eye(n, (Kind::Bool, device)));
    let _ = adjacency.get(n - 1).fill_(0);
    let _ = adjacency.select(1, n - 1).fill_(0);
    let nz = adjacency.nonzero(); // (E, 2): (dst, src)
    (nz.select(1, 0).contiguous(), nz.select(1, 1).contiguous())
}

/// A copy of `t`'s gradient, or zeros where nothing reached it.
fn grad_or_zero(t: &Tensor) -> Tensor {
    let g = t.grad();
    if g.defined() {
        g.copy()
    } else {
        t.zeros_like()
    }
}

#[test]
fn every_variant_over_edges_equals_its_dense_form() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(21);
    for device in devices() {
        let (n, heads, d) = (9, 3, 5);
        let (dst, src) = random_graph(n, device);
        let e = dst.size()[0];
        let edge_support = Support::Edges(EdgeList::new(dst.shallow_clone(), src.shallow_clone(), n, n)?);
        let allowed = Tensor::zeros([n, n], (Kind::Bool, device)).index_put(&[Some(&dst), Some(&src)], &Tensor::ones([e], (Kind::Bool, device)), false);
        let dense_support = Support::dense(Some(allowed.view([1, 1, n, n])));
        let scatter = |edge_values: &Tensor| {
            // (H, E) -> (1, H, N, N), zero off the edges.
            Tensor::zeros([heads, n, n], (Kind::Double, device)).index_put(&[None, Some(&dst), Some(&src)], edge_values, false).unsqueeze(0)
        };
        let gather = |dense: &Tensor| dense.squeeze_dim(0).index(&[None, Some(&dst), Some(&src)]); // (H, E)

        let names = ["softmax", "dnas", "hnas", "sinkhorn-3", "bam-nokl", "bam-lf", "bam-lc", "bam-wf", "bam-wc"];
        for name in names {
            for sample in [false, true] {
                let mut vs = nn::VarStore::new(device);
                let cfg = NormalizerConfig { bam: BamConfig { k: 3.0, sigma: 0.5, ..Default::default() }, ..Default::default() };
                let normalizer = name.parse::<Variant>()?.build(&vs.root(), heads, d, &cfg)?;
                vs.double();
                let z = (Tensor::randn([heads, e], (Kind::Double, device)) * 3.0).set_requires_grad(true);
                let keys = Tensor::randn([1, heads, n, d], (Kind::Double, device)).set_requires_grad(true);
                let noise = if name.starts_with("bam-l") { Tensor::randn([heads, e], (Kind::Double, device)) } else { Tensor::rand([heads, e], (Kind::Double, device)) };
                let cot = Tensor::randn([heads, e], (Kind::Double, device));

                let run = |support: &Support, scores: &Tensor, noise: &Tensor, to_edges: &dyn Fn(&Tensor) -> Tensor| -> Result<(Tensor, Option<f64>, Vec<Tensor>)> {
                    for v in vs.variables().values() {
                        let _ = v.grad().defined().then(|| v.grad().zero_());
                    }
                    let _ = z.grad().defined().then(|| z.grad().zero_());
                    let _ = keys.grad().defined().then(|| keys.grad().zero_());
                    let input = NormalizeInput { scores, support, keys: Some(&keys), noise: Some(noise), sample };
                    let out = normalizer.normalize(&input)?;
                    let w = to_edges(&out.weights);
                    let mut loss = (&w * &cot).sum(Kind::Double);
                    let kl = out.kl.as_ref().map(|k| f64::try_from(k).unwrap_or(f64::NAN));
                    if let Some(k) = &out.kl {
                        loss += k * 0.7;
                    }
                    loss.backward();
                    let mut params: Vec<_> = vs.variables().into_iter().collect();
                    params.sort_by(|a, b| a.0.cmp(&b.0));
                    let mut grads = vec![grad_or_zero(&z), grad_or_zero(&keys)];
                    grads.extend(params.iter().map(|(_, p)| grad_or_zero(p)));
                    Ok((w.detach(), kl, grads))
                };
                let (w_edges, kl_edges, g_edges) = run(&edge_support, &z, &noise, &|w| w.shallow_clone())?;
                let (w_dense, kl_dense, g_dense) = run(&dense_support, &scatter(&z), &scatter(&noise), &gather)?;
                let err = f64::try_from((&w_edges - &w_dense).abs().max())?;
                assert!(err < 1e-12, "{name} sample={sample}: weights differ by {err}");
                match (kl_edges, kl_dense) {
                    (Some(a), Some(b)) => assert!((a - b).abs() < 1e-12 * b.abs().max(1.0), "{name}: KL {a} vs {b}"),
                    (None, None) => {}
                    other => panic!("{name}: KL presence differs {other:?}"),
                }
                for (i, (a, b)) in g_edges.iter().zip(&g_dense).enumerate() {
                    let err = f64::try_from((a - b).abs().max())?;
                    assert!(err < 1e-11, "{name} sample={sample}: gradient {i} differs by {err}");
                }
                // Each row with edges sums to one.
                let rows = Tensor::zeros([heads, n], (Kind::Double, device)).index_add(1, &dst, &w_edges);
                let has_edge = Tensor::zeros([n], (Kind::Double, device)).index_fill(0, &dst, 1.0);
                assert!(f64::try_from((rows - has_edge).abs().max())? < 1e-12, "{name}: rows do not sum to 1");
            }
        }
    }
    Ok(())
}

#[test]
fn bad_edge_lists_are_refused() {
    let _serial = common::serial();
    let i = |v: &[i64]| Tensor::from_slice(v);
    assert!(EdgeList::new(i(&[0, 1]), i(&[0]), 2, 2).is_err());
    let err = EdgeList::new(i(&[0, 5]), i(&[0, 1]), 3, 3).unwrap_err().to_string();
    assert!(err.contains("dst indices span 0..=5, outside 0..3"), "{err}");
    assert!(EdgeList::new(i(&[0]).to_kind(Kind::Int), i(&[0]), 1, 1).is_err());
}
