//! `probattn._native`: the Rust library's attention for Python, through tch's own bridge
//! (`pyo3-tch`: a `torch.Tensor` and a `tch::Tensor` are the same libtorch tensor, autograd graph
//! included). Every computation is the library's; this module only converts arguments, builds the
//! normalizer or module on the caller's parameters, and turns errors into Python exceptions.
//! The public Python API (`python/probattn/probattn/`) wraps these functions.
//!
//! A variant is resolved once into a `Spec` (its name parsed, its settings read, the names of its
//! parameters), which each call passes back; a normalizer that reads no parameters is built once
//! per shape and reused. Parameters owned by Python (`nn.Parameter`s: HNAS's gate logits, BAM's
//! contextual prior, the projections of multi-head attention) are put under a `VarStore`'s root
//! by name before the normalizer or module is built, which then uses those very tensors
//! ([`probattn::param`]), so their gradients arrive in Python.

mod repulsive;
mod timing;

use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use probattn::normalize::BamConfig;
use probattn::{attend, AttendOptions, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention, Normalizer, NormalizerConfig, Variant};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3_tch::PyTensor;
use tch::{nn, Tensor};

/// A library error as the Python exception a PyTorch user expects: bad arguments are
/// `ValueError`s, what happened inside libtorch (a device, an allocation) `RuntimeError`s.
fn to_py(e: probattn::Error) -> PyErr {
    use probattn::Error as E;
    match e {
        E::Shape(_) | E::Config(_) | E::UnknownVariant { .. } | E::Unsupported(_) | E::NonFinite(_) => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Runs `body`, turning a panic (a tch operation that libtorch refused) into a `RuntimeError`
/// carrying libtorch's message: no panic reaches Python.
fn guarded<T>(body: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => {
            let message = probattn::panic_message(payload.as_ref()).map(probattn::libtorch_message).unwrap_or("a panic without a message");
            Err(PyRuntimeError::new_err(format!("probattn: libtorch refused an operation: {message}")))
        }
    }
}

fn variant(name: &str) -> PyResult<Variant> {
    name.parse().map_err(to_py)
}

/// The normalizer settings from Python's `settings` dict (names as `NormalizerConfig` and
/// `BamConfig` spell them) and BAM's base variant.
fn config(settings: &HashMap<String, f64>, base: Option<&str>) -> PyResult<NormalizerConfig> {
    let mut cfg = NormalizerConfig::default();
    let b: &mut BamConfig = &mut cfg.bam;
    for (name, &value) in settings {
        match name.as_str() {
            "hybrid_init_u" => cfg.hybrid_init_u = value,
            "k" => b.k = value,
            "sigma" => b.sigma = value,
            "prior_alpha" => b.prior_alpha = value,
            "prior_beta" => b.prior_beta = value,
            "prior_mu" => b.prior_mu = value,
            "prior_sigma" => b.prior_sigma = value,
            "prior_hidden" => {
                if value.fract() != 0.0 {
                    return Err(PyValueError::new_err(format!("prior_hidden must be a whole number, got {value}")));
                }
                b.prior_hidden = value as i64;
            }
            other => {
                return Err(PyValueError::new_err(format!(
                "unknown setting '{other}' (known: hybrid_init_u, k, sigma, prior_alpha, prior_beta, prior_mu, prior_sigma, prior_hidden)"
            )))
            }
        }
    }
    if let Some(base) = base {
        cfg.bam.base = variant(base)?;
    }
    Ok(cfg)
}

/// A `VarStore` whose root holds `params` under their dotted names (`prior.f1.weight` is
/// `weight` under `prior / f1`), as the caller's tensors themselves.
fn store_with(device: tch::Device, params: &HashMap<String, PyTensor>) -> nn::VarStore {
    let vs = nn::VarStore::new(device);
    for (name, tensor) in params {
        let mut path = vs.root();
        let mut parts: Vec<&str> = name.split('.').collect();
        let leaf = parts.pop().unwrap_or_default();
        for part in parts {
            path = path / part;
        }
        // Not trainable here: the tensor's requires_grad is the caller's to set.
        let _ = path.add(leaf, tensor.0.shallow_clone(), false);
    }
    vs
}

/// Refuses what of `given` the module would not read (a misspelt name would otherwise be
/// ignored) and names what it would read but was not given.
fn check_names(given: &HashMap<String, PyTensor>, built: &[String]) -> Result<(), String> {
    let mut missing: Vec<&String> = built.iter().filter(|n| !given.contains_key(*n)).collect();
    if !missing.is_empty() {
        missing.sort();
        return Err(format!("parameters {missing:?} were not given"));
    }
    let mut extra: Vec<&String> = given.keys().filter(|n| !built.contains(n)).collect();
    if extra.is_empty() {
        return Ok(());
    }
    extra.sort();
    let mut known = built.to_vec();
    known.sort();
    Err(format!("parameters {extra:?} are not read by this configuration (it reads {known:?})"))
}

/// The names of the parameters the normalizer of `variant` reads (sorted), from one head of one
/// feature built under a scratch `VarStore`. They depend on the variant and its BAM base only, so
/// each pair is built once per process and remembered: building draws the initial values of a
/// contextual prior from libtorch's generator, which a new spec (new settings) must not draw again.
fn names_of(variant: Variant, cfg: &NormalizerConfig) -> PyResult<Vec<String>> {
    static KNOWN: OnceLock<Mutex<HashMap<String, Vec<String>>>> = OnceLock::new();
    let key = format!("{variant}/{}", cfg.bam.base);
    let known = KNOWN.get_or_init(Default::default);
    if let Some(names) = known.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(names.clone());
    }
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _ = tch::no_grad(|| variant.build(&vs.root(), 1, 1, cfg)).map_err(to_py)?;
    let mut names: Vec<String> = vs.variables().into_keys().collect();
    names.sort();
    known.lock().unwrap_or_else(|e| e.into_inner()).insert(key, names.clone());
    Ok(names)
}

