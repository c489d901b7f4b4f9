//! Graph attention networks (Velickovic et al. 2018), edge-list form: scores per edge, weights
//! normalized over each node's neighbourhood by any probattn normalizer (softmax, DNAS, HNAS,
//! Sinkhorn, BAM), features aggregated with `index_add`, so memory is O(E).
//!
//! Layer: `Wh = x W`, per head `e_ij = LeakyReLU(a_dstᵀ Wh_i + a_srcᵀ Wh_j)` for each edge
//! `i ← j`, `α = normalize(e)` over `i`'s neighbourhood, `h'_i = Σ_j α_ij Wh_j + b`; heads are
//! concatenated (hidden layers, then ELU) or averaged (output layer). As in the original
//! TensorFlow code (PetarV-/GAT, also the base of the BAM authors' code): dropout on the layer
//! input, on the attention weights, and again on `Wh` before aggregation; Glorot-uniform weights
//! per head; zero biases.

use probattn::normalize::{NormalizeInput, Normalizer, Support};
use probattn::precision::{outside_autocast, statistics_kind, widen};
use probattn::{Error, Mode, NormalizerConfig, NormalizerFactory, Result, Variant};
use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

/// The architecture (the training recipe lives with the experiment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatConfig {
    /// Features per head in the hidden layer (8).
    pub hidden: i64,
    /// Heads in the hidden layer (8).
    pub heads: i64,
    /// Heads in the output layer, averaged (1; Pubmed 8).
    pub output_heads: i64,
    /// Dropout on layer inputs and on the projected features (0.6).
    pub dropout: f64,
    /// Dropout on attention weights (0.6).
    pub attention_dropout: f64,
    /// LeakyReLU slope of the scores (0.2).
    pub negative_slope: f64,
    /// How scores become weights over a neighbourhood.
    pub variant: Variant,
    #[serde(default)]
    pub normalizer: NormalizerConfig,
}

impl GatConfig {
    /// Velickovic et al. 2018, Sec. 3.3 (Cora, Citeseer): 8 heads x 8 features, 1 output head.
    pub fn transductive(variant: Variant) -> Self {
        Self {
            hidden: 8,
            heads: 8,
            output_heads: 1,
            dropout: 0.6,
            attention_dropout: 0.6,
            negative_slope: 0.2,
            variant,
            normalizer: NormalizerConfig::default(),
        }
    }

    /// Pubmed (Sec. 3.3): 8 output heads, averaged.
    pub fn pubmed(variant: Variant) -> Self {
        Self { output_heads: 8, ..Self::transductive(variant) }
    }
}

/// A layer's input: dense, or sparse rows (the bag-of-words features of citation graphs, 98.7%
/// zeros on Cora). Dropout on a sparse input drops only its stored entries: zeros stay zeros
/// either way, so the distribution equals dense dropout's, at a fraction of the random draws.
#[derive(Debug)]
pub enum Features {
    /// `(N, F)`
    Dense(Tensor),
    /// The non-zero entries of an `(nodes, features)` matrix, in CSR form.
    Sparse { crow: Tensor, cols: Tensor, values: Tensor, nodes: i64, features: i64 },
}

