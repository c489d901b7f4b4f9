//! Multi-view VQA: the DNAS paper's fusion of several detectors' box features (Ding et al. 2020,
//! Sec. 6.1 and Appendix B), then a Pythia-lite answer head.
//!
//! Fusion. View 0 is the *primary* detector, views 1.. the *secondary* ones. The primary boxes
//! give the queries `q_i = Q x^P_i`; each secondary view `s` gives keys `k^s_j = K_s x^s_j` and
//! its features, untransformed, as values:
//!
//! `y_i = LayerNorm(x^P_i + Σ_s Σ_j π^s_ij x^s_j)`,   `π^s = normalize(q k^sᵀ / sqrt(d))`,
//!
//! one head, dropout on `π` in training (0.1), any normalizer of the seam (UNAS = softmax, DNAS,
//! HNAS with `u` initialised at 0.5, Sinkhorn, BAM); each secondary view has its own `K_s` and
//! normalizer (so HNAS learns one `u` per view). The no-attention baseline concatenates every
//! view's boxes and normalizes them with the same LayerNorm.
//!
//! Head (after Pythia, Jiang et al. 2018, reduced): the question through word embeddings and a
//! GRU or LSTM (the state at its last word), or their mean as a bag of words ([`QuestionEncoder`]);
//! the fused boxes through a linear map (optionally plus one of the primary's unfused boxes,
//! [`VqaConfig::primary_skip`], or with it beside them after the relational layer,
//! [`VqaConfig::primary_beside`]); optionally `reasoning_layers` Transformer encoder layers over
//! the fused boxes with the question added to every box (softmax self-attention, the same for
//! every fusion, so that the fusion is the only difference between variants); optionally a
//! relational layer ([`Relate`]: each box's closest / furthest / like-me summaries); then top-down
//! attention with `glimpses` glimpses, `a_g = softmax_j(w_gᵀ relu(W_v z_j ⊙ W_q q))`, the attended
//! boxes joined with the question by an element-wise product, and a two-layer classifier.

use probattn::{
    attend, AttendOptions, Error, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention, Normalizer, NormalizerConfig, NormalizerFactory,
    Result, Variant,
};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use tch::nn::{self, Module, RNN};
use tch::{Kind, Tensor};

mod relate;
pub use relate::Relate;

/// The architecture (the training recipe lives with the experiment).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VqaConfig {
    /// Regions per view, primary first (informational: any count works at run time).
    pub view_regions: Vec<i64>,
    /// Feature size of every view's boxes (the values are untransformed, so all views share it).
    pub feature_dim: i64,
    /// The fusion's normalizer; `None`: no attention, the views' boxes concatenated.
    pub fusion: Option<Variant>,
    /// Query/key size of the fusion attention (default: `feature_dim`).
    pub key_dim: i64,
    /// Dropout on the fusion weights in training (0.1, Appendix B).
    pub attention_dropout: f64,
    /// HNAS's initial `u` (0.5 for VQA), BAM's settings.
    #[serde(default)]
    pub normalizer: NormalizerConfig,
    /// Question vocabulary size (token 0 is padding).
    pub vocab: i64,
    /// Word embedding size.
    pub word_dim: i64,
    /// How the question becomes a vector (GRU when a config predates the choice).
    #[serde(default)]
    pub question_encoder: QuestionEncoder,
    /// Size of the question's encoding (the RNN state, or the bag of words' map).
    pub question_dim: i64,
    /// Width of the head.
    pub hidden: i64,
    /// Transformer encoder layers over the fused boxes (0: none).
    pub reasoning_layers: usize,
    /// Pre-norm reasoning layers (`x + attn(LN x)`, `x + ffn(LN x)`) with their stack's output
    /// added to the boxes it started from, instead of post-norm layers replacing them. One
    /// post-norm layer stalled the head on Sort-of-CLEVR; this one learned
    /// (results/vqa/sort-of-clevr-L0/diagnostics).
    #[serde(default)]
    pub reasoning_prenorm: bool,
    /// Heads of those layers.
    pub reasoning_heads: i64,
    /// Heads of the relational layer before the glimpses (0: none): each box gets, per head, a
    /// softmax summary of the other boxes under a learned metric and a count (see [`Relate`]).
    #[serde(default)]
    pub relational_heads: i64,
    /// Size of each relational head's learned metric.
    #[serde(default = "default_relational_dim")]
    pub relational_dim: i64,
    /// The head also reads each primary box unfused: `z_i = W y_i + W_P x^P_i` (attention
    /// fusions only; the no-attention baseline already reads every view's boxes unfused). Why:
    /// the fusion adds three detectors' features in one space, so a quantity one detector encodes
    /// linearly (an object's position) is overlaid by unrelated features of the others; on
    /// Sort-of-CLEVR's 7×7 object boxes the attention fusions answered left / right and top /
    /// bottom 1-2 points below the no-attention baseline.
    #[serde(default)]
    pub primary_skip: bool,
    /// The glimpses read each primary box unfused beside the box the head built, after the
    /// relational layer: `[z_i, W_P x^P_i]` (attention fusions only). Unlike `primary_skip`,
    /// what the relational layer compares is left as it was: with the skip, closest questions
    /// were learned 5-29 epochs later on seed 0, furthest not within 40 epochs for DNAS and HNAS
    /// (results/vqa/sort-of-clevr-objects-e24/label-grid-7/README.md).
    #[serde(default)]
    pub primary_beside: bool,
    /// Top-down attention glimpses.
    pub glimpses: i64,
    /// Dropout in the head (classifier input, reasoning layers).
    pub dropout: f64,
    /// Answer vocabulary size.
    pub answers: i64,
    /// Memory-efficient fusion ([`probattn::tiled`]), this many primary boxes per tile: no
    /// `(N_P, N_s)` weights are formed (the fusion returns each secondary box's received mass
    /// instead). Needs `attention_dropout` 0. `None` (default, and then left out of the JSON):
    /// eager.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile: Option<i64>,
}

