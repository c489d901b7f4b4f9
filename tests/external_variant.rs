//! A variant defined outside the crate, through the public API alone and by its plan alone: DNAS
//! at a temperature `T` (`DNAS(z / T)`), whose normalizer says nothing but its name and its plan
//! (one column sweep, a score scale of `1/T`). The library's eager interpreter of the plan, the
//! tiles and the fused CPU kernel must each give what the formula gives, written here from the
//! paper with libtorch's own reductions, outputs and gradients, in float64, under key padding (and,
//! on a GPU, the embedded Triton kernels in bfloat16); its
//! registry entry must report what the plan implies; and a causal mask must be refused by name.

use probattn::backend::{Backend, Route};
use probattn::normalize::registry::{Family, VariantSpec};
use probattn::normalize::Normalizer;
use probattn::tiled::Tiled;
use probattn::{attend_with_choice, AttendOptions, Masks, Result, Variant};
use tch::{Device, Kind, Tensor};

/// DNAS over the scores divided by `t`: the plan is all there is.
#[derive(Debug)]
struct TemperedDnas {
    t: f64,
}

impl Normalizer for TemperedDnas {
    fn name(&self) -> String {
        format!("warm-dnas-{}", self.t)
    }

    fn tiled(&self) -> Option<Tiled<'_>> {
        Some(Tiled { score_scale: 1.0 / self.t, ..Tiled::sweeps(self.name(), 1) })
    }
}

/// Its registry entry (`warm-dnas-N`: DNAS at temperature N), outside the crate.
static TEMPERED_DNAS: VariantSpec = VariantSpec {
    name: "warm-dnas-N",
    aliases: &[],
    example: "warm-dnas-2",
    summary: "DNAS of the scores divided by N",
    source: "a test",
    benchmarked: false,
    settings: &[],
    parse: |s| s.strip_prefix("warm-dnas-")?.parse().ok().filter(|n| *n >= 1).map(|n| Variant::Registered { spec: &TEMPERED_DNAS, n }),
    build: |_, _, _, _, n| Ok(Box::new(TemperedDnas { t: f64::from(n) })),
};

/// The formula: `z = q·kᵀ / (√d · T)`; `C_j = logsumexp_i z_ij` over the queries; `π_ij =
/// softmax_j(z_ij − C_j)` over the allowed keys; `y = π v`. A padded key's column is left out of
/// the row softmax, so its `C_j` (taken over zeros, to stay finite) is never read.
fn formula(q: &Tensor, k: &Tensor, v: &Tensor, pad: &Tensor, t: f64) -> Tensor {
    let d = q.size()[3] as f64;
    let z = q.matmul(&k.transpose(-2, -1)) / (d.sqrt() * t); // (B, H, S_q, S_k)
    let padded = pad.view([pad.size()[0], 1, 1, pad.size()[1]]);
    let c = z.masked_fill(&padded, 0.0).logsumexp([-2i64].as_slice(), true); // (B, H, 1, S_k)
    let w = (&z - &c).masked_fill(&padded, f64::NEG_INFINITY).softmax(-1, Kind::Double);
    w.matmul(v)
}

/// Output and the gradients of `q`, `k`, `v` for `sum(output · cotangent)`, with the route taken.
fn run(
    qkv: [&Tensor; 3],
    ct: &Tensor,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Option<Route>)>,
) -> Result<(Vec<Tensor>, Option<Route>)> {
    let [q, k, v] = qkv.map(|x| x.detach().set_requires_grad(true));
    let (out, route) = f(&q, &k, &v)?;
    (&out * ct).sum(Kind::Double).backward();
    Ok((vec![out.detach(), q.grad(), k.grad(), v.grad()], route))
}

