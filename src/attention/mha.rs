//! Multi-head attention with a pluggable normalizer (Vaswani et al. 2017, Sec. 3.2.2):
//! `MultiHead(Q, K, V) = Concat(head_1..head_H) W_O`, `head_h = Attend(Q W_Q^h, K W_K^h, V W_V^h)`,
//! where `Attend` is [`crate::attend`] with any [`crate::normalize::Normalizer`].
//!
//! Batch-first `(B, S, E)` tensors. Parameters carry the names of PyTorch's
//! `nn.MultiheadAttention` state dict, so a PyTorch checkpoint saved as safetensors loads by name:
//! `in_proj_weight (3E, E)` (or `q_proj_weight`, `k_proj_weight`, `v_proj_weight` when `kdim` or
//! `vdim` differ from `E`), `in_proj_bias (3E)`, `out_proj.weight (E, E)`, `out_proj.bias (E)`;
//! HNAS adds `hybrid_logit (H)`. PyTorch's `add_bias_kv` and `add_zero_attn` are not supported.
//! Unlike PyTorch, the returned weights are per head, `(B, H, S_q, S_k)`, and taken before dropout.

use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

use crate::attention::seam::attend_any_layout;
use crate::call::{AttendOptions, Mode};
use crate::mask::Masks;
use crate::normalize::{Normalizer, NormalizerConfig, Variant};
use crate::param::param;
use crate::{Error, Result};

/// Configuration of a [`MultiHeadAttention`] layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MhaConfig {
    /// Model width E (query features and output features).
    pub embed_dim: i64,
    /// Number of heads H; must divide `embed_dim`.
    pub num_heads: i64,
    /// Key features (default: `embed_dim`).
    #[serde(default)]
    pub kdim: Option<i64>,
    /// Value features (default: `embed_dim`).
    #[serde(default)]
    pub vdim: Option<i64>,
    /// Dropout on the attention weights, in training mode (default 0).
    #[serde(default)]
    pub dropout: f64,
    /// Biases on the input and output projections (default true).
    #[serde(default = "default_bias")]
    pub bias: bool,
    /// The normalizer (default softmax).
    #[serde(default)]
    pub variant: Variant,
    /// The normalizer's settings.
    #[serde(default)]
    pub normalizer: NormalizerConfig,
    /// `Some(t)`: memory-efficient attention ([`crate::tiled`]), `t` queries at a time, whenever
    /// no weights are asked for: nothing `(S_q, S_k)` is kept for the backward pass. Every variant
    /// has a tiled form; attention dropout in training is refused by name. BAM's noise comes from a counter-based generator (a given draw is
    /// honoured). `None` (default): the eager path.
    #[serde(default)]
    pub tile: Option<i64>,
}

fn default_bias() -> bool {
    true
}

impl MhaConfig {
    /// `embed_dim` and `num_heads`; everything else at PyTorch's defaults and softmax weights.
    pub fn new(embed_dim: i64, num_heads: i64) -> Self {
        Self {
            embed_dim,
            num_heads,
            kdim: None,
            vdim: None,
            dropout: 0.0,
            bias: true,
            variant: Variant::Softmax,
            normalizer: NormalizerConfig::default(),
            tile: None,
        }
    }

    pub fn with_variant(mut self, variant: Variant) -> Self {
        self.variant = variant;
        self
    }

    /// The memory-efficient path, `tile` queries at a time (see [`Self::tile`]).
    pub fn with_tile(mut self, tile: i64) -> Self {
        self.tile = Some(tile);
        self
    }

    /// Features per head, `E / H`.
    pub fn head_dim(&self) -> i64 {
        self.embed_dim / self.num_heads
    }

    pub fn kdim(&self) -> i64 {
        self.kdim.unwrap_or(self.embed_dim)
    }

    pub fn vdim(&self) -> i64 {
        self.vdim.unwrap_or(self.embed_dim)
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.embed_dim < 1 || self.num_heads < 1 || self.kdim() < 1 || self.vdim() < 1 {
            return bad(format!("sizes must be positive: {self:?}"));
        }
        if self.embed_dim % self.num_heads != 0 {
            return bad(format!("embed_dim {} is not divisible by num_heads {}", self.embed_dim, self.num_heads));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("dropout must lie in [0, 1), got {}", self.dropout));
        }
        if let Some(tile) = self.tile {
            if tile < 1 {
                return bad(format!("the memory-efficient tile must be at least 1 query, got {tile}"));
            }
        }
        Ok(())
    }
}

