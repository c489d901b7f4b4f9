//! Property tests of the memory-efficient path (`probattn::tiled`) against the eager one
//! (`probattn::attend`), on inputs drawn by a seeded generator: random B, H, S_q, S_k (1 to 70,
//! 1 included), head and value widths, tiles (1, a divisor of S_q, a non-divisor, larger than
//! S_q), every mask layout, score scales from 1e-3 to 1e4, float32 and float64, every variant and
//! both routes (the fused CPU kernel where it applies, and the tiles alone).
//!
//! Each case compares the output, the received mass, BAM's KL and the gradients of q, k, v, the
//! HNAS gate logits and the contextual prior's parameters, and checks the invariants of the
//! weights on both sides: rows sum to 1 where any key is allowed, masked entries receive exactly
//! 0, the received masses sum to the number of rows with an allowed key, and DNAS gives every
//! key with an allowed query at least 1 / (the most keys a row allows) (Ding et al. 2020,
//! Theorem 2).
//!
//! Tolerances. Two paths that form the scores `z = q·kᵀ/√d` in a different order differ in `z`
//! by a few units of rounding of `Σ_d |q_d k_d| / √d` (here `zabs`, the largest over the entries),
//! and a weight `exp(z − …)` inherits that absolute error as a relative one. So an output
//! compared against its reference `r` may differ by
//! `TOLERANCE · eps · (1 + zabs) · (1 + sweeps) · max|r|` (eps the dtype's machine epsilon,
//! sweeps the Sinkhorn sweeps, 1 for DNAS and HNAS). The sums over the weights (every row's, and
//! every key's over the rows, which adds up to the number of live rows) are held to
//! `SUM_TOLERANCE · eps · S`, times `(1 + zabs) · (1 + sweeps)` for the received masses (some
//! routes form a key's mass as `exp(log-sum-exp − statistic)`, which inherits `z`'s rounding), and
//! never to half a row or more: a lost row of mass is a difference of 1.
//!
//! `cargo test` runs `PROBATTN_PROPERTY_CASES` cases (default 300) from seed
//! `PROBATTN_PROPERTY_SEED` (default 0); a failure names the case's seed, which reruns it alone
//! with `PROBATTN_PROPERTY_SEED=<seed> PROBATTN_PROPERTY_CASES=1`.

mod common;

use std::collections::BTreeMap;

use anyhow::{bail, ensure, Context, Result};
use common::{env_u64, max_abs, max_diff};
use probattn::normalize::{Bam, BamConfig, BamKind, Dnas, Hnas, Normalizer, NormalizerConfig, Sinkhorn, Softmax};
use probattn::tiled::{attend_tiled, counter_noise, Tiled, TiledOptions};
use probattn::{attend, AttendOptions, Masks, Mode, ScoreShape, Variant};
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use rand_xoshiro::Xoshiro256PlusPlus;
use tch::{nn, Device, Kind, Tensor};

/// Multiples of eps · (1 + zabs) · (1 + sweeps) · max|reference| an output or gradient may
/// differ by. The largest ratio seen over 5,000 cases is in the closing line of the long run.
const TOLERANCE: f64 = 64.0;
/// In float32, how many times further from the float64 eager result than the float32 eager result
/// the memory-efficient path may be.
const ACCURACY_RATIO: f64 = 8.0;
/// Multiples of eps · S the sums of the weights may be off by.
const SUM_TOLERANCE: f64 = 16.0;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    None,
    KeyPadding,
    /// Key padding with a key left in every sequence: the fused CPU kernel applies.
    KeyPaddingEverySequenceLive,
    QueryPadding,
    KeyAndQueryPadding,
    /// A boolean (B, H, S_q, S_k) pattern with a dead row and a dead column.
    Pattern,
    /// A boolean (S_k,) pattern: per key, broadcast over everything else.
    KeyPattern,
    Causal,
}