/// A variant resolved once: its name parsed, its settings read and the names of the parameters
/// its normalizer reads, for every call that names it (`probattn._registry.spec` keeps one per
/// variant and settings). A normalizer that reads no parameters is built once per (shape, device)
/// and thread and reused by each call; one that reads the caller's tensors (HNAS's gate logits,
/// BAM's contextual prior) is built on them at each call: a `VarStore` holding them and the
/// build, 0.35-0.43 µs for HNAS in a release build (0.06 µs for DNAS, which reads none).
#[pyclass(frozen, module = "probattn._native")]
struct Spec {
    /// This spec's key in the threads' caches of built normalizers.
    id: u64,
    variant: Variant,
    cfg: NormalizerConfig,
    names: Vec<String>,
}

#[pymethods]
impl Spec {
    #[new]
    #[pyo3(signature = (variant, settings=HashMap::new(), bam_base=None))]
    fn new(variant: &str, settings: HashMap<String, f64>, bam_base: Option<&str>) -> PyResult<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let variant = self::variant(variant)?;
        let cfg = config(&settings, bam_base)?;
        let names = guarded(|| names_of(variant, &cfg))?;
        Ok(Self { id: NEXT.fetch_add(1, Ordering::Relaxed), variant, cfg, names })
    }

    /// The variant's name as the library spells it (`unas` resolves to `softmax`).
    #[getter]
    fn variant(&self) -> String {
        self.variant.to_string()
    }

    /// The names of the parameters a call must pass (`hybrid_logit`, `prior.f1.weight`, ...).
    #[getter]
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    fn __repr__(&self) -> String {
        format!("Spec({}, parameters {:?})", self.variant, self.names)
    }
}

/// The most normalizers one thread keeps built; past it the cache starts again (a process that
/// makes ever new specs or shapes does not grow without bound).
const BUILT_MAX: usize = 256;

type BuiltKey = (u64, i64, i64, tch::Device);

