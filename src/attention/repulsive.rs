//! Repulsive multi-head attention (An et al., EMNLP 2020): the heads of an attention module are
//! particles of a posterior, moved by Stein variational gradient descent (SVGD) or stochastic
//! particle-optimization sampling (SPOS) instead of independent gradient steps.
//!
//! [`RepulsiveHook::apply`] runs between `backward()` and the optimizer's `step()`: it replaces the
//! gradients of the chosen particle sets with the SVGD (or SPOS) direction, so any tch optimizer
//! then applies it; every other parameter keeps its ordinary gradient. With `g_j = ∂loss/∂θ_j`,
//! kernel `K_ij = exp(−‖θ_i − θ_j‖² / h)`, and `h = med / log(n + 1)` where `med` is the lower
//! median (torch's `median`) of the `n × n` matrix of squared distances, zero diagonal included,
//! as in the authors' code:
//!
//! `g̃_i = stepsize · (1/n) Σ_j [K_ij g_j − α K_ij (θ_i − θ_j) · 2/h]`
//!
//! and SPOS adds `β g_i − sqrt(2β / stepsize) · ξ_i · median|g|` inside the bracket's total
//! (ξ ~ N(0,1) from libtorch's generator, `median|g|` over the whole set) before the `stepsize`
//! factor. Descent along `g̃` pulls particles to the data and pushes them apart.
//! Formulas and the authors' choices: docs/formulas.md §3.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::mha::MultiHeadAttention;
use crate::{Error, Result};

/// SVGD or SPOS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    Svgd,
    Spos,
}

/// How the kernel bandwidth `h` is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bandwidth {
    /// `h = med / log(n + 1)`, med the lower median of the squared pairwise distances.
    Median,
    /// A fixed `h > 0`.
    Fixed(f64),
}

/// Settings of the direction. Defaults: the paper's translation values (Appendix B.2.3, for
/// IWSLT14 and WMT14 alike: step size 0.1, repulsive weight α = 0.01), β = 1 for SPOS, median
/// bandwidth. Other tasks used others (ELECTRA α 0.1, step size 0.01; Yelp α 1; a grid search for
/// cyberbullying, B.2.2): tune α on validation data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RepulsiveConfig {
    pub method: Method,
    /// Weight α of the repulsive (kernel-gradient) term.
    pub alpha: f64,
    /// The step size the direction is scaled by (and SPOS's noise scale divides by).
    pub stepsize: f64,
    /// SPOS's weight β of the plain gradient and of the noise.
    pub beta: f64,
    pub bandwidth: Bandwidth,
}

impl Default for RepulsiveConfig {
    fn default() -> Self {
        Self { method: Method::Svgd, alpha: 0.01, stepsize: 0.1, beta: 1.0, bandwidth: Bandwidth::Median }
    }
}

impl RepulsiveConfig {
    pub fn validate(&self) -> Result<()> {
        let finite = self.alpha.is_finite() && self.alpha >= 0.0 && self.beta.is_finite() && self.beta >= 0.0;
        if !(finite && self.stepsize > 0.0 && self.stepsize.is_finite()) {
            return Err(Error::Config(format!("repulsive attention needs alpha >= 0, beta >= 0 and stepsize > 0, got {self:?}")));
        }
        if let Bandwidth::Fixed(h) = self.bandwidth {
            if !(h > 0.0 && h.is_finite()) {
                return Err(Error::Config(format!("a fixed bandwidth must be positive, got {h}")));
            }
        }
        Ok(())
    }
}

/// The smallest bandwidth used: identical particles (median distance 0) give `h = 0`, where the
/// repulsive term is 0 anyway; the floor keeps `K` and `2/h` finite.
const MIN_BANDWIDTH: f64 = 1e-30;