fn default_relational_dim() -> i64 {
    8
}

/// How the head encodes the question `(B, L)` of word ids (0 = padding after the words).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuestionEncoder {
    /// Word embeddings through a GRU, its state at the last word (Pythia's choice).
    #[default]
    Gru,
    /// The same with an LSTM (its hidden state at the last word).
    Lstm,
    /// A bag of words: `tanh(W mean_t e_t + b)`, the mean over the question's words. Order is lost,
    /// but every word reaches the head on its own: with the GRU state, Sort-of-CLEVR's closest
    /// questions stayed at 0.66-0.72 for 45,000 updates on perfect objects, with the bag of words
    /// they reached 0.93 in 9,000 (results/vqa/sort-of-clevr-L0/diagnostics).
    Bow,
}

impl fmt::Display for QuestionEncoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Gru => "gru",
            Self::Lstm => "lstm",
            Self::Bow => "bow",
        })
    }
}

impl FromStr for QuestionEncoder {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gru" => Ok(Self::Gru),
            "lstm" => Ok(Self::Lstm),
            "bow" => Ok(Self::Bow),
            other => Err(Error::Config(format!("unknown question encoder {other:?}: expected gru, lstm or bow"))),
        }
    }
}

/// The question encoder's weights, named as PyTorch names them (`gru.*`, `lstm.*`, `bag.*`).
#[derive(Debug)]
enum Question {
    Gru(nn::GRU),
    Lstm(nn::LSTM),
    Bow(nn::Linear),
}

impl VqaConfig {
    /// Width of what the glimpses read: a box, with a relational layer its summaries, and with
    /// `primary_beside` the primary's box.
    pub fn box_width(&self) -> i64 {
        self.hidden * (self.relational_heads + 1) + self.relational_heads + if self.primary_beside { self.hidden } else { 0 }
    }

    /// The fusion's name: the variant, or `none`.
    pub fn fusion_name(&self) -> String {
        self.fusion.map_or_else(|| "none".into(), |v| v.to_string())
    }