thread_local! {
    static BUILT: RefCell<HashMap<BuiltKey, Rc<dyn Normalizer>>> = RefCell::new(HashMap::new());
}

/// The normalizer of `spec` for `heads` heads of `key_dim` features on `device`: the thread's
/// built one when the variant reads no parameters, else one built on `params` (checked by name).
fn normalizer_for(
    spec: &Spec,
    heads: i64,
    key_dim: i64,
    device: tch::Device,
    params: &HashMap<String, PyTensor>,
) -> PyResult<Rc<dyn Normalizer>> {
    if !spec.names.is_empty() || !params.is_empty() {
        check_names(params, &spec.names).map_err(|what| {
            PyValueError::new_err(format!(
                "{}: {what} (learnable parameters are passed as hybrid_logit= and bam={{'prior': ...}}, or owned by probattn.nn.MultiheadAttention)",
                spec.variant
            ))
        })?;
        let vs = store_with(device, params);
        return Ok(Rc::from(spec.variant.build(&vs.root(), heads, key_dim, &spec.cfg).map_err(to_py)?));
    }
    let key = (spec.id, heads, key_dim, device);
    if let Some(built) = BUILT.with_borrow(|b| b.get(&key).cloned()) {
        return Ok(built);
    }
    let vs = nn::VarStore::new(device);
    let built: Rc<dyn Normalizer> = Rc::from(spec.variant.build(&vs.root(), heads, key_dim, &spec.cfg).map_err(to_py)?);
    BUILT.with_borrow_mut(|b| {
        if b.len() >= BUILT_MAX {
            b.clear();
        }
        b.insert(key, built.clone());
    });
    Ok(built)
}

/// Checks that query, key and value are floating-point, 4-D and of one dtype, naming them as the
/// Python API does (TypeError for a dtype, ValueError for a shape), before the library sees them.
fn check_inputs(query: &Tensor, key: &Tensor, value: &Tensor) -> PyResult<()> {
    for (name, t) in [("query", query), ("key", key), ("value", value)] {
        if !t.is_floating_point() {
            return Err(PyTypeError::new_err(format!("{name} must be a floating-point tensor, got dtype {:?}", t.kind())));
        }
        if t.dim() != 4 {
            return Err(PyValueError::new_err(format!("{name} has shape {:?}; expected (B, H, S, d), heads first", t.size())));
        }
    }
    if key.kind() != query.kind() || value.kind() != query.kind() {
        return Err(PyTypeError::new_err(format!(
            "query, key and value must share one dtype, got {:?}, {:?}, {:?}",
            query.kind(),
            key.kind(),
            value.kind()
        )));
    }
    Ok(())
}

/// `(output, weights, received_mass, kl)` as Python receives them.
type Attended = (PyTensor, Option<PyTensor>, Option<PyTensor>, Option<PyTensor>);

/// One attention call: `probattn::attend` on heads-first `(B, H, S, d)` tensors (`key` and `value`
/// with fewer heads under `enable_gqa`) for the variant `spec` resolved. Masks in the library's
/// convention (`key_padding_mask`, `attn_mask`: true = excluded; `bias`: added to the scores,
/// `-inf` excluding); `scale` the scores' factor (None: 1/sqrt(d)); `training`: BAM samples;
/// `dropout`: applied to the weights when above 0; `need_mass`: the received mass also from the
/// routes that spend a pass on it (the fused CUDA kernels); `params`: the tensors the variant
/// reads, by name (None for none). Every argument is positional: a call pays no keyword parsing. Returns
/// `(output, weights, received_mass, kl)`, the last three `None` where the path has none.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (spec, query, key, value, key_padding_mask, attn_mask, bias, causal, scale, enable_gqa, tile, training, dropout,
    seed, noise, need_weights, need_mass, params))]