/// The input projection weights, in PyTorch's two layouts.
#[derive(Debug)]
enum InProj {
    /// `in_proj_weight (3E, E)`: rows `[0, E)` project queries, `[E, 2E)` keys, `[2E, 3E)` values.
    Packed(Tensor),
    /// `q_proj_weight (E, E)`, `k_proj_weight (E, kdim)`, `v_proj_weight (E, vdim)`.
    Separate { q: Tensor, k: Tensor, v: Tensor },
}

/// One multi-head attention layer.
#[derive(Debug)]
pub struct MultiHeadAttention {
    cfg: MhaConfig,
    in_proj: InProj,
    in_proj_bias: Option<Tensor>,
    out_proj_weight: Tensor,
    out_proj_bias: Option<Tensor>,
    normalizer: Box<dyn Normalizer>,
}

/// The input of [`MultiHeadAttention::forward_t`].
#[derive(Debug, Clone, Copy)]
pub struct MhaInput<'a> {
    /// `(B, S_q, E)`.
    pub query: &'a Tensor,
    /// `(B, S_k, kdim)`.
    pub key: &'a Tensor,
    /// `(B, S_k, vdim)`.
    pub value: &'a Tensor,
    pub masks: Masks<'a>,
    /// Return the per-head weights.
    pub need_weights: bool,
    /// Return the per-head outputs before the output projection (for [`crate::repulsive::head_diversity`]).
    pub need_head_outputs: bool,
    /// A fixed noise draw for stochastic normalizers, `(B, H, S_q, S_k)`.
    pub noise: Option<&'a Tensor>,
    /// The key of the memory-efficient path's draws for stochastic normalizers (None: libtorch's
    /// generator), as [`AttendOptions::seed`] takes it.
    pub seed: Option<u64>,
}

impl<'a> MhaInput<'a> {
    /// Self-attention: queries, keys and values are all `x (B, S, E)`.
    pub fn self_attention(x: &'a Tensor) -> Self {
        Self::new(x, x, x)
    }

    /// Cross-attention: `query (B, S_q, E)` attends to `memory (B, S_k, E)`.
    pub fn cross_attention(query: &'a Tensor, memory: &'a Tensor) -> Self {
        Self::new(query, memory, memory)
    }

    pub fn new(query: &'a Tensor, key: &'a Tensor, value: &'a Tensor) -> Self {
        Self { query, key, value, masks: Masks::default(), need_weights: false, need_head_outputs: false, noise: None, seed: None }
    }

    pub fn with_masks(mut self, masks: Masks<'a>) -> Self {
        self.masks = masks;
        self
    }

    pub fn with_weights(mut self) -> Self {
        self.need_weights = true;
        self
    }

    pub fn with_head_outputs(mut self) -> Self {
        self.need_head_outputs = true;
        self
    }
}

/// The output of [`MultiHeadAttention::forward_t`].
#[derive(Debug)]
pub struct MhaOutput {
    /// `(B, S_q, E)`.
    pub context: Tensor,
    /// `(B, H, S_q, S_k)` when asked for.
    pub weights: Option<Tensor>,
    /// The normalizer's KL term (stochastic normalizers in training mode).
    pub kl: Option<Tensor>,
    /// `(B, H, S_q, d_h)` per-head outputs before the output projection, when asked for.
    pub head_outputs: Option<Tensor>,
}

impl MultiHeadAttention {
    /// Creates the parameters under `p`, initialised as PyTorch initialises
    /// `nn.MultiheadAttention` (Xavier-uniform input projections, zero biases, Kaiming-uniform
    /// output projection), and the normalizer of `cfg.variant`.
    pub fn new(p: &nn::Path, cfg: MhaConfig) -> Result<Self> {
        Self::build(p, cfg, |cfg| cfg.variant.build(p, cfg.num_heads, cfg.head_dim(), &cfg.normalizer))
    }