    /// Checks every size and rate; [`VqaModel::new`] calls it too.
    pub fn validate(&self) -> Result<()> {
        if self.view_regions.len() < 2 {
            return Err(Error::Config(format!(
                "multi-view fusion needs a primary and at least one secondary view, got {} view(s)",
                self.view_regions.len()
            )));
        }
        for (name, v) in [
            ("feature_dim", self.feature_dim),
            ("key_dim", self.key_dim),
            ("vocab", self.vocab),
            ("word_dim", self.word_dim),
            ("question_dim", self.question_dim),
            ("hidden", self.hidden),
            ("glimpses", self.glimpses),
            ("answers", self.answers),
        ] {
            if v < 1 {
                return Err(Error::Config(format!("{name} must be at least 1, got {v}")));
            }
        }
        if (self.primary_skip || self.primary_beside) && self.fusion.is_none() {
            return Err(Error::Config("primary_skip and primary_beside need an attention fusion: the no-attention baseline already reads the primary's boxes unfused".into()));
        }
        if self.primary_skip && self.primary_beside {
            return Err(Error::Config("primary_skip and primary_beside are two ways to read the primary's boxes: choose one".into()));
        }
        if self.relational_heads < 0 || (self.relational_heads > 0 && self.relational_dim < 1) {
            return Err(Error::Config(format!(
                "relational_heads ({}) must be 0 or more, relational_dim ({}) at least 1",
                self.relational_heads, self.relational_dim
            )));
        }
        if self.reasoning_layers > 0 && (self.reasoning_heads < 1 || self.hidden % self.reasoning_heads != 0) {
            return Err(Error::Config(format!("reasoning_heads ({}) must divide hidden ({})", self.reasoning_heads, self.hidden)));
        }
        for (name, p) in [("attention_dropout", self.attention_dropout), ("dropout", self.dropout)] {
            if !(0.0..1.0).contains(&p) {
                return Err(Error::Config(format!("{name} must lie in [0, 1), got {p}")));
            }
        }
        if let Some(tile) = self.tile {
            if tile < 1 || self.attention_dropout > 0.0 {
                return Err(Error::Config(format!(
                    "the memory-efficient fusion needs a tile of at least 1 (got {tile}) and attention_dropout 0 (got {}): its weights are never formed",
                    self.attention_dropout
                )));
            }
        }
        Ok(())
    }
}

/// What the fusion returns.
#[derive(Debug)]
pub struct Fused {
    /// `(B, N, D)`: the primary's N boxes fused (or every view's boxes concatenated).
    pub boxes: Tensor,
    /// Per secondary view, `(B, 1, N_P, N_s)`: the fusion weights before dropout (none with a
    /// tile: they are never formed).
    pub weights: Vec<Tensor>,
    /// With a tile, per secondary view, `(B, 1, N_s)`: the weight each secondary box receives,
    /// `Σ_i w_ij` (empty otherwise: the weights have it).
    pub received_mass: Vec<Tensor>,
    /// The normalizers' KL terms summed (BAM with a prior, when sampling).
    pub kl: Option<Tensor>,
}

/// The multi-view fusion layer of Appendix B.
#[derive(Debug)]
pub struct MultiViewFusion {
    query: Option<nn::Linear>,
    keys: Vec<nn::Linear>,
    normalizers: Vec<Box<dyn Normalizer>>,
    norm: nn::LayerNorm,
    dropout: f64,
    tile: Option<i64>,
}

impl MultiViewFusion {
    /// The fusion of `cfg.fusion` (the concatenation when `None`).
    pub fn new(p: &nn::Path, cfg: &VqaConfig) -> Result<Self> {
        match cfg.fusion {
            Some(variant) => Self::build(p, cfg, Some(&variant.factory(&cfg.normalizer))),
            None => Self::build(p, cfg, None),
        }
    }

    /// Attention fusion with the normalizers `make` builds, one per secondary view (from the
    /// view's path, 1 head, `key_dim` features); `cfg.fusion` and `cfg.normalizer` are then not
    /// read.
    pub fn with_normalizers(p: &nn::Path, cfg: &VqaConfig, make: &NormalizerFactory) -> Result<Self> {
        Self::build(p, cfg, Some(make))
    }

    fn build(p: &nn::Path, cfg: &VqaConfig, make: Option<&NormalizerFactory>) -> Result<Self> {
        let secondary = cfg.view_regions.len() - 1;
        let (mut keys, mut normalizers) = (vec![], vec![]);
        let query = match make {
            None => None,
            Some(make) => {
                for s in 0..secondary {
                    let path = p / format!("view{}", s + 1);
                    keys.push(nn::linear(&path / "key", cfg.feature_dim, cfg.key_dim, Default::default()));
                    normalizers.push(make(&(&path / "normalizer"), 1, cfg.key_dim)?);
                }
                Some(nn::linear(p / "query", cfg.feature_dim, cfg.key_dim, Default::default()))
            }
        };
        let norm = nn::layer_norm(p / "norm", vec![cfg.feature_dim], Default::default());
        Ok(Self { query, keys, normalizers, norm, dropout: cfg.attention_dropout, tile: cfg.tile })
    }

