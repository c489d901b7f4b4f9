//! The registry of attention variants: one table of what each variant is, that the library's
//! parser, the command line's value lists, `bench`, `gat`, `probattn variants --json` and the
//! Python scripts all read, so that no list of names is kept anywhere else.
//!
//! Each entry holds what a variant's normalizer cannot say of itself: its name as the command line
//! spells it, aliases, where it comes from, the settings it reads (BAM's `k`, HNAS's initial `u`,
//! ...) with their defaults, which [`NormalizerConfig::default`] supplies, and how to build it.
//! The properties callers branch on (family, causal, sampling, KL, memory-efficient route) are
//! the built normalizer's and its plan's ([`VariantSpec::properties`]), never written twice.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use serde::{Serialize, Serializer};
use tch::nn;

use super::{Bam, BamKind, Dnas, Hnas, Normalizer, NormalizerConfig, Sinkhorn, Softmax, Variant};
pub use crate::plan::Family;
use crate::plan::NoiseKind;
use crate::Result;

/// Builds a variant's normalizer from the layer's parameter path, its heads, its key features,
/// the settings and the variant's parameter (`N` of `sinkhorn-N`; 0 for the others).
pub type BuildFn = fn(&nn::Path, i64, i64, &NormalizerConfig, u32) -> Result<Box<dyn Normalizer>>;

/// A setting a variant reads, with its default.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Setting {
    /// The field of [`NormalizerConfig`] (`bam.k`, `hybrid_init_u`, ...).
    pub name: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
}

/// One variant of the registry.
#[derive(Clone, Copy, Debug)]
pub struct VariantSpec {
    /// The name as the command line spells it; `N` stands for a positive integer.
    pub name: &'static str,
    /// Other spellings the parser accepts.
    pub aliases: &'static [&'static str],
    /// The instance examples, benches and sweeps take (`sinkhorn-3` for `sinkhorn-N`).
    pub example: &'static str,
    pub summary: &'static str,
    /// The paper and section it comes from.
    pub source: &'static str,
    /// In `probattn bench`'s default set.
    pub benchmarked: bool,
    pub settings: &'static [Setting],
    /// Parses a name of this entry.
    pub parse: fn(&str) -> Option<Variant>,
    /// Builds its normalizer ([`Variant::build`] calls it).
    pub build: BuildFn,
}

/// What a variant is, read from its example instance built with the default settings: the
/// normalizer's answers and its plan's ([`crate::plan::Tiled`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Properties {
    /// `None` for a variant outside the plans (it has no memory-efficient form to read it from).
    pub family: Option<Family>,
    /// May run under a causal mask (its weights of query `i` ignore later queries).
    pub causal_safe: bool,
    /// Samples in training (and Monte Carlo prediction); its eval weights are the base's.
    pub stochastic: bool,
    /// Returns a KL term for the loss.
    pub kl: bool,
    /// The noise its plan samples (`weibull` or `lognormal`); `None` for deterministic plans.
    pub noise: Option<&'static str>,
    /// The learnable tensors it creates under its layer's path (HNAS's `hybrid_logit`, BAM's
    /// contextual prior `prior.*`), sorted: what a caller outside the library must pass it.
    pub parameters: Vec<String>,
    /// The memory-efficient route (`probattn::tiled`), in words; `None`: eager only.
    pub memory_efficient: Option<String>,
}

impl Properties {
    /// The properties of a normalizer built under `store`'s root.
    pub fn of(normalizer: &dyn Normalizer, store: &nn::VarStore) -> Self {
        let plan = normalizer.tiled();
        let mut parameters: Vec<String> = store.variables().into_keys().collect();
        parameters.sort();
        Self {
            family: plan.as_ref().map(|p| p.family()),
            causal_safe: normalizer.causal_safe(),
            stochastic: normalizer.stochastic(),
            kl: plan.as_ref().is_some_and(|p| p.has_kl()),
            noise: plan.as_ref().and_then(|p| p.sampling.as_ref()).map(|s| match s.noise {
                NoiseKind::Weibull => "weibull",
                NoiseKind::Lognormal => "lognormal",
            }),
            parameters,
            memory_efficient: plan.as_ref().map(|p| p.describe()),
        }
    }
}