    /// [`Self::new`] with any normalizer in place of `cfg.variant`'s (`cfg.variant` and
    /// `cfg.normalizer` are then not read): a user's own [`Normalizer`] goes through the same
    /// projections, masks, dropout and fused or memory-efficient paths as the built-in ones.
    ///
    /// ```
    /// use probattn::normalize::Normalizer;
    /// use probattn::tiled::Tiled;
    /// use probattn::{MhaConfig, MhaInput, MultiHeadAttention};
    /// use tch::{nn, Device, Kind, Tensor};
    ///
    /// /// Softmax at temperature `t`, `π_ij ∝ exp(z_ij / t)`: no sweeps, a score scale of `1/t`.
    /// /// The plan is the whole definition: eager, memory-efficient and causal-safe follow from it.
    /// #[derive(Debug)]
    /// struct Tempered(f64);
    ///
    /// impl Normalizer for Tempered {
    ///     fn name(&self) -> String {
    ///         format!("tempered-{}", self.0)
    ///     }
    ///     fn tiled(&self) -> Option<Tiled<'_>> {
    ///         Some(Tiled { score_scale: 1.0 / self.0, ..Tiled::sweeps(self.name(), 0) })
    ///     }
    /// }
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let mha = MultiHeadAttention::with_normalizer(&vs.root(), MhaConfig::new(16, 4), Box::new(Tempered(2.0)))?;
    /// let x = Tensor::randn([3, 5, 16], (Kind::Float, Device::Cpu));
    /// let out = mha.forward_t(&MhaInput::self_attention(&x).with_weights(), false)?;
    /// assert_eq!(out.context.size(), [3, 5, 16]);
    /// assert_eq!(out.weights.map(|w| w.size()), Some(vec![3, 4, 5, 5]));
    /// assert_eq!(mha.normalizer().name(), "tempered-2");
    /// # Ok::<(), probattn::Error>(())
    /// ```
    pub fn with_normalizer(p: &nn::Path, cfg: MhaConfig, normalizer: Box<dyn Normalizer>) -> Result<Self> {
        Self::build(p, cfg, |_| Ok(normalizer))
    }

    /// The projections, then the normalizer (in this order, so that seeded initialisations stay
    /// what they were before normalizers could be given).
    fn build(p: &nn::Path, cfg: MhaConfig, normalizer: impl FnOnce(&MhaConfig) -> Result<Box<dyn Normalizer>>) -> Result<Self> {
        cfg.validate()?;
        let e = cfg.embed_dim;
        let xavier = |rows: i64, cols: i64| {
            let bound = (6.0 / (rows + cols) as f64).sqrt();
            nn::Init::Uniform { lo: -bound, up: bound }
        };
        let in_proj = if cfg.kdim() == e && cfg.vdim() == e {
            InProj::Packed(param(p, "in_proj_weight", &[3 * e, e], xavier(3 * e, e))?)
        } else {
            InProj::Separate {
                q: param(p, "q_proj_weight", &[e, e], xavier(e, e))?,
                k: param(p, "k_proj_weight", &[e, cfg.kdim()], xavier(e, cfg.kdim()))?,
                v: param(p, "v_proj_weight", &[e, cfg.vdim()], xavier(e, cfg.vdim()))?,
            }
        };
        let in_proj_bias = cfg.bias.then(|| param(p, "in_proj_bias", &[3 * e], nn::Init::Const(0.0))).transpose()?;
        let out = p / "out_proj";
        let bound = 1.0 / (e as f64).sqrt();
        let out_proj_weight = param(&out, "weight", &[e, e], nn::Init::Uniform { lo: -bound, up: bound })?;
        let out_proj_bias = cfg.bias.then(|| param(&out, "bias", &[e], nn::Init::Const(0.0))).transpose()?;
        let normalizer = normalizer(&cfg)?;
        Ok(Self { cfg, in_proj, in_proj_bias, out_proj_weight, out_proj_bias, normalizer })
    }

    pub fn config(&self) -> &MhaConfig {
        &self.cfg
    }

    pub fn normalizer(&self) -> &dyn Normalizer {
        self.normalizer.as_ref()
    }

    /// The current HNAS mixing weight `u` of each head, `(H,)`; `None` for other normalizers.
    pub fn hybrid_u(&self) -> Option<Tensor> {
        self.normalizer.gate()
    }

    /// The parameter holding the projection weight of queries (`i = 0`), keys (1) or values (2),
    /// and the row where that projection starts in it (`in_proj_weight` packs all three).
    pub fn projection_param(&self, i: i64) -> (Tensor, i64) {
        match &self.in_proj {
            InProj::Packed(w) => (w.shallow_clone(), i * self.cfg.embed_dim),
            InProj::Separate { q, k, v } => ([q, k, v][i as usize].shallow_clone(), 0),
        }
    }

    /// The projection weight of queries (`i = 0`), keys (1) or values (2), `(E, in_features)`.
    pub fn proj_weight(&self, i: i64) -> Tensor {
        let e = self.cfg.embed_dim;
        match &self.in_proj {
            InProj::Packed(w) => w.narrow(0, i * e, e),
            InProj::Separate { q, k, v } => [q, k, v][i as usize].shallow_clone(),
        }
    }