    /// `views[0]` the primary `(B, N_P, D)`, then the secondaries `(B, N_s, D)`.
    pub fn forward(&self, views: &[Tensor], mode: Mode) -> Result<Fused> {
        let Some(query) = &self.query else {
            return Ok(Fused { boxes: self.norm.forward(&Tensor::cat(views, 1)), weights: vec![], received_mass: vec![], kl: None });
        };
        let primary = &views[0];
        let q = query.forward(primary).unsqueeze(1); // (B, 1, N_P, d)
        let (mut sum, mut weights, mut received_mass, mut kl) = (primary.shallow_clone(), vec![], vec![], None::<Tensor>);
        // With a tile, the memory-efficient path: no weights, the mass each box receives instead.
        let opts = AttendOptions {
            need_weights: self.tile.is_none(),
            need_mass: self.tile.is_some(),
            tile: self.tile,
            ..AttendOptions { mode, dropout: self.dropout, ..Default::default() }
        };
        for ((x, key), normalizer) in views[1..].iter().zip(&self.keys).zip(&self.normalizers) {
            let k = key.forward(x).unsqueeze(1); // (B, 1, N_s, d)
            let v = x.unsqueeze(1); // (B, 1, N_s, D)
            let out = attend(&q, &k, &v, &Masks::default(), normalizer.as_ref(), opts)?;
            weights.extend(out.weights);
            received_mass.extend(out.received_mass);
            sum = sum + out.output.squeeze_dim(1); // (B, N_P, D)
            if let Some(term) = out.kl {
                kl = Some(match kl {
                    Some(acc) => acc + term,
                    None => term,
                });
            }
        }
        Ok(Fused { boxes: self.norm.forward(&sum), weights, received_mass, kl })
    }

    /// HNAS's mixing weight `u` of each secondary view, `(views - 1,)`; `None` for other fusions.
    pub fn gates(&self) -> Option<Tensor> {
        let gates: Option<Vec<Tensor>> = self.normalizers.iter().map(|n| n.gate()).collect();
        gates.filter(|g| !g.is_empty()).map(|g| Tensor::cat(&g, 0))
    }
}

#[derive(Debug)]
struct ReasoningLayer {
    attn: MultiHeadAttention,
    fc1: nn::Linear,
    fc2: nn::Linear,
    norm1: nn::LayerNorm,
    norm2: nn::LayerNorm,
    dropout: f64,
}

impl ReasoningLayer {
    fn new(p: &nn::Path, cfg: &VqaConfig) -> Result<Self> {
        let mut mha = MhaConfig::new(cfg.hidden, cfg.reasoning_heads);
        mha.dropout = cfg.dropout;
        Ok(Self {
            attn: MultiHeadAttention::new(&(p / "self_attn"), mha)?,
            fc1: nn::linear(p / "linear1", cfg.hidden, 2 * cfg.hidden, Default::default()),
            fc2: nn::linear(p / "linear2", 2 * cfg.hidden, cfg.hidden, Default::default()),
            norm1: nn::layer_norm(p / "norm1", vec![cfg.hidden], Default::default()),
            norm2: nn::layer_norm(p / "norm2", vec![cfg.hidden], Default::default()),
            dropout: cfg.dropout,
        })
    }

    /// Post-norm (`prenorm` false): `x = LN(x + attn(x))`, `LN(x + ffn(x))`; pre-norm:
    /// `x = x + attn(LN x)`, `x + ffn(LN x)`.
    fn forward(&self, x: &Tensor, train: bool, prenorm: bool) -> Result<Tensor> {
        let ffn = |x: &Tensor| self.fc2.forward(&self.fc1.forward(x).relu()).dropout(self.dropout, train);
        if prenorm {
            let h = self.norm1.forward(x);
            let x = x + self.attn.forward_t(&MhaInput::self_attention(&h), train)?.context.dropout(self.dropout, train);
            return Ok(&x + ffn(&self.norm2.forward(&x)));
        }
        let a = self.attn.forward_t(&MhaInput::self_attention(x), train)?.context;
        let x = self.norm1.forward(&(x + a.dropout(self.dropout, train)));
        Ok(self.norm2.forward(&(&x + ffn(&x))))
    }
}

