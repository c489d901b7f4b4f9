//! The edge-list support (GAT's neighbourhoods, O(E) memory) against the dense support with the
//! adjacency as mask, which tests/parity.rs checks against PyTorch: every variant, BAM with the
//! same noise, the KL, the contextual prior, and gradients, in float64.

mod common;

use anyhow::{ensure, Context, Result};
use common::devices;
use probattn::normalize::{
    lognormal_kl, lognormal_log_sample, weibull_gamma_kl, weibull_log_sample, BamConfig, EdgeList, NormalizeInput, PriorScope, Support,
};
use probattn::{attend, AttendOptions, Masks, NormalizerConfig, Variant};
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

/// A random graph (`random_graph`) for `heads` heads, and the conversions between per-edge values
/// `(H, E)` and dense ones `(1, H, N, N)` with the adjacency as mask.
struct Graph {
    n: i64,
    heads: i64,
    dst: Tensor,
    src: Tensor,
    device: Device,
}

impl Graph {
    fn new(n: i64, heads: i64, device: Device) -> Self {
        let (dst, src) = random_graph(n, device);
        Graph { n, heads, dst, src, device }
    }

    fn edges(&self) -> i64 {
        self.dst.size()[0]
    }

    fn support(&self) -> Result<Support> {
        Ok(Support::Edges(EdgeList::new(self.dst.shallow_clone(), self.src.shallow_clone(), self.n, self.n)?))
    }

    /// The adjacency, `(N, N)`, true on the edges.
    fn allowed(&self) -> Tensor {
        let ones = Tensor::ones([self.edges()], (Kind::Bool, self.device));
        Tensor::zeros([self.n, self.n], (Kind::Bool, self.device)).index_put(&[Some(&self.dst), Some(&self.src)], &ones, false)
    }

    /// `(H, E)` -> `(1, H, N, N)`, zero off the edges.
    fn scatter(&self, edge_values: &Tensor) -> Tensor {
        let dense = Tensor::zeros([self.heads, self.n, self.n], (Kind::Double, self.device));
        dense.index_put(&[None, Some(&self.dst), Some(&self.src)], edge_values, false).unsqueeze(0)
    }

    /// `(1, H, N, N)` -> `(H, E)`.
    fn gather(&self, dense: &Tensor) -> Tensor {
        dense.squeeze_dim(0).index(&[None, Some(&self.dst), Some(&self.src)])
    }
}