/// The direction for `S` particle sets at once: `theta` and `grad` are `(S, n, D)`; returns
/// `(S, n, D)`. `xi` (same shape) is SPOS's noise; drawn when `None`.
pub fn direction(theta: &Tensor, grad: &Tensor, cfg: &RepulsiveConfig, xi: Option<&Tensor>) -> Result<Tensor> {
    cfg.validate()?;
    if theta.dim() != 3 || theta.size() != grad.size() {
        return Err(Error::Shape(format!(
            "particles {:?} and gradients {:?} must both be (sets, particles, features)",
            theta.size(),
            grad.size()
        )));
    }
    let (sets, n) = (theta.size()[0], theta.size()[1]);
    let kind = theta.kind();
    // Everything below is translation invariant, so it runs on particles centred on the first
    // one: identical particles then cancel exactly (2/h is huge when h is tiny) and rounding is
    // that of the differences, not of θ.
    let c = theta - theta.narrow(1, 0, 1); // (S, n, D)
    let gram = c.matmul(&c.transpose(1, 2)); // (S, n, n)
    let sq = gram.diagonal(0, 1, 2); // (S, n)
    let d2 = (sq.unsqueeze(2) + sq.unsqueeze(1) - gram * 2.0).clamp_min(0.0); // ‖θ_i − θ_j‖²
    let h = match cfg.bandwidth {
        Bandwidth::Median => d2.view([sets, n * n]).median_dim(1, true).0.unsqueeze(-1) / ((n + 1) as f64).ln(),
        Bandwidth::Fixed(h) => Tensor::full([sets, 1, 1], h, (kind, theta.device())),
    }
    .clamp_min(MIN_BANDWIDTH); // (S, 1, 1)

    // K (S, n, n). Σ_j K_ij (θ_i − θ_j) = (Σ_j K_ij) c_i − (K c)_i, formed before it meets the
    // gradient: when h is tiny, 2α/h is huge and only this exact cancellation keeps g's digits.
    let k = (-&d2 / &h).exp();
    let repulsion = k.sum_dim_intlist(&[-1i64][..], true, kind) * &c - k.matmul(&c); // (S, n, D)
    let mut total = (k.matmul(grad) - repulsion * ((2.0 * cfg.alpha) / &h)) * (cfg.stepsize / n as f64);
    if cfg.method == Method::Spos {
        let xi = match xi {
            Some(xi) => xi.shallow_clone(),
            None => grad.randn_like(),
        };
        let median_abs = grad.abs().view([sets, -1]).median_dim(1, true).0.unsqueeze(-1); // (S, 1, 1)
        total += (grad * cfg.beta - xi * median_abs * (2.0 * cfg.beta / cfg.stepsize).sqrt()) * cfg.stepsize;
    }
    Ok(total)
}

/// Which attention module a set belongs to; the paper's ablations select by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModuleKind {
    EncoderSelf,
    DecoderSelf,
    Cross,
    /// Any other module (a sentence classifier's hops, a GAT layer, ...).
    Other,
}

/// Which projection of a multi-head attention module a set is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Projection {
    Q,
    K,
    V,
}

/// Which sets to register; `None` = all. E.g. the ablation "first layer only, Q only" is
/// `layers: Some(vec![0]), projections: Some(vec![Projection::Q])`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Selection {
    pub kinds: Option<Vec<ModuleKind>>,
    pub layers: Option<Vec<usize>>,
    pub projections: Option<Vec<Projection>>,
}

impl Selection {
    pub fn accepts(&self, kind: ModuleKind, layer: usize, projection: Option<Projection>) -> bool {
        // map_or rather than is_none_or: the crate supports Rust 1.80.
        self.kinds.as_ref().map_or(true, |k| k.contains(&kind))
            && self.layers.as_ref().map_or(true, |l| l.contains(&layer))
            && match (projection, &self.projections) {
                (Some(p), Some(ps)) => ps.contains(&p),
                _ => true,
            }
    }
}

/// One particle set: `particles` blocks of `rows` consecutive rows of a parameter, starting at
/// row `offset`; particle `i` is its block flattened.
#[derive(Debug)]
pub struct ParticleSet {
    pub name: String,
    pub kind: ModuleKind,
    pub layer: usize,
    pub projection: Option<Projection>,
    param: Tensor,
    offset: i64,
    particles: i64,
    rows: i64,
}

impl ParticleSet {
    /// Views `(count, n, D)` of the particles of this set and the `count − 1` sets after it in the
    /// same parameter, and of their gradient (sharing the gradient's storage).
    fn views(&self, count: i64) -> Result<(Tensor, Tensor)> {
        let grad = self.param.grad();
        if !grad.defined() {
            return Err(Error::Config(format!("{} has no gradient: run backward() before the hook", self.name)));
        }
        let rows = count * self.particles * self.rows;
        // A view, not a copy: the hook writes the gradient through it. A parameter (or gradient)
        // laid out so that its rows cannot be seen as particles is named, not a panic.
        let view = |what: &str, t: &Tensor| {
            t.narrow(0, self.offset, rows).f_view([count, self.particles, -1]).map_err(|e| {
                Error::Shape(format!(
                    "{}'s {what} {:?} (strides {:?}) cannot be viewed as {count} × {} particles without a copy: {}",
                    self.name,
                    t.size(),
                    t.stride(),
                    self.particles,
                    crate::libtorch_message(&e.to_string())
                ))
            })
        };
        Ok((view("parameter", &self.param)?, view("gradient", &grad)?))
    }
}