const LAYOUTS: [Layout; 8] = [
    Layout::None,
    Layout::KeyPadding,
    Layout::KeyPaddingEverySequenceLive,
    Layout::QueryPadding,
    Layout::KeyAndQueryPadding,
    Layout::Pattern,
    Layout::KeyPattern,
    Layout::Causal,
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Which {
    Softmax,
    Dnas,
    Hnas,
    Sinkhorn(u32),
    Bam(BamKind, Variant),
}

impl Which {
    fn name(&self) -> String {
        match self {
            Which::Softmax => "softmax".into(),
            Which::Dnas => "dnas".into(),
            Which::Hnas => "hnas".into(),
            Which::Sinkhorn(n) => format!("sinkhorn-{n}"),
            Which::Bam(kind, base) => format!("{} over {base}", kind.name()),
        }
    }
    /// Column/row sweeps (the factor of the tolerance).
    fn sweeps(&self) -> f64 {
        match self {
            Which::Softmax | Which::Bam(_, Variant::Softmax) => 0.0,
            Which::Sinkhorn(n) | Which::Bam(_, Variant::Sinkhorn(n)) => f64::from(*n),
            _ => 1.0,
        }
    }
    /// Normalizes each key over the queries (refused under a causal mask).
    fn column_normalized(&self) -> bool {
        !matches!(self, Which::Softmax | Which::Bam(_, Variant::Softmax))
    }
}

/// One generated case.
struct Case {
    seed: u64,
    kind: Kind,
    dims: [i64; 4],
    d: i64,
    dv: i64,
    scale: f64,
    layout: Layout,
    which: Which,
    tile: i64,
    fused_cpu: bool,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    key_padding: Option<Tensor>,
    query_padding: Option<Tensor>,
    attn_mask: Option<Tensor>,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [b, h, sq, sk] = self.dims;
        write!(
            f,
            "case seed {} ({}, {:?}, B {b} H {h} S_q {sq} S_k {sk} d {} d_v {}, scale {:.1e}, {:?}, tile {}{})",
            self.seed,
            self.which.name(),
            self.kind,
            self.d,
            self.dv,
            self.scale,
            self.layout,
            self.tile,
            if self.fused_cpu { ", fused CPU kernel allowed" } else { ", tiles only" }
        )
    }
}

/// A tensor of standard normals from `rng`.
fn randn(rng: &mut Xoshiro256PlusPlus, shape: &[i64], kind: Kind) -> Tensor {
    let n = shape.iter().product::<i64>() as usize;
    let values: Vec<f64> = (0..n).map(|_| rng.sample(StandardNormal)).collect();
    Tensor::from_slice(&values).view(shape).to_kind(kind)
}

/// A boolean tensor, each entry true with probability `p`.
fn bernoulli(rng: &mut Xoshiro256PlusPlus, shape: &[i64], p: f64) -> Tensor {
    let n = shape.iter().product::<i64>() as usize;
    let values: Vec<bool> = (0..n).map(|_| rng.gen_bool(p)).collect();
    Tensor::from_slice(&values).view(shape)
}

/// A length: 1 in one case of six, else uniform in 1..=70.
fn length(rng: &mut Xoshiro256PlusPlus) -> i64 {
    if rng.gen_bool(1.0 / 6.0) {
        1
    } else {
        rng.gen_range(1..=70)
    }
}