/// What [`VqaModel::forward`] returns.
#[derive(Debug)]
pub struct VqaOutput {
    /// `(B, answers)`.
    pub logits: Tensor,
    /// The fusion's weights per secondary view, `(B, 1, N_P, N_s)`.
    pub fusion_weights: Vec<Tensor>,
    /// The fusion's KL term (BAM with a prior, when sampling).
    pub kl: Option<Tensor>,
}

/// Fusion, question encoder, reasoning layers, top-down attention and classifier.
#[derive(Debug)]
pub struct VqaModel {
    cfg: VqaConfig,
    pub fusion: MultiViewFusion,
    embed: nn::Embedding,
    question: Question,
    box_proj: nn::Linear,
    primary_proj: Option<nn::Linear>,
    box_question: nn::Linear,
    reasoning: Vec<ReasoningLayer>,
    relate: Option<Relate>,
    att_box: nn::Linear,
    att_question: nn::Linear,
    att_logits: nn::Linear,
    glimpse_proj: nn::Linear,
    question_proj: nn::Linear,
    classifier1: nn::Linear,
    classifier2: nn::Linear,
}

impl VqaModel {
    /// The model with `cfg.fusion`'s normalizers.
    pub fn new(p: &nn::Path, cfg: VqaConfig) -> Result<Self> {
        Self::build(p, cfg, None)
    }

    /// The model with attention fusion through the normalizers `make` builds (see
    /// [`MultiViewFusion::with_normalizers`]); `cfg.fusion` must name a variant (it is recorded in
    /// configs and results), but its normalizers are `make`'s.
    pub fn with_normalizers(p: &nn::Path, cfg: VqaConfig, make: &NormalizerFactory) -> Result<Self> {
        if cfg.fusion.is_none() {
            return Err(Error::Config("with_normalizers needs attention fusion: cfg.fusion is none (the concatenation)".into()));
        }
        Self::build(p, cfg, Some(make))
    }

    fn build(p: &nn::Path, cfg: VqaConfig, make: Option<&NormalizerFactory>) -> Result<Self> {
        cfg.validate()?;
        let (d, h, q) = (cfg.feature_dim, cfg.hidden, cfg.question_dim);
        let lin = |name: &str, i: i64, o: i64| nn::linear(p / name, i, o, Default::default());
        let rnn = nn::RNNConfig { batch_first: true, ..Default::default() };
        let question = match cfg.question_encoder {
            QuestionEncoder::Gru => Question::Gru(nn::gru(p / "gru", cfg.word_dim, q, rnn)),
            QuestionEncoder::Lstm => Question::Lstm(nn::lstm(p / "lstm", cfg.word_dim, q, rnn)),
            QuestionEncoder::Bow => Question::Bow(lin("bag", cfg.word_dim, q)),
        };
        let reasoning = (0..cfg.reasoning_layers).map(|l| ReasoningLayer::new(&(p / "reasoning" / l), &cfg)).collect::<Result<_>>()?;
        let fusion = match make {
            Some(make) => MultiViewFusion::with_normalizers(&(p / "fusion"), &cfg, make)?,
            None => MultiViewFusion::new(&(p / "fusion"), &cfg)?,
        };
        Ok(Self {
            fusion,
            embed: nn::embedding(p / "embed", cfg.vocab, cfg.word_dim, Default::default()),
            question,
            box_proj: lin("box_proj", d, h),
            primary_proj: (cfg.primary_skip || cfg.primary_beside).then(|| lin("primary_proj", d, h)),
            box_question: lin("box_question", q, h),
            reasoning,
            relate: (cfg.relational_heads > 0).then(|| Relate::new(&(p / "relate"), h, cfg.relational_heads, cfg.relational_dim)),
            att_box: lin("att_box", cfg.box_width(), h),
            att_question: lin("att_question", q, h),
            att_logits: lin("att_logits", h, cfg.glimpses),
            glimpse_proj: lin("glimpse_proj", cfg.glimpses * cfg.box_width(), h),
            question_proj: lin("question_proj", q, h),
            classifier1: lin("classifier1", h, h),
            classifier2: lin("classifier2", h, cfg.answers),
            cfg,
        })
    }

