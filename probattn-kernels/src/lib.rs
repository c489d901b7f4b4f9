//! probattn's fused GPU kernels, compiled ahead of time and embedded: the Triton kernels of the
//! deterministic plans (python/probattn_tools/kernels/, docs/kernels.md) as cubins for sm_80 and
//! sm_90 (or those of them `PROBATTN_CUDA_ARCHS` names), in bfloat16 and float16 (and in float32
//! with TF32 products, the deterministic plans only), for head dimensions 64, 128 and 256, each
//! with what launching it takes (its parameters in order, its warps, its shared memory). The set
//! is the one the fused CUDA route launches (`kernels.aot --route`);
//! probattn-sys/csrc/fused_cuda.cpp launches them through the CUDA driver API.
//!
//! The build compiles them with the set-up's Triton (build.rs says how, and where it keeps them) and
//! packs them into one zstd stream (310 MB of cubins take 26 in each binary); [`Kernel::cubin`]
//! unpacks them on first use. Nothing here needs a GPU: a build without Triton embeds none and
//! [`missing`] says why.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::Deserialize;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// One parameter of a kernel, in launch order: a pointer (`*bf16`, `*fp16`, `*fp32`, `*u8`,
/// `*i64`) or a 32-bit integer (`i32`).
#[derive(Clone, Debug, Deserialize)]
pub struct Param {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    /// The multiple the cubin was compiled to assume of it (an integer's value, a pointer's
    /// address in bytes): 16 for the inputs, their strides and head dimensions, else 1.
    #[serde(default = "one")]
    pub divisible: i64,
}

fn one() -> i64 {
    1
}

/// One embedded cubin: a kernel specialized for an architecture, a dtype, a head dimension and
/// its constexprs.
#[derive(Clone, Debug, Deserialize)]
pub struct Kernel {
    /// The Triton function's name (`_row_pass`, ...).
    pub kernel: String,
    /// `sm_80`, `sm_90`.
    pub arch: String,
    /// `bfloat16`, `float16`.
    pub dtype: String,
    pub head_dim: i64,
    /// The constexprs a launch chooses (masks, sweeps, causal, ...), booleans as 0 and 1.
    #[serde(deserialize_with = "as_integers")]
    pub key: BTreeMap<String, i64>,
    pub params: Vec<Param>,
    /// A block of 32 × `num_warps` threads.
    pub num_warps: u32,
    /// Software pipeline stages (compiled in; the launch does not set them).
    pub num_stages: u32,
    /// Queries per block (the programs over queries are ⌈S_q / block_m⌉ per batch and head).
    pub block_m: i64,
    /// Keys per block.
    pub block_n: i64,
    /// Dynamic shared memory per block.
    pub shared_bytes: u32,
    /// The function's name in the cubin.
    pub symbol: String,
    #[serde(default)]
    pub global_scratch_bytes: u64,
    #[serde(default)]
    pub profile_scratch_bytes: u64,
    pub file: String,
    /// Where its bytes lie in the unpacked cubins: (offset, length).
    #[serde(skip)]
    place: (usize, usize),
}

impl Kernel {
    /// The cubin (all of them are unpacked on the first call: 64 MB, a fraction of a second).
    pub fn cubin(&self) -> &'static [u8] {
        static UNPACKED: OnceLock<Vec<u8>> = OnceLock::new();
        let all = UNPACKED.get_or_init(|| {
            // The build packed these bytes and checked the length; they cannot differ at run time.
            zstd::bulk::decompress(embedded::PACKED, embedded::UNPACKED_LEN).expect("the embedded cubins unpack")
        });
        all.get(self.place.0..self.place.0 + self.place.1).unwrap_or(&[])
    }

    /// The compute capability as a number: `sm_90` → 90.
    pub fn arch_number(&self) -> u32 {
        self.arch.trim_start_matches("sm_").parse().unwrap_or(0)
    }
}