impl Case {
    fn generate(seed: u64) -> Case {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let kind = if rng.gen_bool(0.6) { Kind::Double } else { Kind::Float };
        let (b, h, sq, sk) = (rng.gen_range(1..=3), rng.gen_range(1..=3), length(&mut rng), length(&mut rng));
        let d = [1, 2, 3, 4, 8, 16][rng.gen_range(0..6)];
        let dv = if rng.gen_bool(0.75) { d } else { [1, 2, 5][rng.gen_range(0..3)] };
        let scale = 10f64.powf(rng.gen_range(-3.0..4.0));
        let layout = LAYOUTS[rng.gen_range(0..LAYOUTS.len())];
        let bam_kinds = BamKind::ALL;
        let which = match rng.gen_range(0..6) {
            0 => Which::Softmax,
            1 => Which::Dnas,
            2 => Which::Hnas,
            3 => Which::Sinkhorn(rng.gen_range(2..=4)),
            _ => {
                let base = [Variant::Softmax, Variant::Dnas, Variant::Sinkhorn(2)][rng.gen_range(0..3)];
                Which::Bam(bam_kinds[rng.gen_range(0..bam_kinds.len())], base)
            }
        };
        let divisors: Vec<i64> = (1..=sq).filter(|t| sq % t == 0).collect();
        let non_divisors: Vec<i64> = (2..sq).filter(|t| sq % t != 0).collect();
        let tile = match rng.gen_range(0..4) {
            0 => 1,
            1 => divisors[rng.gen_range(0..divisors.len())],
            2 if !non_divisors.is_empty() => non_divisors[rng.gen_range(0..non_divisors.len())],
            _ => sq + rng.gen_range(1..=40),
        };
        let fused_cpu = rng.gen_bool(0.5);
        // q carries the scale: z = q·kᵀ/√d has entries of about `scale`.
        let q = randn(&mut rng, &[b, h, sq, d], kind) * scale;
        let k = randn(&mut rng, &[b, h, sk, d], kind);
        let v = randn(&mut rng, &[b, h, sk, dv], kind);
        let g = randn(&mut rng, &[b, h, sq, dv], kind);
        // Padding: each sequence keeps a random prefix; one sequence may lose all of it.
        let mut padding = |len: i64, every_live: bool| {
            let kept: Vec<i64> = (0..b).map(|_| if !every_live && rng.gen_bool(0.3) { 0 } else { rng.gen_range(1..=len) }).collect();
            Tensor::arange(len, (Kind::Int64, Device::Cpu)).unsqueeze(0).ge_tensor(&Tensor::from_slice(&kept).unsqueeze(1))
        };
        let (mut key_padding, mut query_padding, mut attn_mask) = (None, None, None);
        match layout {
            Layout::KeyPadding => key_padding = Some(padding(sk, false)),
            Layout::KeyPaddingEverySequenceLive => key_padding = Some(padding(sk, true)),
            Layout::QueryPadding => query_padding = Some(padding(sq, false)),
            Layout::KeyAndQueryPadding => {
                key_padding = Some(padding(sk, false));
                query_padding = Some(padding(sq, false));
            }
            Layout::Pattern => {
                let density = rng.gen_range(0.0..0.8);
                let pattern = bernoulli(&mut rng, &[b, h, sq, sk], density);
                let _ = pattern.narrow(2, rng.gen_range(0..sq), 1).fill_(1); // a dead row
                let _ = pattern.narrow(3, rng.gen_range(0..sk), 1).fill_(1); // a dead column
                attn_mask = Some(pattern);
            }
            Layout::KeyPattern => attn_mask = Some(bernoulli(&mut rng, &[sk], 0.3)),
            Layout::None | Layout::Causal => {}
        }
        Case {
            seed,
            kind,
            dims: [b, h, sq, sk],
            d,
            dv,
            scale,
            layout,
            which,
            tile,
            fused_cpu,
            q,
            k,
            v,
            g,
            key_padding,
            query_padding,
            attn_mask,
        }
    }

    fn masks(&self) -> Masks<'_> {
        Masks {
            key_padding: self.key_padding.as_ref(),
            query_padding: self.query_padding.as_ref(),
            attn_mask: self.attn_mask.as_ref(),
            causal: self.layout == Layout::Causal,
            bias: None,
        }
    }

    fn shape(&self) -> ScoreShape {
        let [batch, heads, queries, keys] = self.dims;
        ScoreShape { batch, heads, queries, keys }
    }

    /// `(B, H, S_q, S_k)` booleans, true = may attend.
    fn allowed(&self) -> Result<Tensor> {
        Ok(match self.masks().allowed(self.shape(), Device::Cpu)? {
            Some(a) => a.expand(self.dims, false).contiguous(),
            None => Tensor::ones(self.dims, (Kind::Bool, Device::Cpu)),
        })
    }

    /// The largest `Σ_d |q_d k_d| / √d` over the entries.
    fn zabs(&self) -> f64 {
        let s = self.q.abs().to_kind(Kind::Double).matmul(&self.k.abs().to_kind(Kind::Double).transpose(-2, -1)) / (self.d as f64).sqrt();
        s.max().double_value(&[])
    }

    fn eps(&self) -> f64 {
        if self.kind == Kind::Double {
            f64::EPSILON
        } else {
            f64::from(f32::EPSILON)
        }
    }
}

/// What one path gives: output, received mass, KL (0 without one), gradients (q, k, v, params).
struct Outcome {
    output: Tensor,
    mass: Tensor,
    kl: Tensor,
    grads: Vec<Tensor>,
    /// The eager path's weights, for the invariants.
    weights: Option<Tensor>,
}

/// The variant's normalizer and tiled form, and its parameters, in the case's dtype.
struct Built {
    _vs: nn::VarStore,
    eager: Box<dyn Normalizer>,
    params: Vec<Tensor>,
    hnas_logit: Option<Tensor>,
}