fn attention(
    py: Python<'_>,
    spec: Py<Spec>,
    query: PyTensor,
    key: PyTensor,
    value: PyTensor,
    key_padding_mask: Option<PyTensor>,
    attn_mask: Option<PyTensor>,
    bias: Option<PyTensor>,
    causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    tile: Option<i64>,
    training: bool,
    dropout: f64,
    seed: Option<u64>,
    noise: Option<PyTensor>,
    need_weights: bool,
    need_mass: bool,
    params: Option<HashMap<String, PyTensor>>,
) -> PyResult<Attended> {
    // Owned tensors move into the closure: the computation runs without the GIL.
    let result = py.allow_threads(move || {
        guarded(|| {
            check_inputs(&query, &key, &value)?;
            let spec = spec.get();
            let (heads, key_dim) = (query.size()[1], query.size()[3]);
            let normalizer = normalizer_for(spec, heads, key_dim, query.device(), &params.unwrap_or_default())?;
            let masks = Masks {
                key_padding: key_padding_mask.as_deref(),
                query_padding: None,
                attn_mask: attn_mask.as_deref(),
                causal,
                bias: bias.as_deref(),
            };
            let opts = AttendOptions {
                mode: Mode { dropout: dropout > 0.0, sample: training },
                dropout,
                noise: noise.as_deref(),
                need_weights,
                need_mass,
                tile,
                seed,
                scale,
                enable_gqa,
                backend: Default::default(),
            };
            let out = attend(&query, &key, &value, &masks, normalizer.as_ref(), opts).map_err(to_py)?;
            Ok((out.output, out.weights, out.received_mass, out.kl))
        })
    })?;
    let (output, weights, mass, kl) = result;
    Ok((PyTensor(output), weights.map(PyTensor), mass.map(PyTensor), kl.map(PyTensor)))
}

/// `probattn.functional.scaled_dot_product_attention`'s common call, whole: 4-D heads-first
/// `query`, `key`, `value` of one batch size (key/value heads equal to the query's, or dividing
/// them under `enable_gqa`), `attn_mask` None, boolean (True = takes part) or floating (added to
/// the scores) and broadcasting to the scores, PyTorch's `dropout_p`, `is_causal`, `scale`. Returns
/// the output, or None for any other call (broadcast batch dimensions, other ranks, a mask that
/// does not fit, an argument of the wrong type): the Python function's general path takes those
/// and names what is wrong. One call from Python, no keyword matching: the fixed cost of
/// attention from Python is this function's.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sdpa(
    py: Python<'_>,
    spec: Py<Spec>,
    query: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    attn_mask: &Bound<'_, PyAny>,
    dropout_p: &Bound<'_, PyAny>,
    is_causal: &Bound<'_, PyAny>,
    scale: &Bound<'_, PyAny>,
    enable_gqa: &Bound<'_, PyAny>,
    training: &Bound<'_, PyAny>,
) -> PyResult<Option<PyTensor>> {
    let (Ok(q), Ok(k), Ok(v)) = (query.extract::<PyTensor>(), key.extract::<PyTensor>(), value.extract::<PyTensor>()) else {
        return Ok(None);
    };
    let mask = if attn_mask.is_none() {
        None
    } else {
        match attn_mask.extract::<PyTensor>() {
            Ok(m) => Some(m),
            Err(_) => return Ok(None),
        }
    };
    let Ok(dropout) = dropout_p.extract::<f64>() else { return Ok(None) };
    let scale = if scale.is_none() {
        None
    } else {
        match scale.extract::<f64>() {
            Ok(s) if s.is_finite() => Some(s),
            _ => return Ok(None),
        }
    };
    let (causal, enable_gqa, training) = (is_causal.is_truthy()?, enable_gqa.is_truthy()?, training.is_truthy()?);
    if !(0.0..1.0).contains(&dropout) || (causal && mask.is_some()) {
        return Ok(None);
    }
    let out = py.allow_threads(move || {
        guarded(|| {
            let (excluded, bias) = match &mask {
                None => (None, None),
                Some(m) if m.kind() == tch::Kind::Bool => (Some(probattn::mask::unexpanded(m).logical_not()), None),
                Some(m) if m.is_floating_point() && m.device() == q.device() => (None, Some(m.0.shallow_clone())),
                Some(_) => return Ok(None),
            };
            let (qs, ks) = (q.size(), k.size());
            if qs.len() != 4 || ks.len() != 4 {
                return Ok(None);
            }
            let (heads, key_dim, kv_heads) = (qs[1], qs[3], ks[1]);
            let normalizer = normalizer_for(spec.get(), heads, key_dim, q.device(), &HashMap::new())?;
            let masks = Masks { attn_mask: excluded.as_ref(), bias: bias.as_ref(), causal, ..Default::default() };
            let opts = AttendOptions {
                mode: Mode { dropout: dropout > 0.0, sample: training },
                dropout,
                need_weights: false,
                scale,
                enable_gqa: enable_gqa && kv_heads != heads,
                ..Default::default()
            };
            match attend(&q, &k, &v, &masks, normalizer.as_ref(), opts) {
                Ok(out) => Ok(Some(out.output)),
                // Shapes, ranks or dtypes that are not this call's (broadcast batches, a mask that
                // does not broadcast): attend refuses them before computing anything, and the
                // general path reshapes them or names what is wrong in PyTorch's terms.
                Err(probattn::Error::Shape(_)) => Ok(None),
                Err(e) => Err(to_py(e)),
            }
        })
    })?;
    Ok(out.map(PyTensor))
}