/// The gradient hook: call [`RepulsiveHook::apply`] after `backward()`, before `step()`.
///
/// ```
/// use probattn::repulsive::{ModuleKind, RepulsiveConfig, RepulsiveHook, Selection};
/// use probattn::{MhaConfig, MhaInput, MultiHeadAttention};
/// use tch::nn::{self, OptimizerConfig};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mha = MultiHeadAttention::new(&(vs.root() / "attn"), MhaConfig::new(16, 4))?;
/// // The paper's translation values (step size 0.1, α = 0.01); every head of every module.
/// let mut hook = RepulsiveHook::new(RepulsiveConfig::default(), Selection::default())?;
/// hook.add_attention("attn", &mha, ModuleKind::EncoderSelf, 0);
/// assert_eq!(hook.sets().len(), 3); // Q, K and V, four particles (heads) each
///
/// let mut adam = nn::Adam::default().build(&vs, 1e-3)?;
/// let x = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu));
/// let loss = mha.forward_t(&MhaInput::self_attention(&x), true)?.context.square().mean(Kind::Float);
/// adam.zero_grad();
/// loss.backward();
/// hook.apply()?; // the heads' gradients become the SVGD direction
/// adam.step();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct RepulsiveHook {
    cfg: RepulsiveConfig,
    selection: Selection,
    sets: Vec<ParticleSet>,
}

impl RepulsiveHook {
    pub fn new(cfg: RepulsiveConfig, selection: Selection) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg, selection, sets: vec![] })
    }

    pub fn config(&self) -> &RepulsiveConfig {
        &self.cfg
    }

    pub fn sets(&self) -> &[ParticleSet] {
        &self.sets
    }

    /// The distinct parameters whose gradients [`Self::apply`] rewrites (a distributed run
    /// broadcasts SPOS's noisy direction through them).
    pub fn params(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = vec![];
        for set in &self.sets {
            if !out.iter().any(|p| p.data_ptr() == set.param.data_ptr()) {
                out.push(set.param.shallow_clone());
            }
        }
        out
    }

    /// Registers the Q, K and V projection weights of `mha` that the selection accepts: in each,
    /// particle `h` is the `d_h` rows of head `h`. Biases and the output projection are not
    /// particles.
    pub fn add_attention(&mut self, name: &str, mha: &MultiHeadAttention, kind: ModuleKind, layer: usize) {
        let (heads, head_dim) = (mha.config().num_heads, mha.config().head_dim());
        for (i, projection) in [Projection::Q, Projection::K, Projection::V].into_iter().enumerate() {
            let (param, offset) = mha.projection_param(i as i64);
            self.add_projection(name, param, offset, heads, head_dim, kind, layer, projection);
        }
    }

    /// Registers a packed `in_proj_weight (3E, E)` of any module (a TorchScript module's
    /// `nn.MultiheadAttention`, say) as the Q, K and V sets of `heads` particles each, as
    /// [`Self::add_attention`] registers a native module's.
    pub fn add_in_proj(&mut self, name: &str, in_proj_weight: &Tensor, heads: i64, kind: ModuleKind, layer: usize) -> Result<()> {
        let size = in_proj_weight.size();
        if size.len() != 2 || size[0] != 3 * size[1] {
            return Err(Error::Shape(format!("{name} has shape {size:?}; a packed in_proj_weight is (3E, E)")));
        }
        let e = size[1];
        if heads < 1 || e % heads != 0 {
            return Err(Error::Config(format!("{name}: {heads} heads do not divide E = {e}")));
        }
        for (i, projection) in [Projection::Q, Projection::K, Projection::V].into_iter().enumerate() {
            self.add_projection(name, in_proj_weight.shallow_clone(), i as i64 * e, heads, e / heads, kind, layer, projection);
        }
        Ok(())
    }

    /// Registers one projection weight `(E, ·)` of `heads` heads (the separate `q_proj_weight`,
    /// `k_proj_weight` or `v_proj_weight` that `nn.MultiheadAttention` keeps when kdim or vdim
    /// differ from E): particle `h` is the `E / heads` rows of head `h`.
    pub fn add_projection_weight(
        &mut self,
        name: &str,
        weight: &Tensor,
        heads: i64,
        kind: ModuleKind,
        layer: usize,
        projection: Projection,
    ) -> Result<()> {
        let size = weight.size();
        if size.len() != 2 || heads < 1 || size[0] % heads != 0 {
            return Err(Error::Shape(format!(
                "{name} has shape {size:?}; a projection weight of {heads} heads is (E, ·) with E divisible by {heads}"
            )));
        }
        self.add_projection(name, weight.shallow_clone(), 0, heads, size[0] / heads, kind, layer, projection);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn add_projection(
        &mut self,
        name: &str,
        param: Tensor,
        offset: i64,
        heads: i64,
        head_dim: i64,
        kind: ModuleKind,
        layer: usize,
        projection: Projection,
    ) {
        if self.selection.accepts(kind, layer, Some(projection)) {
            self.sets.push(ParticleSet {
                name: format!("{name}.{projection:?}").to_lowercase(),
                kind,
                layer,
                projection: Some(projection),
                param,
                offset,
                particles: heads,
                rows: head_dim,
            });
        }
    }

    /// Registers a matrix whose rows are the particles (the hops `W_s2` of a self-attentive
    /// sentence embedding), if the selection accepts `kind` and `layer`.
    pub fn add_rows(&mut self, name: &str, param: &Tensor, kind: ModuleKind, layer: usize) -> Result<()> {
        if param.dim() < 2 {
            return Err(Error::Shape(format!("{name} has shape {:?}; rows as particles need a matrix", param.size())));
        }
        if self.selection.accepts(kind, layer, None) {
            let particles = param.size()[0];
            self.sets.push(ParticleSet {
                name: name.into(),
                kind,
                layer,
                projection: None,
                param: param.shallow_clone(),
                offset: 0,
                particles,
                rows: 1,
            });
        }
        Ok(())
    }

    /// Replaces the gradients of every registered set with the direction. Consecutive sets of
    /// one parameter (the Q, K and V blocks of an `in_proj_weight`) are processed together, as a
    /// view of the parameter and of its gradient: no copies, and nothing goes to the host.
    pub fn apply(&self) -> Result<()> {
        tch::no_grad(|| {
            for block in self.blocks() {
                let (theta, mut grad) = block[0].views(block.len() as i64)?;
                let dir = direction(&theta, &grad, &self.cfg, None)?;
                grad.copy_(&dir);
            }
            Ok(())
        })
    }

    /// Runs of registered sets that are consecutive rows of one parameter with one shape.
    fn blocks(&self) -> Vec<Vec<&ParticleSet>> {
        let mut blocks: Vec<Vec<&ParticleSet>> = vec![];
        for set in &self.sets {
            if let Some(last) = blocks.last_mut().and_then(|b| b.last().copied()) {
                let adjacent = last.param.data_ptr() == set.param.data_ptr()
                    && (last.particles, last.rows) == (set.particles, set.rows)
                    && last.offset + last.particles * last.rows == set.offset;
                if let (true, Some(block)) = (adjacent, blocks.last_mut()) {
                    block.push(set);
                    continue;
                }
            }
            blocks.push(vec![set]);
        }
        blocks
    }
}