fn build(case: &Case, kind: Kind, rng: &mut Xoshiro256PlusPlus) -> Result<Built> {
    let heads = case.dims[1];
    let mut vs = nn::VarStore::new(Device::Cpu);
    let (eager, hnas_logit): (Box<dyn Normalizer>, Option<Tensor>) = match case.which {
        Which::Softmax => (Box::new(Softmax), None),
        Which::Dnas => (Box::new(Dnas), None),
        Which::Sinkhorn(n) => (Box::new(Sinkhorn::new(n)?), None),
        Which::Hnas => {
            let hnas = Hnas::new(&vs.root(), heads, 0.5)?;
            let logits: Vec<f64> = (0..heads).map(|_| rng.gen_range(-2.5..2.5)).collect();
            tch::no_grad(|| hnas.logit().shallow_clone().copy_(&Tensor::from_slice(&logits)));
            let logit = hnas.logit().shallow_clone();
            (Box::new(hnas), Some(logit))
        }
        Which::Bam(kind, base) => {
            let bam = BamConfig {
                k: rng.gen_range(2.0..20.0),
                sigma: rng.gen_range(0.2..1.5),
                prior_alpha: rng.gen_range(0.3..2.0),
                prior_beta: rng.gen_range(0.5..2.0),
                prior_mu: rng.gen_range(-1.0..0.5),
                prior_sigma: rng.gen_range(0.5..2.0),
                base,
                ..Default::default()
            };
            (Box::new(Bam::new(&vs.root(), kind, heads, case.d, &NormalizerConfig { bam, ..Default::default() })?), None)
        }
    };
    if kind == Kind::Double {
        vs.double();
    }
    // The contextual prior's parameters from the case's generator (libtorch's initialisation
    // draws from a generator the parallel tests share, so a case would not rerun alike).
    tch::no_grad(|| {
        if case.which != Which::Hnas {
            let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
            variables.sort_by(|a, b| a.0.cmp(&b.0));
            for (_, p) in variables {
                // Rounded to the case's dtype first: the float64 reference gets the same values.
                let values = (randn(rng, &p.size(), case.kind) * 0.3).to_kind(case.kind).to_kind(p.kind());
                p.shallow_clone().copy_(&values);
            }
        }
    });
    let params = vs.trainable_variables();
    Ok(Built { _vs: vs, eager, params, hnas_logit })
}

/// Runs one path from fresh leaves in `kind` (the case's inputs cast); `tiled` None is the eager path.
fn run(case: &Case, built: &Built, seed: u64, tiled: Option<TiledOptions>, kind: Kind) -> Result<Outcome> {
    let leaves: Vec<Tensor> = [&case.q, &case.k, &case.v].iter().map(|t| t.to_kind(kind).detach().set_requires_grad(true)).collect();
    let (q, k, v) = (&leaves[0], &leaves[1], &leaves[2]);
    let masks = case.masks();
    let sample = matches!(case.which, Which::Bam(..));
    let (output, mass, kl, weights) = match tiled {
        Some(options) => {
            // The normalizer's own tiled form, as the layers take it.
            let variant = built.eager.tiled().with_context(|| format!("{} has no tiled form", case.which.name()))?;
            let t = attend_tiled(q, k, v, &masks, &variant, TiledOptions { sample, seed: Some(seed), ..options })?;
            (t.output, t.received_mass, t.kl, None)
        }
        None => {
            let noise = match case.which {
                // The case's dtype's draws (float32 ones have 23 random bits), cast.
                Which::Bam(bam, _) => Some(counter_noise(bam, case.dims, seed, (case.kind, Device::Cpu))?.to_kind(kind)),
                _ => None,
            };
            let mode = if sample { Mode::MONTE_CARLO } else { Mode::EVAL };
            let a = attend(q, k, v, &masks, built.eager.as_ref(), AttendOptions { mode, noise: noise.as_ref(), ..Default::default() })?;
            let w = a.weights()?.shallow_clone();
            let mass = w.sum_dim_intlist(&[-2i64][..], false, kind);
            (a.output, mass, a.kl, Some(w.detach()))
        }
    };
    let kl = kl.unwrap_or_else(|| Tensor::zeros([], (kind, Device::Cpu)));
    let wrt: Vec<Tensor> = leaves.iter().chain(&built.params).map(Tensor::shallow_clone).collect();
    let loss = (&output * &case.g.to_kind(kind)).sum(kind) + &kl * 0.37;
    let grads = Tensor::run_backward(&[loss], &wrt, false, true);
    Ok(Outcome { output: output.detach(), mass: mass.detach(), kl: kl.detach(), grads, weights })
}