    /// Attends `input.query` to `input.key`/`input.value`. `train` enables dropout and sampling.
    pub fn forward_t(&self, input: &MhaInput, train: bool) -> Result<MhaOutput> {
        self.forward_mode(input, Mode::train(train))
    }

    /// [`Self::forward_t`] with dropout and sampling chosen separately (Monte Carlo prediction
    /// samples attention without dropout: [`Mode::MONTE_CARLO`]).
    pub fn forward_mode(&self, input: &MhaInput, mode: Mode) -> Result<MhaOutput> {
        let (_, sq, _) = self.check(input)?;
        let params = self.in_proj_params();
        let (query, key, value) = cast_once(input)?;
        let q = self.project(&query, 0, &params); // (B, H, S_q, d_h)
        let k = self.project(&key, 1, &params); // (B, H, S_k, d_h)
        let v = self.project(&value, 2, &params);
        self.attend_heads(&q, &k, &v, sq, input, mode)
    }

    /// Projects `key (B, S_k, kdim)` and `value (B, S_k, vdim)` into per-head keys and values,
    /// `(B, H, S_k, d_h)` each: what an incremental decoder caches, so that a step projects only
    /// the new token (self-attention) or nothing at all (cross-attention).
    pub fn project_kv(&self, key: &Tensor, value: &Tensor) -> (Tensor, Tensor) {
        let params = self.in_proj_params();
        (self.project(key, 1, &params), self.project(value, 2, &params))
    }

    /// Attends `input.query (B, S_q, E)` to keys and values already projected by
    /// [`Self::project_kv`], `(B, H, S_k, d_h)`; `input.key` and `input.value` are not read.
    /// Equals [`Self::forward_mode`] on the unprojected keys and values.
    pub fn forward_projected(&self, input: &MhaInput, k: &Tensor, v: &Tensor, mode: Mode) -> Result<MhaOutput> {
        let size = input.query.size();
        let (h, dh) = (self.cfg.num_heads, self.cfg.head_dim());
        if size.len() != 3 || size[2] != self.cfg.embed_dim {
            return Err(Error::Shape(format!("query has shape {size:?}; expected (B, S, {})", self.cfg.embed_dim)));
        }
        if k.size() != v.size() || k.dim() != 4 || k.size()[0] != size[0] || k.size()[1] != h || k.size()[3] != dh {
            return Err(Error::Shape(format!(
                "projected keys {:?} and values {:?} must both be (B = {}, H = {h}, S_k, {dh})",
                k.size(),
                v.size(),
                size[0]
            )));
        }
        let q = self.project(input.query, 0, &self.in_proj_params());
        self.attend_heads(&q, k, v, size[1], input, mode)
    }

    /// `[W_Q, W_K, W_V]` and their biases. One split of the packed parameters (one backward node
    /// that writes the packed gradient once), not three narrows (three zero-filled gradients).
    fn in_proj_params(&self) -> (Vec<Tensor>, Option<Vec<Tensor>>) {
        let weights = match &self.in_proj {
            InProj::Packed(w) => w.split(self.cfg.embed_dim, 0),
            InProj::Separate { q, k, v } => vec![q.shallow_clone(), k.shallow_clone(), v.shallow_clone()],
        };
        (weights, self.in_proj_bias.as_ref().map(|b| b.split(self.cfg.embed_dim, 0)))
    }

    /// `x (B, S, ·)` projected by the query (`i` = 0), key (1) or value (2) projection, heads
    /// split: `(B, H, S, d_h)`.
    ///
    /// A time-first tensor seen batch-first (a transposed view of a contiguous `(S, B, ·)`, as a
    /// PyTorch user's `nn.MultiheadAttention` inputs arrive) is projected in its own layout: the
    /// linear map needs no copy of it, and its heads come out in a layout whose batch and head
    /// dimensions merge into one, so the score products batch them without copies either.
    fn project(&self, x: &Tensor, i: usize, (weights, biases): &(Vec<Tensor>, Option<Vec<Tensor>>)) -> Tensor {
        let (w, b) = (&weights[i], biases.as_ref().map(|b| &b[i]));
        let projected = if x.dim() == 3 && !x.is_contiguous() && x.transpose(0, 1).is_contiguous() {
            x.transpose(0, 1).linear(w, b).transpose(0, 1)
        } else {
            x.linear(w, b)
        };
        self.split_heads(&projected)
    }