#[test]
fn every_variant_over_edges_equals_its_dense_form() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(21);
    for device in devices() {
        let (n, heads, d) = (9, 3, 5);
        let graph = Graph::new(n, heads, device);
        let (e, dst) = (graph.edges(), &graph.dst);
        let edge_support = graph.support()?;
        let dense_support = Support::dense(Some(graph.allowed().view([1, 1, n, n])));

        let names = ["softmax", "dnas", "hnas", "sinkhorn-3", "bam-nokl", "bam-lf", "bam-lc", "bam-wf", "bam-wc"];
        for name in names {
            for sample in [false, true] {
                let mut vs = nn::VarStore::new(device);
                let cfg = NormalizerConfig { bam: BamConfig { k: 3.0, sigma: 0.5, ..Default::default() }, ..Default::default() };
                let normalizer = name.parse::<Variant>()?.build(&vs.root(), heads, d, &cfg)?;
                vs.double();
                let z = (Tensor::randn([heads, e], (Kind::Double, device)) * 3.0).set_requires_grad(true);
                let keys = Tensor::randn([1, heads, n, d], (Kind::Double, device)).set_requires_grad(true);
                let noise = if name.starts_with("bam-l") {
                    Tensor::randn([heads, e], (Kind::Double, device))
                } else {
                    Tensor::rand([heads, e], (Kind::Double, device))
                };
                let cot = Tensor::randn([heads, e], (Kind::Double, device));

                let run = |support: &Support,
                           scores: &Tensor,
                           noise: &Tensor,
                           to_edges: &dyn Fn(&Tensor) -> Tensor|
                 -> Result<(Tensor, Option<f64>, Vec<Tensor>)> {
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
                let (w_dense, kl_dense, g_dense) = run(&dense_support, &graph.scatter(&z), &graph.scatter(&noise), &|w| graph.gather(w))?;
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
                let rows = Tensor::zeros([heads, n], (Kind::Double, device)).index_add(1, dst, &w_edges);
                let has_edge = Tensor::zeros([n], (Kind::Double, device)).index_fill(0, dst, 1.0);
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

/// BAM with the neighbourhood prior written from the formula, dense, with the adjacency as a
/// per-row mask: the sampled weights `(H, E)`, the KL averaged over each head's edges and then over
/// heads, and `log ψ` `(H, E)`. `prior` holds the prior network's f1 weight and bias and f2 weight
/// and bias.
fn neighbourhood_formula(
    graph: &Graph,
    name: &str,
    bam: &BamConfig,
    z: &Tensor,
    keys: &Tensor,
    noise: &Tensor,
    prior: &[Tensor; 4],
) -> (Tensor, Tensor, Tensor) {
    let (n, heads) = (graph.n, graph.heads);
    let excluded = graph.allowed().logical_not().view([1, 1, n, n]);
    // A masked row log-softmax; rows without edges come out uniform and are never gathered.
    let row_log_softmax = |t: &Tensor| graph.gather(&t.masked_fill(&excluded, -1e300).log_softmax(-1, Kind::Double));
    let log_pi = row_log_softmax(&graph.scatter(z)); // (H, E)
    let log_s = if name == "bam-lc" { lognormal_log_sample(&log_pi, bam.sigma, noise) } else { weibull_log_sample(&log_pi, bam.k, noise) };
    let w = row_log_softmax(&graph.scatter(&log_s)).exp();
    let hidden = (keys.matmul(&prior[0].transpose(1, 2).unsqueeze(0)) + prior[1].view([1, heads, 1, -1])).relu(); // (1, H, N, hidden)
    let logits = (hidden.matmul(&prior[2].view([1, heads, -1, 1])) + prior[3].view([1, heads, 1, 1])).transpose(2, 3); // (1, H, 1, N)
    let log_psi = row_log_softmax(&logits.expand([1, heads, n, n], false)); // (H, E)
    let kl = if name == "bam-lc" {
        lognormal_kl(&(&log_pi - bam.sigma * bam.sigma / 2.0), bam.sigma, &log_psi, bam.prior_sigma)
    } else {
        weibull_gamma_kl(&log_pi, bam.k, &(log_psi.exp() * bam.prior_beta), bam.prior_beta)
    }; // (H, E)
    (w, kl.mean_dim(&[1i64][..], false, Kind::Double).mean(Kind::Double), log_psi)
}

/// The neighbourhood prior (`PriorScope::Neighbourhood`) over an edge list against the
/// dense prior written here from the formula, with the adjacency as a per-row mask:
/// `log ψ_ij = logit_j − logsumexp_{j' : A_ij' = 1} logit_j'`, `α_ij = β ψ_ij` (bam-wc) or
/// `μ_p,ij = log ψ_ij` (bam-lc), the KL averaged over each head's edges, then over heads. Weights,
/// KL and the gradients of scores, keys and prior parameters, float64, within 1e-11 (the two sides
/// only reorder sums: scatter over edges against dense reductions).
#[test]
fn neighbourhood_prior_over_edges_equals_a_per_row_dense_prior() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(22);
    for device in devices() {
        let (n, heads, d) = (10, 2, 4);
        let graph = Graph::new(n, heads, device);
        let (e, dst) = (graph.edges(), &graph.dst);
        let support = graph.support()?;
        for name in ["bam-wc", "bam-lc"] {
            let (k, sigma, beta, sigma_p) = (3.0, 0.5, 2.0, 0.8);
            let bam = BamConfig {
                k,
                sigma,
                prior_beta: beta,
                prior_sigma: sigma_p,
                prior_scope: PriorScope::Neighbourhood,
                ..Default::default()
            };
            let mut vs = nn::VarStore::new(device);
            let cfg = NormalizerConfig { bam: bam.clone(), ..Default::default() };
            let normalizer = name.parse::<Variant>()?.build(&vs.root(), heads, d, &cfg)?;
            vs.double();
            let z = (Tensor::randn([heads, e], (Kind::Double, device)) * 3.0).set_requires_grad(true);
            let keys = Tensor::randn([1, heads, n, d], (Kind::Double, device)).set_requires_grad(true);
            let noise = if name == "bam-lc" {
                Tensor::randn([heads, e], (Kind::Double, device))
            } else {
                Tensor::rand([heads, e], (Kind::Double, device))
            };
            let cot = Tensor::randn([heads, e], (Kind::Double, device));
            let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
            params.sort_by(|a, b| a.0.cmp(&b.0));
            let param =
                |suffix: &str| params.iter().find(|(n, _)| n.ends_with(suffix)).map(|(_, t)| t.shallow_clone()).context(suffix.to_string());
            let zero_grads = || {
                for t in params.iter().map(|(_, t)| t).chain([&z, &keys]) {
                    let _ = t.grad().defined().then(|| t.grad().zero_());
                }
            };
            let grads = || -> Vec<Tensor> { [&z, &keys].into_iter().chain(params.iter().map(|(_, t)| t)).map(grad_or_zero).collect() };

            // The library, over edges.
            zero_grads();
            let input = NormalizeInput { scores: &z, support: &support, keys: Some(&keys), noise: Some(&noise), sample: true };
            let out = normalizer.normalize(&input)?;
            let kl_edges = out.kl.context("no KL")?;
            ((&out.weights * &cot).sum(Kind::Double) + &kl_edges * 0.7).backward();
            let (w_edges, kl_edges, g_edges) = (out.weights.detach(), f64::try_from(&kl_edges)?, grads());

            // The formula, dense, per-row mask.
            zero_grads();
            let prior = [param("prior.f1.weight")?, param("prior.f1.bias")?, param("prior.f2.weight")?, param("prior.f2.bias")?];
            let (w_dense, kl_dense, log_psi) = neighbourhood_formula(&graph, name, &bam, &z, &keys, &noise, &prior);
            ((&w_dense * &cot).sum(Kind::Double) + &kl_dense * 0.7).backward();
            let (w_dense, kl_dense, g_dense) = (w_dense.detach(), f64::try_from(&kl_dense)?, grads());

            let err = f64::try_from((&w_edges - &w_dense).abs().max())?;
            assert!(err < 1e-11, "{name}: weights differ by {err}");
            assert!((kl_edges - kl_dense).abs() < 1e-11 * kl_dense.abs().max(1.0), "{name}: KL {kl_edges} vs {kl_dense}");
            assert_eq!(g_edges.len(), 6, "{name}: scores, keys and the prior's four parameters");
            for (i, (a, b)) in g_edges.iter().zip(&g_dense).enumerate() {
                let scale = f64::try_from(b.abs().max())?.max(1.0);
                let err = f64::try_from((a - b).abs().max())?;
                assert!(err < 1e-11 * scale, "{name}: gradient {i} differs by {err}");
                // f2.bias (index 4) shifts every logit of a head alike: ψ and its gradient ignore it.
                assert!(i == 4 || f64::try_from(a.abs().max())? > 1e-6, "{name}: gradient {i} is zero");
            }
            // The prior really is per neighbourhood: each node's ψ sums to one over its edges.
            let psi_rows = Tensor::zeros([heads, n], (Kind::Double, device)).index_add(1, dst, &log_psi.exp().detach());
            let has_edge = Tensor::zeros([n], (Kind::Double, device)).index_fill(0, dst, 1.0);
            assert!(f64::try_from((psi_rows - has_edge).abs().max())? < 1e-12, "{name}: ψ does not sum to 1 per node");
        }
    }
    Ok(())
}

/// `all-nodes` (the default, the authors' GAT code) is one softmax over every key node, shared by
/// all queries: bit for bit what the edge path computed before the scope existed.
#[test]
fn all_nodes_prior_is_one_softmax_over_every_key_node() -> Result<()> {
    let _serial = common::serial();
    tch::manual_seed(23);
    assert_eq!(BamConfig::default().prior_scope, PriorScope::AllNodes);
    let (n, heads) = (7, 3);
    // Every node has a self-loop, so every node is some edge's key.
    let adjacency = Tensor::rand([n, n], (Kind::Float, Device::Cpu)).lt(0.4).logical_or(&Tensor::eye(n, (Kind::Bool, Device::Cpu)));
    let nz = adjacency.nonzero();
    let (dst, src) = (nz.select(1, 0).contiguous(), nz.select(1, 1).contiguous());
    let support = Support::Edges(EdgeList::new(dst, src.shallow_clone(), n, n)?);
    let logits = Tensor::randn([1, heads, 1, n], (Kind::Float, Device::Cpu));
    let got = support.key_log_softmax(&logits, PriorScope::AllNodes);
    let expected = logits.log_softmax(-1, Kind::Float).view([heads, n]).index_select(1, &src);
    assert!(got.equal(&expected), "all-nodes ψ changed: {got} vs {expected}");
    let neighbourhood = support.key_log_softmax(&logits, PriorScope::Neighbourhood);
    assert!(!neighbourhood.allclose(&expected, 1e-3, 1e-3, false), "the two scopes should differ on this graph");
    Ok(())
}

#[test]
fn weights_that_cannot_be_allocated_are_a_named_error() -> Result<()> {
    // (1, 1, 5000000, 5000000) float64 weights: 200 TB, more than x86-64's 128 TiB of user address
    // space, so every allocator refuses them, also where memory is overcommitted (a smaller request
    // can be granted there and end in the out-of-memory killer once the pages are touched). The
    // eager path returns Error::OutOfMemory naming the shape and the memory-efficient path,
    // instead of panicking inside tch.
    let q = Tensor::randn([1, 1, 5_000_000, 4], (Kind::Double, Device::Cpu));
    let err = match attend(&q, &q, &q, &Masks::default(), &probattn::normalize::Dnas, AttendOptions::default()) {
        Ok(_) => anyhow::bail!("200 TB of weights were allocated"),
        Err(e) => e,
    };
    let m = err.to_string();
    ensure!(matches!(err, probattn::Error::OutOfMemory(_)), "{m}");
    ensure!(m.contains("(1, 1, 5000000, 5000000)") && m.contains("memory-efficient") && !m.contains("frame #"), "{m}");
    Ok(())
}