/// `MultiHeadAttention::forward_mode` on batch-first `(B, S, E)` inputs, the module built on the
/// caller's parameters (`in_proj_weight`, `in_proj_bias`, `out_proj.weight`, `out_proj.bias`,
/// or `q_proj_weight`, ... when kdim/vdim differ; the normalizer's own). `key_is_query` and
/// `value_is_key`: the caller passed one tensor as both. Returns `(output, per-head weights, kl)`.
#[pyfunction]
#[pyo3(signature = (query, key, value, embed_dim, num_heads, variant, params, *, kdim=None, vdim=None, bias=true, dropout=0.0,
    tile=None, key_padding_mask=None, attn_mask=None, causal=false, training=false, need_weights=false, noise=None,
    seed=None, settings=HashMap::new(), bam_base=None, key_is_query=false, value_is_key=false))]
#[allow(clippy::too_many_arguments)]
fn multi_head_attention(
    py: Python<'_>,
    query: PyTensor,
    key: PyTensor,
    value: PyTensor,
    embed_dim: i64,
    num_heads: i64,
    variant: &str,
    params: HashMap<String, PyTensor>,
    kdim: Option<i64>,
    vdim: Option<i64>,
    bias: bool,
    dropout: f64,
    tile: Option<i64>,
    key_padding_mask: Option<PyTensor>,
    attn_mask: Option<PyTensor>,
    causal: bool,
    training: bool,
    need_weights: bool,
    noise: Option<PyTensor>,
    seed: Option<u64>,
    settings: HashMap<String, f64>,
    bam_base: Option<&str>,
    key_is_query: bool,
    value_is_key: bool,
) -> PyResult<(PyTensor, Option<PyTensor>, Option<PyTensor>)> {
    let normalizer = config(&settings, bam_base)?;
    let cfg =
        MhaConfig { kdim, vdim, dropout, bias, variant: self::variant(variant)?, normalizer, tile, ..MhaConfig::new(embed_dim, num_heads) };
    let vs = store_with(query.device(), &params);
    let (output, weights, kl) = py.allow_threads(move || {
        guarded(|| {
            let mha = MultiHeadAttention::new(&vs.root(), cfg).map_err(to_py)?;
            // The module takes the given tensors; what it had to create was not given (the Python
            // module passes its own parameters, so this only catches a caller's mistake).
            let mut fresh: Vec<String> = vs.variables().into_keys().filter(|n| !params.contains_key(n)).collect();
            if !fresh.is_empty() {
                fresh.sort();
                return Err(PyValueError::new_err(format!("parameters {fresh:?} were not given")));
            }
            let masks = Masks {
                key_padding: key_padding_mask.as_deref(),
                query_padding: None,
                attn_mask: attn_mask.as_deref(),
                causal,
                bias: None,
            };
            // One Python tensor passed as several arguments arrives as several `Tensor`s: the flags
            // say which are one, so that the module sees a shared input as shared (under autocast
            // it casts that input once).
            let key = if key_is_query { &query.0 } else { &key.0 };
            let value = if value_is_key { key } else { &value.0 };
            let input =
                MhaInput { query: &query.0, key, value, masks, need_weights, need_head_outputs: false, noise: noise.as_deref(), seed };
            let out = mha.forward_mode(&input, Mode::train(training)).map_err(to_py)?;
            Ok((out.context, out.weights, out.kl))
        })
    })?;
    Ok((PyTensor(output), weights.map(PyTensor), kl.map(PyTensor)))
}