    pub fn config(&self) -> &VqaConfig {
        &self.cfg
    }

    /// The question's encoding `(B, question_dim)`: the RNN state at each question's last word,
    /// or the bag of words. `tokens (B, L)` int64, 0 = padding after the words.
    pub fn encode_question(&self, tokens: &Tensor) -> Tensor {
        let words = self.embed.forward(tokens); // (B, L, W)
        let out = match &self.question {
            Question::Bow(bag) => {
                let mask = tokens.ne(0).to_kind(words.kind()).unsqueeze(2); // (B, L, 1)
                let mean = (words * &mask).sum_dim_intlist(&[1i64][..], false, mask.kind())
                    / mask.sum_dim_intlist(&[1i64][..], false, mask.kind()).clamp_min(1.0);
                return bag.forward(&mean).tanh();
            }
            Question::Gru(gru) => gru.seq(&words).0,
            Question::Lstm(lstm) => lstm.seq(&words).0,
        }; // (B, L, Q)
        let last = (tokens.ne(0).sum_dim_intlist(&[1i64][..], false, Kind::Int64) - 1).clamp_min(0); // (B,)
        let index = last.view([-1, 1, 1]).expand([-1, 1, out.size()[2]], false);
        out.gather(1, &index, false).squeeze_dim(1)
    }

    /// `views`: per detector `(B, N_v, D)`, primary first; `tokens (B, L)`.
    pub fn forward(&self, views: &[Tensor], tokens: &Tensor, mode: Mode) -> Result<VqaOutput> {
        if views.len() != self.cfg.view_regions.len() {
            return Err(Error::Shape(format!("the model was built for {} views, got {}", self.cfg.view_regions.len(), views.len())));
        }
        for (i, v) in views.iter().enumerate() {
            let s = v.size();
            if s.len() != 3 || s[2] != self.cfg.feature_dim || s[0] != views[0].size()[0] {
                return Err(Error::Shape(format!(
                    "view {i} has shape {s:?}; expected (B, regions, {}) with the primary's batch",
                    self.cfg.feature_dim
                )));
            }
        }
        let train = mode.dropout;
        let fused = self.fusion.forward(views, mode)?;
        let q = self.encode_question(tokens); // (B, Q)
        let mut z = self.box_proj.forward(&fused.boxes); // (B, N, H)
        if let (Some(primary), true) = (&self.primary_proj, self.cfg.primary_skip) {
            z = z + primary.forward(&views[0]);
        }
        if !self.reasoning.is_empty() {
            let start = z.shallow_clone();
            z = z + self.box_question.forward(&q).unsqueeze(1);
            for layer in &self.reasoning {
                z = layer.forward(&z, train, self.cfg.reasoning_prenorm)?;
            }
            if self.cfg.reasoning_prenorm {
                z = start + z;
            }
        }
        if let Some(relate) = &self.relate {
            z = relate.forward(&z)?; // (B, N, H (R + 1) + R)
        }
        if let (Some(primary), true) = (&self.primary_proj, self.cfg.primary_beside) {
            z = Tensor::cat(&[z, primary.forward(&views[0])], -1); // (B, N, box_width)
        }
        let joint = (self.att_box.forward(&z) * self.att_question.forward(&q).unsqueeze(1)).relu(); // (B, N, H)
        let logits = self.att_logits.forward(&joint.dropout(self.cfg.dropout, train)); // (B, N, G)
        let att = logits.softmax(1, logits.kind());
        let glimpses = att.transpose(1, 2).matmul(&z).flatten(1, 2); // (B, G * box_width)
        let v = self.glimpse_proj.forward(&glimpses).relu();
        let fused_q = v * self.question_proj.forward(&q).relu(); // (B, H)
        let hidden = self.classifier1.forward(&fused_q.dropout(self.cfg.dropout, train)).relu();
        let logits = self.classifier2.forward(&hidden.dropout(self.cfg.dropout, train));
        Ok(VqaOutput { logits, fusion_weights: fused.weights, kl: fused.kl })
    }
}