impl Features {
    /// The non-zero entries of a dense `(N, F)` matrix. libtorch's "Sparse CSR tensor support is
    /// in beta" warning, which its CSR constructor prints once per process, is silenced: the CSR
    /// product here is checked against the dense one (`models/tests/gat.rs`).
    pub fn sparse_from_dense(x: &Tensor) -> Self {
        // Once per thread: c10's warning handler is per thread. A failure leaves the warning
        // printing, which is all it does: not worth failing a run for.
        thread_local!(static SILENCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
        if !SILENCED.replace(true) {
            drop(probattn::device::silence_libtorch_warning("Sparse CSR tensor support is in beta"));
        }
        let nz = x.nonzero(); // (nnz, 2), row-major order
        let (rows, cols) = (nz.select(1, 0).contiguous(), nz.select(1, 1).contiguous());
        let values = x.index(&[Some(&rows), Some(&cols)]);
        let nodes = x.size()[0];
        let crow = rows.internal_convert_indices_from_coo_to_csr(nodes, false);
        Self::Sparse { crow, cols, values, nodes, features: x.size()[1] }
    }

    pub fn nodes(&self) -> i64 {
        match self {
            Self::Dense(x) => x.size()[0],
            Self::Sparse { nodes, .. } => *nodes,
        }
    }

    pub fn features(&self) -> i64 {
        match self {
            Self::Dense(x) => x.size()[1],
            Self::Sparse { features, .. } => *features,
        }
    }

    /// `dropout(x) · weight`, `(N, out)`. The sparse product stays float32 under autocast:
    /// libtorch has no bfloat16 sparse (CSR) product on the CPU.
    fn dropout_matmul(&self, weight: &Tensor, p: f64, train: bool) -> Result<Tensor> {
        match self {
            Self::Dense(x) => Ok(dropout(x, p, train).matmul(weight)),
            Self::Sparse { crow, cols, values, nodes, features } => {
                let x = Tensor::sparse_csr_tensor_crow_col_value_size(
                    crow,
                    cols,
                    &dropout(values, p, train),
                    [*nodes, *features],
                    (values.kind(), values.device()),
                );
                outside_autocast(weight.device(), || Ok(x.mm(weight)))
            }
        }
    }
}

/// Inverted dropout: each entry kept with probability `1 − p` and scaled by `1 / (1 − p)`, the
/// distribution of `Tensor::dropout`, with the mask drawn by `rand` (2.4x cheaper on CPU here than
/// libtorch's `bernoulli_`, which `dropout` uses).
///
/// The uniforms are float32 for a bfloat16 or half `x` (float64 for a float64 one): libtorch's
/// bfloat16 uniform keeps 8 of its 32 random bits, so at p = 0.6 it would keep 102 entries in 256
/// (0.398, not 0.4) and draw other masks than a float32 run of the same seed. Drawn in float32, a
/// bfloat16 run sees the float32 run's masks, as with libtorch's own dropout.
pub fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if !train || p == 0.0 {
        return x.shallow_clone();
    }
    let uniform = match x.kind() {
        Kind::BFloat16 | Kind::Half => Tensor::rand(x.size(), (Kind::Float, x.device())),
        _ => x.rand_like(),
    };
    x * uniform.ge(p).to_kind(x.kind()) * (1.0 / (1.0 - p))
}

/// One graph attention layer.
#[derive(Debug)]
pub struct GatLayer {
    /// `(F_in, H·F_out)`
    weight: Tensor,
    /// `(H, F_out)`
    att_src: Tensor,
    /// `(H, F_out)`
    att_dst: Tensor,
    /// `(H, F_out)`
    bias: Tensor,
    heads: i64,
    out_features: i64,
    concat: bool,
    normalizer: Box<dyn Normalizer>,
}

impl GatLayer {
    /// A layer with `cfg.variant`'s normalizer.
    pub fn new(p: &nn::Path, in_features: i64, out_features: i64, heads: i64, concat: bool, cfg: &GatConfig) -> Result<Self> {
        Self::with_normalizer(p, in_features, out_features, heads, concat, &cfg.variant.factory(&cfg.normalizer))
    }

    /// A layer whose normalizer `make` builds from the layer's path, its heads and its features per
    /// head (a user's own [`Normalizer`]; [`Variant::factory`] for the built-in ones). The
    /// normalizer sees `(H, E)` scores over an edge-list [`Support`].
    pub fn with_normalizer(
        p: &nn::Path,
        in_features: i64,
        out_features: i64,
        heads: i64,
        concat: bool,
        make: &NormalizerFactory,
    ) -> Result<Self> {
        let glorot = |fan_in: i64, fan_out: i64| {
            let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
            nn::Init::Uniform { lo: -bound, up: bound }
        };
        Ok(Self {
            weight: p.var("weight", &[in_features, heads * out_features], glorot(in_features, out_features)),
            att_src: p.var("att_src", &[heads, out_features], glorot(out_features, 1)),
            att_dst: p.var("att_dst", &[heads, out_features], glorot(out_features, 1)),
            bias: p.var("bias", &[heads, out_features], nn::Init::Const(0.0)),
            heads,
            out_features,
            concat,
            normalizer: make(p, heads, out_features)?,
        })
    }