/// Per output, the largest difference seen as a fraction of what its case allows, and in absolute terms.
#[derive(Default)]
struct Largest(BTreeMap<String, (f64, f64)>);

impl Largest {
    fn note(&mut self, what: &str, ratio: f64, diff: f64) {
        let entry = self.0.entry(what.to_string()).or_insert((0.0, 0.0));
        entry.0 = entry.0.max(ratio);
        entry.1 = entry.1.max(diff);
    }
}

/// The invariants of one path's weights (eager) or received mass (both).
fn check_invariants(case: &Case, side: &str, outcome: &Outcome, allowed: &Tensor) -> Result<()> {
    let [_, _, sq, sk] = case.dims;
    let sum_tol = SUM_TOLERANCE * case.eps() * (sq.max(sk) as f64 + 1.0);
    let live_rows = allowed.any_dim(-1, false); // (B, H, S_q)
    let live_keys = allowed.any_dim(-2, false); // (B, H, S_k)
    let rows_per_head = live_rows.sum_dim_intlist(&[-1i64][..], false, Kind::Double);
    let mass = outcome.mass.to_kind(Kind::Double);
    let total = mass.sum_dim_intlist(&[-1i64][..], false, Kind::Double);
    let off = max_diff(&total, &rows_per_head);
    // The routes that form a key's mass as exp(log-sum-exp − statistic) inherit z's rounding, as
    // the weights do; half a row is never rounding.
    let mass_tol = sum_tol * (1.0 + case.zabs()) * (1.0 + case.which.sweeps());
    ensure!(
        off <= mass_tol.min(0.5) * (1.0 + sq as f64) && off < 0.5,
        "{side}: the received masses sum to {} where {} rows attend (off by {off:.3e})",
        total,
        rows_per_head
    );
    let dead = mass.masked_select(&live_keys.logical_not());
    ensure!(max_abs(&dead) == 0.0, "{side}: a key nobody may attend receives {}", max_abs(&dead));
    if matches!(case.which, Which::Dnas) {
        // Theorem 2: every key with an allowed query receives at least 1 / (the most keys a row allows).
        let widest = allowed.sum_dim_intlist(&[-1i64][..], false, Kind::Double).amax(&[-1i64][..], true).clamp_min(1.0);
        let floor: Tensor = widest.reciprocal() * (1.0 - mass_tol.min(0.5));
        let short = floor.expand_as(&mass).masked_select(&live_keys) - mass.masked_select(&live_keys);
        ensure!(
            max_abs(&short.clamp_min(0.0)) == 0.0,
            "{side}: a key receives {} less than Theorem 2's bound",
            max_abs(&short.clamp_min(0.0))
        );
    }
    if let Some(w) = &outcome.weights {
        let w = w.to_kind(Kind::Double);
        let masked = w.masked_select(&allowed.logical_not());
        ensure!(max_abs(&masked) == 0.0, "{side}: a masked entry has weight {}", max_abs(&masked));
        let rows = w.sum_dim_intlist(&[-1i64][..], false, Kind::Double);
        let expected = live_rows.to_kind(Kind::Double);
        let off = max_diff(&rows, &expected);
        ensure!(off <= sum_tol * (1.0 + sk as f64), "{side}: a row of weights sums to 1 ± {off:.3e}");
    }
    Ok(())
}