fn as_integers<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, i64>, D::Error> {
    let raw = BTreeMap::<String, serde_json::Value>::deserialize(d)?;
    raw.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::Bool(b) => Ok((k, i64::from(b))),
            serde_json::Value::Number(n) if n.is_i64() => Ok((k, n.as_i64().unwrap_or_default())),
            other => Err(serde::de::Error::custom(format!("constexpr {k} is {other}, not a boolean or an integer"))),
        })
        .collect()
}

#[derive(Deserialize)]
struct Manifest {
    triton: String,
    entries: Vec<Kernel>,
}

fn manifest() -> &'static Manifest {
    static MANIFEST: OnceLock<Manifest> = OnceLock::new();
    MANIFEST.get_or_init(|| {
        // The build wrote and checked this JSON; it cannot differ at run time.
        let mut manifest: Manifest = serde_json::from_str(embedded::MANIFEST).expect("the embedded manifest is the build's");
        for entry in &mut manifest.entries {
            entry.place = embedded::PLACES.iter().find(|(file, _, _)| *file == entry.file).map_or((0, 0), |(_, at, len)| (*at, *len));
        }
        manifest
    })
}

/// Every embedded kernel.
pub fn kernels() -> &'static [Kernel] {
    &manifest().entries
}

/// The Triton version that compiled them (empty without kernels).
pub fn triton_version() -> &'static str {
    &manifest().triton
}

/// Why the build embedded no kernel (`None` when it embedded them).
pub fn missing() -> Option<&'static str> {
    embedded::MISSING
}