impl VariantSpec {
    /// Its properties, from its example built once with the default settings (two heads, four
    /// key features, on the CPU) and kept for the process. The build draws the example's
    /// parameters from libtorch's CPU generator and then sets the generator back, so asking
    /// moves no seeded stream (a model built after it initialises as it would have).
    pub fn properties(&self) -> Result<Properties> {
        static KNOWN: OnceLock<Mutex<HashMap<&'static str, Properties>>> = OnceLock::new();
        let known = KNOWN.get_or_init(Default::default);
        if let Some(p) = known.lock().unwrap_or_else(|e| e.into_inner()).get(self.name) {
            return Ok(p.clone());
        }
        let variant = (self.parse)(self.example).ok_or_else(|| {
            crate::Error::Config(format!("the registry entry {} does not parse its own example {}", self.name, self.example))
        })?;
        let generator = crate::cxx::cpu_rng_state()?;
        let scratch = nn::VarStore::new(tch::Device::Cpu);
        let built = (self.build)(&scratch.root(), 2, 4, &NormalizerConfig::default(), variant.param());
        crate::cxx::set_cpu_rng_state(&generator)?;
        let properties = Properties::of(&*built?, &scratch);
        known.lock().unwrap_or_else(|e| e.into_inner()).insert(self.name, properties.clone());
        Ok(properties)
    }
}

/// The entry as `probattn variants --json` writes it: its own fields with its properties.
impl Serialize for VariantSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Entry<'a> {
            name: &'a str,
            aliases: &'a [&'a str],
            example: &'a str,
            family: Option<Family>,
            summary: &'a str,
            source: &'a str,
            causal_safe: bool,
            stochastic: bool,
            kl: bool,
            noise: Option<&'a str>,
            parameters: Vec<String>,
            memory_efficient: Option<String>,
            benchmarked: bool,
            settings: &'a [Setting],
        }
        let p = self.properties().map_err(serde::ser::Error::custom)?;
        Entry {
            name: self.name,
            aliases: self.aliases,
            example: self.example,
            family: p.family,
            summary: self.summary,
            source: self.source,
            causal_safe: p.causal_safe,
            stochastic: p.stochastic,
            kl: p.kl,
            noise: p.noise,
            parameters: p.parameters,
            memory_efficient: p.memory_efficient,
            benchmarked: self.benchmarked,
            settings: self.settings,
        }
        .serialize(serializer)
    }
}

