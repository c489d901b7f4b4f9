//! How one attention call runs. A caller asks for a [`Backend`] (`auto` unless forced:
//! [`crate::AttendOptions::backend`], the process default [`set_default`], `--attention-backend`
//! on every command, `probattn.attention_backend(...)` in Python); [`crate::attend`] then takes one
//! [`Route`] in one place (`seam::route`), from the device, the dtype, the normalizer's kernel
//! and plan, the masks, the lengths and what the caller asked to get back, and says why.
//!
//! - `auto`: when a tile is set and no weights are asked for, the memory-efficient forms: where
//!   the fused CUDA route serves the call ([`crate::fused_cuda::AUTO_TAKES_IT`]), the
//!   normalizer's kernel if one applies, else that route; elsewhere the fused CPU kernel where it
//!   applies, else the tiles. Otherwise the normalizer's kernel where it has one that applies
//!   (softmax without weights: libtorch's fused attention, on the CPU under any mask, on CUDA
//!   without a mask or with the causal mask alone); otherwise eager.
//! - `eager`: scores, the normalizer and the mix, the weights formed (returned when asked for).
//! - `tiles`: the normalizer's plan tile by tile ([`crate::tiled`]), never the fused kernel; the
//!   tile is the call's, else [`DEFAULT_TILE`].
//! - `fused`: one kernel that never forms the weights: the normalizer's kernel, else, under its
//!   plan, the fused CPU kernel on the CPU and the embedded Triton kernels on CUDA
//!   ([`crate::fused_cuda`]).
//!
//! A forced backend that cannot serve a call is a named error ([`crate::Error::Unsupported`]),
//! never a silent change of route; so is asking for the weights from `tiles` or `fused`.
//! [`routes_taken`] counts the routes taken since [`reset_routes_taken`], which the commands'
//! records (`results.json`, `bench.json`) report.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The tile of a `tiles` call that sets none.
pub const DEFAULT_TILE: i64 = 256;

/// How a caller asks a call to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Backend {
    /// The route [`crate::attend`] picks (the module doc says how); in `AttendOptions`, the
    /// process default ([`default`]), which is `auto` unless set.
    #[default]
    Auto,
    /// Scores, the normalizer, the mix.
    Eager,
    /// The normalizer's plan, tile by tile.
    Tiles,
    /// One kernel that never forms the weights.
    Fused,
}

impl Backend {
    pub const ALL: [Backend; 4] = [Backend::Auto, Backend::Eager, Backend::Tiles, Backend::Fused];
    pub const NAMES: &'static str = "auto, eager, tiles, fused";

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Eager => "eager",
            Self::Tiles => "tiles",
            Self::Fused => "fused",
        }
    }

    fn from_index(i: u8) -> Self {
        Self::ALL.get(usize::from(i)).copied().unwrap_or_default()
    }
}

impl FromStr for Backend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|b| b.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| Error::Config(format!("unknown attention backend '{s}' (known: {})", Self::NAMES)))
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl TryFrom<String> for Backend {
    type Error = Error;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<Backend> for String {
    fn from(b: Backend) -> String {
        b.name().to_string()
    }
}

/// What served a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(into = "String")]
pub enum Route {
    /// Scores, the normalizer (or its own eager form, [`crate::Normalizer::fused`]), the mix.
    Eager,
    /// The normalizer's kernel ([`crate::Normalizer::kernel`]; softmax: libtorch's fused
    /// attention).
    Kernel,
    /// The plan's tile loop.
    Tiles,
    /// libtorch's fused CPU kernel under the plan (probattn-sys/csrc/fused_cpu.cpp).
    FusedCpu,
    /// The embedded Triton kernels under the plan ([`crate::fused_cuda`]).
    FusedCuda,
}

impl Route {
    pub const ALL: [Route; 5] = [Route::Eager, Route::Kernel, Route::Tiles, Route::FusedCpu, Route::FusedCuda];

    pub fn name(self) -> &'static str {
        match self {
            Self::Eager => "eager",
            Self::Kernel => "kernel",
            Self::Tiles => "tiles",
            Self::FusedCpu => "fused-cpu",
            Self::FusedCuda => "fused-cuda",
        }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<Route> for String {
    fn from(r: Route) -> String {
        r.name().to_string()
    }
}

/// The route of one call and why it was taken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Choice {
    /// What the call asked for, the process default resolved.
    pub requested: Backend,
    pub route: Route,
    pub why: String,
}

/// The process default, as an index into [`Backend::ALL`].
static DEFAULT: AtomicU8 = AtomicU8::new(0);

/// The backend of calls whose options say `auto`.
pub fn default() -> Backend {
    Backend::from_index(DEFAULT.load(Ordering::Relaxed))
}

/// Sets the backend of calls whose options say `auto` (every layer's, every command's), for the
/// whole process; returns the one it replaces, to restore (Python's context manager does).
pub fn set_default(backend: Backend) -> Backend {
    let index = Backend::ALL.iter().position(|b| *b == backend).unwrap_or(0) as u8;
    Backend::from_index(DEFAULT.swap(index, Ordering::Relaxed))
}

static TAKEN: [AtomicU64; 5] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// Counts one call served by `route`.
pub(crate) fn record(route: Route) {
    if let Some(i) = Route::ALL.iter().position(|r| *r == route) {
        TAKEN[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// The calls each route served since [`reset_routes_taken`] (or the process's start), the
/// routes that served none left out.
pub fn routes_taken() -> Vec<(Route, u64)> {
    Route::ALL.into_iter().zip(&TAKEN).map(|(r, n)| (r, n.load(Ordering::Relaxed))).filter(|(_, n)| *n > 0).collect()
}

/// Starts [`routes_taken`]'s counts again.
pub fn reset_routes_taken() {
    for n in &TAKEN {
        n.store(0, Ordering::Relaxed);
    }
}

/// [`routes_taken`] as a JSON object, `{"eager": 12, "tiles": 3}`, for the records.
pub fn routes_taken_json() -> serde_json::Value {
    serde_json::Value::Object(routes_taken().into_iter().map(|(r, n)| (r.name().to_string(), n.into())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_named() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>().ok(), Some(b));
        }
        let err = "flash".parse::<Backend>().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("'flash'") && err.contains("auto, eager, tiles, fused"), "{err}");
    }
}