    /// `x (N, F_in)` over the graph's edges; returns `(N, H·F_out)` (concat) or `(N, F_out)`, and the
    /// normalizer's KL (averaged over heads).
    pub fn forward(&self, x: &Features, support: &Support, mode: Mode, cfg: &GatConfig) -> Result<(Tensor, Option<Tensor>)> {
        let edges = support.edges().ok_or_else(|| Error::Config("GAT layers need an edge-list support".into()))?;
        let (n, h, f) = (x.nodes(), self.heads, self.out_features);
        let wh = x.dropout_matmul(&self.weight, cfg.dropout, mode.dropout)?.view([n, h, f]); // (N, H, F)
                                                                                             // Scores in float32 when the product ran in bfloat16 (autocast): attention's statistics.
        let stats = statistics_kind(wh.kind());
        let e_src = (&wh * &self.att_src).sum_dim_intlist(&[-1i64][..], false, stats); // (N, H)
        let e_dst = (&wh * &self.att_dst).sum_dim_intlist(&[-1i64][..], false, stats);
        let e = e_dst.index_select(0, &edges.dst) + e_src.index_select(0, &edges.src); // (E, H)
        let scores = e.maximum(&(&e * cfg.negative_slope)).transpose(0, 1).contiguous(); // LeakyReLU, (H, E)
        let keys = widen(&wh).transpose(0, 1).unsqueeze(0); // (1, H, N, F)
        let normalized =
            self.normalizer.normalize(&NormalizeInput { scores: &scores, support, keys: Some(&keys), noise: None, sample: mode.sample })?;
        let weights = dropout(&normalized.weights, cfg.attention_dropout, mode.dropout); // (H, E)
        let values = dropout(&wh, cfg.dropout, mode.dropout);
        let messages = values.index_select(0, &edges.src) * weights.transpose(0, 1).unsqueeze(-1); // (E, H, F)
        let aggregated = Tensor::zeros([n, h, f], (messages.kind(), wh.device())).index_add(0, &edges.dst, &messages) + &self.bias;
        let out = if self.concat { aggregated.view([n, h * f]) } else { aggregated.mean_dim(&[1i64][..], false, aggregated.kind()) };
        Ok((out, normalized.kl))
    }

    pub fn normalizer(&self) -> &dyn Normalizer {
        self.normalizer.as_ref()
    }
}

/// Two-layer GAT for node classification.
#[derive(Debug)]
pub struct Gat {
    cfg: GatConfig,
    hidden: GatLayer,
    output: GatLayer,
}

/// What [`Gat::forward`] returns.
#[derive(Debug)]
pub struct GatOutput {
    /// `(N, C)` class logits.
    pub logits: Tensor,
    /// The KL of stochastic attention, averaged over all heads of both layers (as the BAM
    /// authors' code averages its per-head terms); `None` for deterministic variants.
    pub kl: Option<Tensor>,
}

impl Gat {
    /// The two layers with `cfg.variant`'s normalizer.
    pub fn new(p: &nn::Path, in_features: i64, classes: i64, cfg: GatConfig) -> Result<Self> {
        let normalizer = cfg.normalizer.clone();
        let make = cfg.variant.factory(&normalizer);
        Self::with_normalizers(p, in_features, classes, cfg, &make)
    }

    /// The two layers with the normalizers `make` builds (see [`GatLayer::with_normalizer`]);
    /// `cfg.variant` and `cfg.normalizer` are then not read.
    pub fn with_normalizers(p: &nn::Path, in_features: i64, classes: i64, cfg: GatConfig, make: &NormalizerFactory) -> Result<Self> {
        let hidden = GatLayer::with_normalizer(&(p / "layer1"), in_features, cfg.hidden, cfg.heads, true, make)?;
        let output = GatLayer::with_normalizer(&(p / "layer2"), cfg.heads * cfg.hidden, classes, cfg.output_heads, false, make)?;
        Ok(Self { cfg, hidden, output })
    }

    pub fn config(&self) -> &GatConfig {
        &self.cfg
    }

    /// `features` of the `N` nodes over `support` (an edge list with self-loops).
    pub fn forward(&self, features: &Features, support: &Support, mode: Mode) -> Result<GatOutput> {
        let (h, kl1) = self.hidden.forward(features, support, mode, &self.cfg)?;
        let (logits, kl2) = self.output.forward(&Features::Dense(h.elu()), support, mode, &self.cfg)?;
        let kl = match (kl1, kl2) {
            (Some(a), Some(b)) => {
                let (h1, h2) = (self.cfg.heads as f64, self.cfg.output_heads as f64);
                Some((a * h1 + b * h2) / (h1 + h2))
            }
            _ => None,
        };
        Ok(GatOutput { logits, kl })
    }
}