/// Entries are one per name.
impl PartialEq for VariantSpec {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for VariantSpec {}

const BAM_SETTINGS_WEIBULL: &[Setting] = &[
    Setting { name: "bam.k", default: "1000", meaning: "Weibull shape; larger is less noise" },
    Setting { name: "bam.base", default: "softmax", meaning: "the deterministic normalizer whose weights are the mean" },
];
const BAM_SETTINGS_WF: &[Setting] = &[
    Setting { name: "bam.k", default: "1000", meaning: "Weibull shape; larger is less noise" },
    Setting { name: "bam.prior_alpha", default: "1", meaning: "Gamma prior shape" },
    Setting { name: "bam.prior_beta", default: "1", meaning: "Gamma prior rate" },
    Setting { name: "bam.base", default: "softmax", meaning: "the deterministic normalizer whose weights are the mean" },
];
const BAM_SETTINGS_WC: &[Setting] = &[
    Setting { name: "bam.k", default: "1000", meaning: "Weibull shape; larger is less noise" },
    Setting { name: "bam.prior_beta", default: "1", meaning: "Gamma prior rate; the shape is β·softmax of the prior network" },
    Setting { name: "bam.prior_hidden", default: "10", meaning: "hidden units of the contextual prior network" },
    Setting { name: "bam.base", default: "softmax", meaning: "the deterministic normalizer whose weights are the mean" },
];
const BAM_SETTINGS_LF: &[Setting] = &[
    Setting { name: "bam.sigma", default: "1", meaning: "Lognormal σ; smaller is less noise" },
    Setting { name: "bam.prior_mu", default: "0", meaning: "Lognormal prior mean" },
    Setting { name: "bam.prior_sigma", default: "1", meaning: "Lognormal prior σ" },
    Setting { name: "bam.base", default: "softmax", meaning: "the deterministic normalizer whose weights are the mean" },
];
const BAM_SETTINGS_LC: &[Setting] = &[
    Setting { name: "bam.sigma", default: "1", meaning: "Lognormal σ; smaller is less noise" },
    Setting { name: "bam.prior_sigma", default: "1", meaning: "Lognormal prior σ; the mean is log of the prior network's softmax" },
    Setting { name: "bam.prior_hidden", default: "10", meaning: "hidden units of the contextual prior network" },
    Setting { name: "bam.base", default: "softmax", meaning: "the deterministic normalizer whose weights are the mean" },
];

const FAN: &str = "Fan, Zhang, Chen, Zhou 2020, Bayesian Attention Modules, Sec. 3";
const DING: &str = "Ding, Xu, Zhang, Gu 2020, Attention that does not Explain Away";

/// One BAM entry: `$kind` with its name, summary, bench flag and settings.
macro_rules! bam_spec {
    ($kind:expr, $name:literal, $summary:literal, $benchmarked:literal, $settings:expr) => {
        VariantSpec {
            name: $name,
            aliases: &[],
            example: $name,
            summary: $summary,
            source: FAN,
            benchmarked: $benchmarked,
            settings: $settings,
            parse: |s| (s == $name).then_some(Variant::Bam($kind)),
            build: |p, heads, key_dim, cfg, _| Ok(Box::new(Bam::new(p, $kind, heads, key_dim, cfg)?)),
        }
    };
}

static SOFTMAX: VariantSpec = VariantSpec {
    name: "softmax",
    aliases: &["unas"],
    example: "softmax",
    summary: "each query's weights are a softmax over its keys (UNAS)",
    source: "Vaswani et al. 2017; Ding et al. 2020's UNAS",
    benchmarked: true,
    settings: &[],
    parse: |s| matches!(s, "softmax" | "unas").then_some(Variant::Softmax),
    build: |_, _, _, _, _| Ok(Box::new(Softmax)),
};
static DNAS: VariantSpec = VariantSpec {
    name: "dnas",
    aliases: &[],
    example: "dnas",
    summary: "each key normalized over the queries, then each query over the keys",
    source: DING,
    benchmarked: true,
    settings: &[],
    parse: |s| (s == "dnas").then_some(Variant::Dnas),
    build: |_, _, _, _, _| Ok(Box::new(Dnas)),
};
static HNAS: VariantSpec = VariantSpec {
    name: "hnas",
    aliases: &[],
    example: "hnas",
    summary: "u·DNAS + (1 − u)·softmax with a learned u per head",
    source: DING,
    benchmarked: true,
    settings: &[Setting { name: "hybrid_init_u", default: "0.5", meaning: "initial mixing weight u of every head" }],
    parse: |s| (s == "hnas").then_some(Variant::Hnas),
    build: |p, heads, _, cfg, _| Ok(Box::new(Hnas::new(p, heads, cfg.hybrid_init_u)?)),
};
static SINKHORN: VariantSpec = VariantSpec {
    name: "sinkhorn-N",
    aliases: &[],
    example: "sinkhorn-3",
    summary: "N alternating column and row normalizations (N = 1 is DNAS)",
    source: "Sinkhorn 1964; Ding et al. 2020 (DNAS is one sweep)",
    benchmarked: true,
    settings: &[],
    parse: |s| s.strip_prefix("sinkhorn-")?.parse().ok().filter(|n| *n >= 1).map(Variant::Sinkhorn),
    build: |_, _, _, _, n| Ok(Box::new(Sinkhorn::new(n)?)),
};
static BAM_NOKL: VariantSpec =
    bam_spec!(BamKind::NoKl, "bam-nokl", "Weibull sampling around the base weights, no KL term", false, BAM_SETTINGS_WEIBULL);
static BAM_LF: VariantSpec =
    bam_spec!(BamKind::LognormalFixed, "bam-lf", "Lognormal weights with a fixed Lognormal prior", false, BAM_SETTINGS_LF);
static BAM_LC: VariantSpec = bam_spec!(
    BamKind::LognormalContextual,
    "bam-lc",
    "Lognormal weights with a contextual prior computed from the keys",
    true,
    BAM_SETTINGS_LC
);
static BAM_WF: VariantSpec = bam_spec!(BamKind::WeibullFixed, "bam-wf", "Weibull weights with a fixed Gamma prior", false, BAM_SETTINGS_WF);
static BAM_WC: VariantSpec = bam_spec!(
    BamKind::WeibullContextual,
    "bam-wc",
    "Weibull weights with a contextual Gamma prior computed from the keys",
    true,
    BAM_SETTINGS_WC
);

/// Every built-in variant, in the order of the papers' tables.
pub static VARIANTS: &[&VariantSpec] = &[&SOFTMAX, &DNAS, &HNAS, &SINKHORN, &BAM_NOKL, &BAM_LF, &BAM_LC, &BAM_WF, &BAM_WC];

/// The registry entry that parses `name`.
pub fn lookup(name: &str) -> Option<(&'static VariantSpec, Variant)> {
    VARIANTS.iter().find_map(|spec| (spec.parse)(name).map(|v| (*spec, v)))
}

/// The entry of a parsed variant.
pub fn spec_of(variant: Variant) -> &'static VariantSpec {
    match variant {
        Variant::Softmax => &SOFTMAX,
        Variant::Dnas => &DNAS,
        Variant::Hnas => &HNAS,
        Variant::Sinkhorn(_) => &SINKHORN,
        Variant::Bam(BamKind::NoKl) => &BAM_NOKL,
        Variant::Bam(BamKind::LognormalFixed) => &BAM_LF,
        Variant::Bam(BamKind::LognormalContextual) => &BAM_LC,
        Variant::Bam(BamKind::WeibullFixed) => &BAM_WF,
        Variant::Bam(BamKind::WeibullContextual) => &BAM_WC,
        Variant::Registered { spec, .. } => spec,
    }
}