#[test]
fn a_variant_defined_by_its_plan_alone_runs_on_every_route_and_matches_its_formula() -> Result<()> {
    tch::manual_seed(11);
    let opts = (Kind::Double, Device::Cpu);
    let (q, k) = (Tensor::randn([2, 3, 9, 4], opts), Tensor::randn([2, 3, 11, 4], opts));
    let pad = Tensor::from_slice(&[false; 11]).view([1, 11]).repeat([2, 1]);
    let _ = pad.get(1).narrow(0, 7, 4).fill_(1);
    let masks = Masks { key_padding: Some(&pad), ..Default::default() };
    // d_v = d lets the fused CPU kernel serve the call; d_v ≠ d takes the tiles.
    for dv in [4, 5] {
        let v = Tensor::randn([2, 3, 11, dv], opts);
        let ct = Tensor::randn([2, 3, 9, dv], opts);
        for t in [0.5, 2.0] {
            let ours = TemperedDnas { t };
            let (want, _) = run([&q, &k, &v], &ct, |q, k, v| Ok((formula(q, k, v, &pad, t), None)))?;
            let routes = [
                ("eager", AttendOptions { backend: Backend::Eager, ..Default::default() }, Route::Eager),
                (
                    "tiles",
                    AttendOptions { backend: Backend::Tiles, tile: Some(4), need_weights: false, ..Default::default() },
                    Route::Tiles,
                ),
                (
                    "auto, memory-efficient",
                    AttendOptions { tile: Some(4), need_weights: false, ..Default::default() },
                    if dv == 4 { Route::FusedCpu } else { Route::Tiles },
                ),
            ];
            for (what, options, route) in routes {
                let (got, taken) = run([&q, &k, &v], &ct, |q, k, v| {
                    let (a, choice) = attend_with_choice(q, k, v, &masks, &ours, options)?;
                    Ok((a.output, Some(choice.route)))
                })?;
                assert_eq!(taken, Some(route), "T {t}, d_v {dv}, {what}");
                for (name, i) in [("output", 0), ("dq", 1), ("dk", 2), ("dv", 3)] {
                    let err = (&got[i] - &want[i]).abs().max().double_value(&[]);
                    assert!(err < 1e-10, "T {t}, d_v {dv}, {what}: {name} differs from the formula by {err}");
                }
            }
        }
    }
    // On a GPU the embedded Triton kernels run it too, forced, in bfloat16: its plan is all they read.
    if tch::Cuda::is_available() && probattn::fused_cuda::availability(true).gpu_matches {
        let cuda = Device::Cuda(0);
        let pad = pad.to_device(cuda);
        let masks = Masks { key_padding: Some(&pad), ..Default::default() };
        let v = Tensor::randn([2, 3, 11, 4], opts);
        let ct = Tensor::randn([2, 3, 9, 4], opts);
        let low = |t: &Tensor| t.to_kind(Kind::BFloat16).to_device(cuda);
        let (bq, bk, bv) = (low(&q), low(&k), low(&v));
        let wide = |t: &Tensor| t.to_device(Device::Cpu).to_kind(Kind::Double);
        let (want, _) =
            run([&wide(&bq), &wide(&bk), &wide(&bv)], &ct, |q, k, v| Ok((formula(q, k, v, &pad.to_device(Device::Cpu), 2.0), None)))?;
        let forced = AttendOptions { backend: Backend::Fused, need_weights: false, ..Default::default() };
        let (got, taken) = run([&bq, &bk, &bv], &ct.to_kind(Kind::BFloat16).to_device(cuda), |q, k, v| {
            let (a, choice) = attend_with_choice(q, k, v, &masks, &TemperedDnas { t: 2.0 }, forced)?;
            Ok((a.output, Some(choice.route)))
        })?;
        assert_eq!(taken, Some(Route::FusedCuda));
        for (name, i) in [("output", 0), ("dq", 1), ("dk", 2), ("dv", 3)] {
            let err = (&wide(&got[i]) - &want[i]).abs().max().double_value(&[]);
            assert!(err < 5e-2, "fused CUDA, bfloat16: {name} differs from the formula by {err}");
        }
    }
    // The temperature matters, so the comparison would see it ignored.
    let v = Tensor::randn([2, 3, 11, 4], opts);
    let gap = (formula(&q, &k, &v, &pad, 2.0) - formula(&q, &k, &v, &pad, 1.0)).abs().max().double_value(&[]);
    assert!(gap > 1e-3, "the temperature changed the formula's output by only {gap}");
    Ok(())
}

#[test]
fn its_registry_entry_reports_what_its_plan_implies() -> Result<()> {
    let variant = (TEMPERED_DNAS.parse)("warm-dnas-3").expect("warm-dnas-3 parses");
    assert_eq!(variant.to_string(), "warm-dnas-3");
    let p = TEMPERED_DNAS.properties()?;
    assert_eq!((p.family, p.causal_safe, p.stochastic, p.kl, p.noise), (Some(Family::DoublyNormalized), false, false, false, None));
    assert!(p.memory_efficient.as_deref().is_some_and(|r| r.starts_with("two passes")), "{:?}", p.memory_efficient);
    assert!(!variant.is_stochastic());
    // A column sweep reads every query: a causal mask is refused, naming the variant.
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let n = variant.build(&vs.root(), 3, 4, &Default::default())?;
    let x = Tensor::randn([1, 3, 5, 4], (Kind::Double, Device::Cpu));
    let err = attend_with_choice(&x, &x, &x, &Masks { causal: true, ..Default::default() }, n.as_ref(), AttendOptions::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("warm-dnas-3") && err.contains("causal"), "{err}");
    Ok(())
}