fn check_case(case: &Case, largest: &mut Largest) -> Result<()> {
    let rng_seed = case.seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(rng_seed);
    let built = build(case, case.kind, &mut rng)?;
    let noise_seed = rng.gen::<u64>() >> 1;
    let options = TiledOptions { fused_cpu: case.fused_cpu, ..TiledOptions::new(case.tile) };
    if case.layout == Layout::Causal && case.which.column_normalized() {
        let refused = run(case, &built, noise_seed, Some(options), case.kind).err().map(|e| e.to_string()).unwrap_or_default();
        ensure!(refused.contains("causal"), "{} ran under a causal mask: {refused}", case.which.name());
        return Ok(());
    }
    let eager = run(case, &built, noise_seed, None, case.kind).context("the eager path")?;
    let ours = run(case, &built, noise_seed, Some(options), case.kind).context("the memory-efficient path")?;
    let allowed = case.allowed()?;
    check_invariants(case, "eager", &eager, &allowed)?;
    check_invariants(case, "memory-efficient", &ours, &allowed)?;
    // In float32 both paths are compared with the eager path in float64 on the same (rounded)
    // inputs, parameters and draws: the memory-efficient path may be off by as much as the eager
    // one is, times ACCURACY_RATIO (BAM's KL sums large terms that cancel, differently on each
    // path), or by the tolerance above, whichever is larger.
    let truth = if case.kind == Kind::Float {
        let built64 = build(case, Kind::Double, &mut Xoshiro256PlusPlus::seed_from_u64(rng_seed))?;
        Some(run(case, &built64, noise_seed, None, Kind::Double).context("the eager path in float64")?)
    } else {
        None
    };
    let unit = case.eps() * (1.0 + case.zabs()) * (1.0 + case.which.sweeps());
    // The scale of a difference: the reference's largest entry, or where that is near 0 (a
    // gradient that vanishes exactly, as q's with a single key) the size of the terms it sums.
    let (g, v, q, k) = (max_abs(&case.g), max_abs(&case.v), max_abs(&case.q), max_abs(&case.k));
    let sqrt_d = (case.d as f64).sqrt();
    let mut compare = |what: &str, ours: &Tensor, eager: &Tensor, truth: Option<&Tensor>, floor: f64| -> Result<()> {
        ensure!(ours.size() == eager.size(), "{what}: shape {:?}, expected {:?}", ours.size(), eager.size());
        let reference = truth.unwrap_or(eager);
        let nonfinite = |t: &Tensor| t.isfinite().logical_not().sum(Kind::Int64).int64_value(&[]);
        ensure!(
            nonfinite(ours) == nonfinite(reference),
            "{what}: {} non-finite entries, the reference {}",
            nonfinite(ours),
            nonfinite(reference)
        );
        let diff = max_diff(ours, reference);
        let scale = max_abs(reference).max(floor).max(f64::MIN_POSITIVE);
        let eager_error = truth.map_or(0.0, |t| max_diff(eager, t));
        let allowed = (TOLERANCE * unit * scale).max(ACCURACY_RATIO * eager_error);
        largest.note(what, diff / allowed, diff);
        ensure!(
            diff <= allowed,
            "{what} differs by {diff:.3e} (allowed {allowed:.3e}: {unit:.3e} tolerance units of {scale:.3e}; the eager path is off by {eager_error:.3e})"
        );
        Ok(())
    };
    let t = truth.as_ref();
    compare("output", &ours.output, &eager.output, t.map(|t| &t.output), v)?;
    compare("received mass", &ours.mass, &eager.mass, t.map(|t| &t.mass), 1.0)?;
    compare("KL", &ours.kl, &eager.kl, t.map(|t| &t.kl), 0.0)?;
    ensure!(ours.grads.len() == eager.grads.len(), "gradients: {} against {}", ours.grads.len(), eager.grads.len());
    // The parameters' gradients as one vector: one of them may cancel to ~0 exactly.
    let reference_grads = t.map_or(&eager.grads, |t| &t.grads);
    let params = reference_grads.iter().skip(3).filter(|t| t.defined()).map(max_abs).fold(0.0, f64::max);
    for (i, (a, b)) in ours.grads.iter().zip(&eager.grads).enumerate() {
        let (name, floor) = match i {
            0 => ("gradient of q", g * v * k / sqrt_d),
            1 => ("gradient of k", g * v * q / sqrt_d),
            2 => ("gradient of v", g),
            // Σ (O_DNAS − O_softmax) · G over every row: the outputs may nearly cancel.
            _ if built.hnas_logit.is_some() => ("gradient of the HNAS logit", params.max(g * v * (case.dims[0] * case.dims[2]) as f64)),
            // ∂KL/∂a_j sums log π_ij over the rows, terms of size ln S_k or more that cancel.
            _ => ("gradient of the prior", params * (case.dims[0] * case.dims[2]) as f64 * (1.0 + (case.dims[3] as f64).ln())),
        };
        match (a.defined(), b.defined()) {
            (true, true) => compare(name, a, b, t.map(|t| &t.grads[i]), floor)?,
            (false, false) => {}
            (x, y) => bail!("{name}: defined on the memory-efficient path {x}, eager {y}"),
        }
    }
    Ok(())
}

