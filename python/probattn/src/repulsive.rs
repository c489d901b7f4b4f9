//! The repulsive heads' step for Python's optimizer loop.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3_tch::PyTensor;

use crate::{guarded, to_py};

/// A value of one of the library's serde enums from its name (`"encoder-self"`, `"q"`, `"spos"`).
fn named<T: serde::de::DeserializeOwned>(what: &str, name: &str) -> PyResult<T> {
    serde_json::from_value(serde_json::Value::String(name.to_string()))
        .map_err(|_| PyValueError::new_err(format!("unknown {what} '{name}'")))
}

/// The repulsive heads' step (`probattn::repulsive::RepulsiveHook::apply`): replaces the
/// gradients of the attention projections in `modules` with the SVGD or SPOS direction, in place.
/// `modules`: `(name, weight, heads, kind, layer, projection)`, `projection` None for a packed
/// `in_proj_weight (3E, E)` (Q, K and V), else "q", "k" or "v" for a separate weight.
/// `selection`: the CLI's `--selection` JSON (kinds, layers, projections). Returns the names of
/// the particle sets it moved.
#[pyfunction]
#[pyo3(signature = (modules, *, method="svgd", alpha=0.01, stepsize=0.1, beta=1.0, bandwidth=None, selection=None))]
#[allow(clippy::type_complexity)]
pub fn repulsive_step(
    modules: Vec<(String, PyTensor, i64, String, usize, Option<String>)>,
    method: &str,
    alpha: f64,
    stepsize: f64,
    beta: f64,
    bandwidth: Option<f64>,
    selection: Option<&str>,
) -> PyResult<Vec<String>> {
    use probattn::repulsive::{Bandwidth, RepulsiveConfig, RepulsiveHook, Selection};
    let cfg = RepulsiveConfig {
        method: named("repulsive method (svgd, spos)", method)?,
        alpha,
        stepsize,
        beta,
        bandwidth: bandwidth.map_or(Bandwidth::Median, Bandwidth::Fixed),
    };
    let selection: Selection = match selection {
        Some(s) => serde_json::from_str(s)
            .map_err(|e| PyValueError::new_err(format!("selection {s}: {e} (JSON with kinds, layers, projections)")))?,
        None => Selection::default(),
    };
    guarded(|| {
        let mut hook = RepulsiveHook::new(cfg, selection).map_err(to_py)?;
        for (name, weight, heads, kind, layer, projection) in &modules {
            let kind = named("module kind (encoder-self, decoder-self, cross, other)", kind)?;
            match projection {
                None => hook.add_in_proj(name, weight, *heads, kind, *layer).map_err(to_py)?,
                Some(p) => {
                    hook.add_projection_weight(name, weight, *heads, kind, *layer, named("projection (q, k, v)", p)?).map_err(to_py)?
                }
            }
        }
        hook.apply().map_err(to_py)?;
        Ok(hook.sets().iter().map(|s| s.name.clone()).collect())
    })
}
