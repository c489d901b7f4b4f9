//! A variant defined outside the crate, through the public API alone: DNAS at a temperature `T`
//! (`DNAS(z / T)`). Its eager form composes the library's `Dnas`; its memory-efficient form is
//! the DNAS plan with a score scale of `1/T`, data the tiles read like any built-in's. Both paths
//! of `probattn::attend` must agree with each other and with the built-in DNAS on `q / T`, outputs
//! and gradients, in float64, under key padding.

use probattn::normalize::{Dnas, NormalizeInput, Normalized, Normalizer};
use probattn::tiled::Tiled;
use probattn::{attend, AttendOptions, Masks, Result};
use tch::{Device, Kind, Tensor};

/// DNAS over the scores divided by `t`.
#[derive(Debug)]
struct TemperedDnas {
    t: f64,
}

impl Normalizer for TemperedDnas {
    fn name(&self) -> String {
        format!("dnas-t{}", self.t)
    }

    fn normalize(&self, input: &NormalizeInput) -> Result<Normalized> {
        let scaled = input.scores / self.t;
        Dnas.normalize(&NormalizeInput {
            scores: &scaled,
            support: input.support,
            keys: input.keys,
            noise: input.noise,
            sample: input.sample,
        })
    }

    fn causal_safe(&self) -> bool {
        false
    }

    fn tiled(&self) -> Option<Tiled<'_>> {
        Some(Tiled { score_scale: 1.0 / self.t, ..Tiled::sweeps(self.name(), 1) })
    }
}

/// Output and the gradients of `q`, `k`, `v` for `sum(output · cotangent)`.
fn run(q: &Tensor, k: &Tensor, v: &Tensor, masks: &Masks, n: &dyn Normalizer, opts: AttendOptions, ct: &Tensor) -> Result<Vec<Tensor>> {
    let (q, k, v) = (q.detach().set_requires_grad(true), k.detach().set_requires_grad(true), v.detach().set_requires_grad(true));
    let out = attend(&q, &k, &v, masks, n, opts)?.output;
    (&out * ct).sum(Kind::Double).backward();
    Ok(vec![out.detach(), q.grad(), k.grad(), v.grad()])
}

#[test]
fn a_variant_defined_outside_the_crate_runs_eager_and_memory_efficient() -> Result<()> {
    tch::manual_seed(11);
    let opts = (Kind::Double, Device::Cpu);
    let (q, k, v) = (Tensor::randn([2, 3, 9, 4], opts), Tensor::randn([2, 3, 11, 4], opts), Tensor::randn([2, 3, 11, 5], opts));
    let ct = Tensor::randn([2, 3, 9, 5], opts);
    let pad = Tensor::from_slice(&[false; 11]).view([1, 11]).repeat([2, 1]);
    let _ = pad.get(1).narrow(0, 7, 4).fill_(1);
    let masks = Masks { key_padding: Some(&pad), ..Default::default() };
    for t in [0.5, 2.0] {
        let ours = TemperedDnas { t };
        let eager = run(&q, &k, &v, &masks, &ours, AttendOptions::default(), &ct)?;
        let tiled = run(&q, &k, &v, &masks, &ours, AttendOptions { need_weights: false, tile: Some(4), ..Default::default() }, &ct)?;
        // The built-in DNAS on q / t: the same weights, and q's gradient scaled back by 1 / t.
        let mut builtin = run(&(&q / t), &k, &v, &masks, &Dnas, AttendOptions::default(), &ct)?;
        builtin[1] = &builtin[1] / t;
        for (name, i) in [("output", 0), ("dq", 1), ("dk", 2), ("dv", 3)] {
            let tiles = (&eager[i] - &tiled[i]).abs().max().double_value(&[]);
            let reference = (&eager[i] - &builtin[i]).abs().max().double_value(&[]);
            assert!(tiles < 1e-10, "T {t}: {name} of the memory-efficient path differs by {tiles}");
            assert!(reference < 1e-10, "T {t}: {name} differs from DNAS on q / T by {reference}");
        }
        assert!(
            (&eager[0] - run(&q, &k, &v, &masks, &Dnas, AttendOptions::default(), &ct)?[0].shallow_clone()).abs().max().double_value(&[])
                > 1e-3,
            "T {t}: the temperature changed nothing, so the test would not see it ignored"
        );
    }
    Ok(())
}