#[test]
fn the_memory_efficient_path_equals_the_eager_path_on_random_inputs() -> Result<()> {
    let cases = env_u64("PROBATTN_PROPERTY_CASES", 300)?;
    let start = env_u64("PROBATTN_PROPERTY_SEED", 0)?;
    let mut largest = Largest::default();
    let mut by_variant: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = vec![];
    for seed in start..start + cases {
        let case = Case::generate(seed);
        if let Err(e) = check_case(&case, &mut largest) {
            failures.push(format!("{case}: {e:#}"));
        }
        *by_variant.entry(case.which.name().split(' ').next().unwrap_or_default().to_string()).or_default() += 1;
    }
    eprintln!("{cases} cases from seed {start}, {} failed: {by_variant:?}", failures.len());
    for (what, (ratio, diff)) in &largest.0 {
        eprintln!("  {what}: largest difference {diff:.2e}, at most {:.1}% of its case's allowance", 100.0 * ratio);
    }
    for failure in &failures {
        eprintln!("FAILED {failure}");
    }
    ensure!(failures.is_empty(), "{} of {cases} cases failed; the first: {}", failures.len(), failures[0]);
    Ok(())
}

#[test]
fn large_scores_keep_every_row_of_received_mass() -> Result<()> {
    // Six one-hot rows with scores in the thousands and a spread of row maxima far beyond
    // exp's range: keys 4, 4, 4, 6, 7, 7 receive masses 0,0,0,0,3,0,1,2, on every route.
    let targets = [4i64, 4, 4, 6, 7, 7];
    let row_scale = [1000.0, 2500.0, 4000.0, 1500.0, 3000.0, 5000.0];
    let q = Tensor::zeros([1, 1, 6, 8], (Kind::Double, Device::Cpu));
    for (i, (&t, &s)) in targets.iter().zip(&row_scale).enumerate() {
        let _ = q.get(0).get(0).get(i as i64).get(t).fill_(s);
    }
    let k = Tensor::eye(8, (Kind::Double, Device::Cpu)).view([1, 1, 8, 8]);
    let v = Tensor::randn([1, 1, 8, 8], (Kind::Double, Device::Cpu));
    let expected = Tensor::from_slice(&[0.0f64, 0.0, 0.0, 0.0, 3.0, 0.0, 1.0, 2.0]).view([1, 1, 8]);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut hnas_vs = vs;
    let hnas = Hnas::new(&hnas_vs.root(), 1, 0.3)?;
    hnas_vs.double();
    let logit = hnas.logit().shallow_clone();
    for tile in [3, 64] {
        for fused_cpu in [true, false] {
            let t = attend_tiled(&q, &k, &v, &Masks::default(), &Tiled::softmax(), TiledOptions { fused_cpu, ..TiledOptions::new(tile) })?;
            let d = max_diff(&t.received_mass, &expected);
            ensure!(d < 1e-9, "softmax, tile {tile}, fused {fused_cpu}: received mass {} (off by {d})", t.received_mass);
        }
    }
    // DNAS, Sinkhorn and HNAS on the same rows: the eager weights' column sums.
    let sinkhorn3 = Sinkhorn::new(3)?;
    let variants: [(&str, Tiled, &dyn Normalizer); 3] =
        [("dnas", Tiled::dnas(), &Dnas), ("sinkhorn-3", Tiled::sinkhorn(3), &sinkhorn3), ("hnas", Tiled::hnas(&logit), &hnas)];
    for (name, variant, eager) in variants {
        let reference = attend(&q, &k, &v, &Masks::default(), eager, Default::default())?.into_weights()?.sum_dim_intlist(
            &[-2i64][..],
            false,
            Kind::Double,
        );
        for fused_cpu in [true, false] {
            let t = attend_tiled(&q, &k, &v, &Masks::default(), &variant, TiledOptions { fused_cpu, ..TiledOptions::new(3) })?;
            let d = max_diff(&t.received_mass, &reference);
            ensure!(d < 1e-9, "{name}, fused {fused_cpu}: received mass {} against {reference} (off by {d})", t.received_mass);
        }
    }
    Ok(())
}