/// The names as the command line spells them, for messages and `--help`:
/// `softmax, dnas, hnas, sinkhorn-N (N >= 1), bam-nokl, ...`.
pub fn known() -> String {
    VARIANTS
        .iter()
        .map(|s| if s.name.ends_with("-N") { format!("{} (N >= 1)", s.name) } else { s.name.to_string() })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every variant's example instance (`softmax`, ..., `sinkhorn-3`, ..., `bam-wc`): the rows of
/// a sweep over all variants.
pub fn examples() -> Vec<&'static str> {
    VARIANTS.iter().map(|s| s.example).collect()
}

/// The example instances of `probattn bench`'s default set.
pub fn benchmarked() -> Vec<&'static str> {
    VARIANTS.iter().filter(|s| s.benchmarked).map(|s| s.example).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A variant with no arm of its own: softmax at a temperature `N` (as `tempered-N`), built
    /// through its entry alone.
    #[derive(Debug)]
    struct Tempered(u32);

    impl Normalizer for Tempered {
        fn name(&self) -> String {
            format!("tempered-{}", self.0)
        }
        fn normalize(&self, input: &super::super::NormalizeInput) -> Result<super::super::Normalized> {
            let scaled = input.scores / f64::from(self.0);
            Softmax.normalize(&super::super::NormalizeInput { scores: &scaled, ..*input })
        }
    }

    static TEMPERED: VariantSpec = VariantSpec {
        name: "tempered-N",
        aliases: &[],
        example: "tempered-2",
        summary: "softmax of the scores divided by N",
        source: "a test",
        benchmarked: false,
        settings: &[],
        parse: |s| s.strip_prefix("tempered-")?.parse().ok().map(|n| Variant::Registered { spec: &TEMPERED, n }),
        build: |_, _, _, _, n| Ok(Box::new(Tempered(n))),
    };

    #[test]
    fn a_registered_variant_needs_no_arm_of_its_own() {
        let v = (TEMPERED.parse)("tempered-3").unwrap();
        assert_eq!(v.to_string(), "tempered-3");
        assert_eq!(v.spec().name, "tempered-N");
        assert_eq!(v.param(), 3);
        assert!(!v.is_stochastic());
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let n = v.build(&vs.root(), 1, 2, &super::super::NormalizerConfig::default()).unwrap();
        assert_eq!(n.name(), "tempered-3");
        // Not in VARIANTS, so the parser does not know it: registering is the one line.
        assert!("tempered-3".parse::<Variant>().is_err());
    }

    #[test]
    fn every_variant_and_name_round_trips_through_the_registry() {
        for spec in VARIANTS {
            let (found, v) = lookup(spec.example).unwrap_or_else(|| panic!("{} does not parse", spec.example));
            assert_eq!(found.name, spec.name);
            assert_eq!(v.to_string(), spec.example, "Display gives the name back");
            assert_eq!(spec_of(v).name, spec.name);
            for alias in spec.aliases {
                assert_eq!(lookup(alias).map(|(_, v)| v), Some(v));
            }
        }
        // The derived properties, against the papers' description of each of their variants
        // (default settings: BAM over softmax). A variant added later has no line here: its
        // properties are its plan's, which its own tests check.
        let expect = |name: &str| -> Option<(Family, bool, bool)> {
            match name {
                "softmax" => Some((Family::RowWise, true, false)),
                "dnas" | "sinkhorn-N" => Some((Family::DoublyNormalized, false, false)),
                "hnas" => Some((Family::Hybrid, false, false)),
                n if n.starts_with("bam-") => Some((Family::Bayesian, true, true)),
                _ => None,
            }
        };
        for spec in VARIANTS {
            let p = spec.properties().unwrap();
            if let Some((family, causal_safe, stochastic)) = expect(spec.name) {
                assert_eq!((p.family, p.causal_safe, p.stochastic), (Some(family), causal_safe, stochastic), "{}", spec.name);
            }
            assert!(p.memory_efficient.is_some(), "{}", spec.name);
            let v: Variant = spec.example.parse().unwrap();
            assert_eq!(v.is_stochastic(), p.stochastic, "{}", spec.name);
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            assert_eq!(v.build(&vs.root(), 2, 4, &super::super::NormalizerConfig::default()).unwrap().name(), spec.example);
        }
        for kind in BamKind::ALL {
            assert_eq!(spec_of(Variant::Bam(kind)).properties().unwrap().kl, kind.has_kl(), "{}", kind.name());
        }
        // A variant without a plan: no family, no memory-efficient form, causal by default.
        let p = TEMPERED.properties().unwrap();
        assert_eq!((p.family, p.causal_safe, p.stochastic, p.kl, p.memory_efficient), (None, true, false, false, None));
        // What the Python package reads instead of lists of names.
        let of = |name: &str| lookup(name).unwrap().0.properties().unwrap();
        assert_eq!(of("hnas").parameters, ["hybrid_logit"]);
        assert!(of("bam-wc").parameters.iter().all(|p| p.starts_with("prior.")) && !of("bam-wc").parameters.is_empty());
        assert!(of("bam-wf").parameters.is_empty() && of("softmax").parameters.is_empty());
        let noise = ["bam-nokl", "bam-wf", "bam-lc", "dnas"].map(|n| of(n).noise);
        assert_eq!(noise, [Some("weibull"), Some("weibull"), Some("lognormal"), None]);
        for bad in ["sinkhorn-0", "sinkhorn-", "bam-xx", "Softmax", ""] {
            assert!(lookup(bad).is_none(), "{bad} parsed");
        }
        assert!(known().starts_with("softmax, dnas, hnas, sinkhorn-N (N >= 1), bam-nokl"));
        assert_eq!(benchmarked(), ["softmax", "dnas", "hnas", "sinkhorn-3", "bam-lc", "bam-wc"]);
    }
}