/// The architectures with embedded kernels, `sm_80`, `sm_90`, each with its count.
pub fn architectures() -> Vec<(String, usize)> {
    let mut counts = BTreeMap::new();
    for k in kernels() {
        *counts.entry(k.arch.clone()).or_insert(0) += 1;
    }
    counts.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_has_its_cubin_and_every_arch_the_whole_set() {
        if let Some(why) = missing() {
            eprintln!("no kernels embedded: {why}");
            return;
        }
        let all = kernels();
        assert!(!all.is_empty());
        for k in all {
            // ELF, as every cubin is.
            let cubin = k.cubin();
            assert!(cubin.len() > 1000 && cubin.starts_with(b"\x7fELF"), "{}: {} bytes", k.file, cubin.len());
            assert!(k.params.iter().all(|p| p.ty == "i32" || p.ty.starts_with('*')), "{}", k.file);
            // Compiled for aligned inputs: q, k, v, their strides and the head dimensions as
            // multiples of 16 (the launcher checks each); lengths and statistics as they come.
            for p in &k.params {
                let aligned = ["Q", "K", "V", "D", "DV", "stride_qs", "stride_ks", "stride_vs"].contains(&p.name.as_str());
                let free = ["S_Q", "S_K", "H", "C", "R", "KPAD", "stride_kpad"].contains(&p.name.as_str());
                assert!(!aligned || p.divisible == 16, "{}: {} {}", k.file, p.name, p.divisible);
                assert!(!free || p.divisible == 1, "{}: {} {}", k.file, p.name, p.divisible);
            }
            assert_eq!((k.global_scratch_bytes, k.profile_scratch_bytes), (0, 0), "{}", k.file);
        }
        // The same specializations for each (arch, 16-bit dtype, head dim): 64, 128 and 256; and
        // for float32, at 64 and 128, the deterministic ones among them (no noise).
        let mut sets: BTreeMap<(String, String, i64), Vec<String>> = BTreeMap::new();
        for k in all {
            sets.entry((k.arch.clone(), k.dtype.clone(), k.head_dim)).or_default().push(format!("{}{:?}", k.kernel, k.key));
        }
        for set in sets.values_mut() {
            set.sort();
        }
        let keys: Vec<_> = sets.keys().map(|(a, d, h)| format!("{a} {d} {h}")).collect();
        let mut want = Vec::new();
        // Every architecture compiled, unless the build chose some (PROBATTN_CUDA_ARCHS).
        if option_env!("PROBATTN_CUDA_ARCHS").is_none() {
            assert_eq!(embedded::SELECTED, ["sm_80", "sm_90"]);
        }
        for arch in embedded::SELECTED {
            for (dtype, dims) in [("bfloat16", &[64, 128, 256][..]), ("float16", &[64, 128, 256]), ("float32", &[64, 128])] {
                want.extend(dims.iter().map(|h| format!("{arch} {dtype} {h}")));
            }
        }
        assert_eq!(keys, want);
        let newest = embedded::SELECTED.last().expect("an architecture").to_string();
        let wide = &sets[&(newest.clone(), "bfloat16".to_string(), 64)];
        let narrow = &sets[&(newest, "float32".to_string(), 64)];
        assert_eq!((wide.len(), narrow.len()), (174, 84));
        // Softmax's key pass that adds dQ by atomics: in 16-bit dtypes up to head dimension 128
        // (settings.py's atomic_dq), 6 deterministic and 8 of BAM's.
        let atomic = |s: &&String| s.starts_with("_key_pass") && s.contains("\"ATOMIC_DQ\": 1");
        assert_eq!((wide.iter().filter(atomic).count(), narrow.iter().filter(atomic).count()), (14, 0));
        let deterministic: Vec<&String> =
            wide.iter().filter(|s| !s.contains("\"NOISE\": 1") && !s.contains("\"NOISE\": 2") && !atomic(s)).collect();
        assert_eq!(narrow.iter().collect::<Vec<_>>(), deterministic);
        for ((_, dtype, head_dim), set) in &sets {
            let want: Vec<&String> =
                if dtype == "float32" { narrow.iter().collect() } else { wide.iter().filter(|s| *head_dim <= 128 || !atomic(s)).collect() };
            assert_eq!(set.iter().collect::<Vec<_>>(), want, "{dtype} {head_dim}");
        }
        assert_eq!(architectures().iter().map(|(a, _)| a.as_str()).collect::<Vec<_>>(), embedded::SELECTED);
    }

    #[test]
    fn every_cubin_has_its_tuning_table_entry_or_the_default_launch_setting() {
        if let Some(why) = missing() {
            eprintln!("no kernels embedded: {why}");
            return;
        }
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../python/probattn_tools/kernels/tuning.json");
        let table: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).expect("the tuning table")).expect("JSON");
        for k in kernels() {
            // float16 takes bfloat16's entry where it has none of its own.
            let own = &table["configs"][&k.arch][&k.dtype][k.head_dim.to_string()];
            let mut entry =
                if own.is_null() && k.dtype == "float16" { &table["configs"][&k.arch]["bfloat16"][k.head_dim.to_string()] } else { own };
            // A kernel's own setting where the entry names it (kernels.settings' `kernel_key`),
            // except for the specializations that read a block map.
            let name = if k.key.get("NOISE").copied().unwrap_or(0) > 0 { format!("{}:noise", k.kernel) } else { k.kernel.clone() };
            if k.key.get("HAS_MASK").copied().unwrap_or(0) == 0 && !entry["kernels"][&name].is_null() {
                entry = &entry["kernels"][&name];
            }
            // The defaults (kernels.sweep's `default`): 32-query blocks for float32 above head
            // dimension 64, 8 warps above 128.
            let want = if entry.is_null() {
                (if k.dtype == "float32" && k.head_dim > 64 { 32 } else { 64 }, 64, if k.head_dim > 128 { 8 } else { 4 }, 2)
            } else {
                let field = |name: &str| entry[name].as_i64().unwrap_or_else(|| panic!("{path}: {name} of {entry}"));
                (field("block_m"), field("block_n"), field("num_warps"), field("num_stages"))
            };
            let have = (k.block_m, k.block_n, i64::from(k.num_warps), i64::from(k.num_stages));
            assert_eq!(have, want, "{} ({} {} d {})", k.file, k.arch, k.dtype, k.head_dim);
        }
    }
}