/// The paper's head-diversity metric "Dist": the average L2 distance between the output
/// representations of each pair of heads. `heads` is `(B, H, S, d)` (per-head attention outputs,
/// [`crate::MhaOutput::head_outputs`]); averaged over the `H(H−1)/2` pairs and over the tokens
/// `valid` marks (`(B, S)`, `true` = counted; `None`: all).
pub fn head_diversity(heads: &Tensor, valid: Option<&Tensor>) -> Result<f64> {
    let size = heads.size();
    if size.len() != 4 || size[1] < 2 {
        return Err(Error::Shape(format!("head outputs have shape {size:?}; expected (B, H >= 2, S, d)")));
    }
    let (b, h, s) = (size[0], size[1], size[2]);
    let per_token = heads.transpose(1, 2).to_kind(Kind::Double); // (B, S, H, d)
    let dist = Tensor::cdist(&per_token, &per_token, 2.0, 2i64); // (B, S, H, H)
    let pairs = dist.sum_dim_intlist(&[-1i64, -2][..], false, Kind::Double) / (h * (h - 1)) as f64; // (B, S)
    let mean = match valid {
        Some(v) => {
            if v.size() != [b, s] {
                return Err(Error::Shape(format!("valid has shape {:?}, expected [{b}, {s}]", v.size())));
            }
            let v = v.to_kind(Kind::Double).to_device(heads.device());
            (pairs * &v).sum(Kind::Double) / v.sum(Kind::Double).clamp_min(1.0)
        }
        None => pairs.mean(Kind::Double),
    };
    Ok(f64::try_from(mean)?)
}