/// The parameter names and shapes `nn.MultiheadAttention`-style module of this configuration
/// owns, with their initial values (as the Rust module initialises them, from libtorch's
/// generator): `[(name, tensor)]`.
#[pyfunction]
#[pyo3(signature = (embed_dim, num_heads, variant, *, kdim=None, vdim=None, bias=true, settings=HashMap::new(), bam_base=None))]
#[allow(clippy::too_many_arguments)]
fn initial_parameters(
    embed_dim: i64,
    num_heads: i64,
    variant: &str,
    kdim: Option<i64>,
    vdim: Option<i64>,
    bias: bool,
    settings: HashMap<String, f64>,
    bam_base: Option<&str>,
) -> PyResult<Vec<(String, PyTensor)>> {
    let normalizer = config(&settings, bam_base)?;
    let cfg = MhaConfig { kdim, vdim, bias, variant: self::variant(variant)?, normalizer, ..MhaConfig::new(embed_dim, num_heads) };
    guarded(|| {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        tch::no_grad(|| MultiHeadAttention::new(&vs.root(), cfg)).map_err(to_py)?;
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(params.into_iter().map(|(n, t)| (n, PyTensor(t.detach()))).collect())
    })
}

/// Sets the process's attention backend (`probattn::backend::set_default`: auto, eager, tiles or
/// fused) and returns the one it replaces, for `probattn.attention_backend`'s context manager.
#[pyfunction]
fn set_attention_backend(name: &str) -> PyResult<String> {
    let backend: probattn::Backend = name.parse().map_err(to_py)?;
    Ok(probattn::backend::set_default(backend).to_string())
}

/// The attention calls each route served since the last reset, `{"eager": 3, "tiles": 1}`;
/// `reset` starts the counts again after reading them.
#[pyfunction]
#[pyo3(signature = (reset=false))]
fn attention_routes(reset: bool) -> HashMap<String, u64> {
    let taken = probattn::backend::routes_taken().into_iter().map(|(r, n)| (r.name().to_string(), n)).collect();
    if reset {
        probattn::backend::reset_routes_taken();
    }
    taken
}

/// The variant registry as `probattn variants --json` prints it.
#[pyfunction]
fn registry_json() -> PyResult<String> {
    serde_json::to_string_pretty(probattn::normalize::registry::VARIANTS).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Spec>()?;
    m.add_function(wrap_pyfunction!(attention, m)?)?;
    m.add_function(wrap_pyfunction!(sdpa, m)?)?;
    m.add_function(wrap_pyfunction!(timing::rust_timing, m)?)?;
    m.add_function(wrap_pyfunction!(multi_head_attention, m)?)?;
    m.add_function(wrap_pyfunction!(initial_parameters, m)?)?;
    m.add_function(wrap_pyfunction!(registry_json, m)?)?;
    m.add_function(wrap_pyfunction!(repulsive::repulsive_step, m)?)?;
    m.add_function(wrap_pyfunction!(set_attention_backend, m)?)?;
    m.add_function(wrap_pyfunction!(attention_routes, m)?)?;
    Ok(())
}