    /// `(B, S, E)` → `(B, H, S, d_h)`. `x` is a projection's output (`project`), never a
    /// caller's tensor, and `view` splits only its last dimension, which any layout allows.
    fn split_heads(&self, x: &Tensor) -> Tensor {
        let size = x.size();
        x.view([size[0], size[1], self.cfg.num_heads, self.cfg.head_dim()]).transpose(1, 2)
    }

    /// The normalizer, the value mixing and the output projection, from per-head `q`, `k`, `v`:
    /// one call to [`crate::attend`], which picks the memory-efficient, fused or general path.
    fn attend_heads(&self, q: &Tensor, k: &Tensor, v: &Tensor, sq: i64, input: &MhaInput, mode: Mode) -> Result<MhaOutput> {
        let (b, e) = (q.size()[0], self.cfg.embed_dim);
        let opts = AttendOptions {
            mode,
            dropout: self.cfg.dropout,
            noise: input.noise,
            need_weights: input.need_weights,
            tile: self.cfg.tile,
            seed: input.seed,
            ..Default::default()
        };
        let (attended, _) = attend_any_layout(q, k, v, &input.masks, self.normalizer.as_ref(), opts)?;
        let output = attended.output; // (B, H, S_q, d_h)
        let merged = output.transpose(1, 2).contiguous().view([b, sq, e]); // (B, S_q, E)
        let context = merged.linear(&self.out_proj_weight, self.out_proj_bias.as_ref());
        let head_outputs = input.need_head_outputs.then(|| output.contiguous());
        Ok(MhaOutput { context, weights: attended.weights, kl: attended.kl, head_outputs })
    }

    /// Checks the input's shapes; returns `(B, S_q, S_k)`.
    fn check(&self, input: &MhaInput) -> Result<(i64, i64, i64)> {
        let expect =
            [("query", input.query, self.cfg.embed_dim), ("key", input.key, self.cfg.kdim()), ("value", input.value, self.cfg.vdim())];
        for (name, t, features) in expect {
            let size = t.size();
            if size.len() != 3 || size[2] != features {
                return Err(Error::Shape(format!("{name} has shape {size:?}; expected (B, S, {features}) (batch first)")));
            }
        }
        let (q, k, v) = (input.query.size(), input.key.size(), input.value.size());
        if q[0] != k[0] || q[0] != v[0] {
            return Err(Error::Shape(format!("query {q:?}, key {k:?} and value {v:?} differ in batch size")));
        }
        if k[1] != v[1] {
            return Err(Error::Shape(format!("key {k:?} and value {v:?} differ in sequence length")));
        }
        Ok((q[0], q[1], k[1]))
    }
}

/// The query, key and value the projections read. Under autocast, a float32 tensor that several
/// of them share (self-attention's one input, cross-attention's memory as keys and values) is cast
/// to autocast's dtype once: autocast casts the input of every linear map anew (it caches the
/// casts of leaf tensors only), and each map keeps its copy for its weight gradient.
fn cast_once(input: &MhaInput) -> Result<(Tensor, Tensor, Tensor)> {
    let (q, k, v) = (input.query, input.key, input.value);
    let shared = std::ptr::eq(q, k) || std::ptr::eq(k, v) || std::ptr::eq(q, v);
    let kind = if shared { crate::precision::autocast_kind(q.device())? } else { None };
    let Some(kind) = kind else {
        return Ok((q.shallow_clone(), k.shallow_clone(), v.shallow_clone()));
    };
    let lower = |t: &Tensor| if t.kind() == tch::Kind::Float { t.to_kind(kind) } else { t.shallow_clone() };
    let query = lower(q);
    let key = if std::ptr::eq(k, q) { query.shallow_clone() } else { lower(k) };
    let value = if std::ptr::eq(v, k) {
        key.shallow_clone()
    } else if std::ptr::eq(v, q) {
        query.shallow_clone()
    } else {
        lower(v)
    };
    Ok((query, key, value))
}

/// Self-attention of `x (B, S, E)` with no mask, for composing with tch's `nn` (`x.apply_t(&mha,
/// train)`, `nn::seq_t`); the context `(B, S, E)`. tch's trait returns no `Result`, so an input
/// [`MultiHeadAttention::forward_t`] would reject panics here with that error's message: use the
/// inherent method for masks, cross-attention, weights and errors as values.
impl nn::ModuleT for MultiHeadAttention {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        match MultiHeadAttention::forward_t(self, &MhaInput::self_attention(xs), train) {
            Ok(out) => out.context,
            Err(err) => panic!("MultiHeadAttention as nn::ModuleT: {err}"),
        }
    }
}
