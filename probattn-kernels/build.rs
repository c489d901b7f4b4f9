//! Compiles the fused route's Triton kernels ahead of time (`python -m probattn_tools.kernels.aot
//! --route`, with the set-up's Python and Triton: `PROBATTN_PYTHON`) and embeds the cubins and
//! their manifest (`$OUT_DIR/kernels.rs`, included by src/lib.rs).
//!
//! The compile takes minutes on two cores, so its output is kept in a cache folder keyed by
//! everything it reads: the kernels' sources, the set's settings and the Triton version.
//! `PROBATTN_KERNEL_CACHE` (default `$XDG_CACHE_HOME/probattn/kernels` or
//! `~/.cache/probattn/kernels`) is that folder; a build with the same key reuses it.
//!
//! `PROBATTN_CUDA_ARCHS` (as `90`, or `80,90`; default every one compiled) embeds the cubins of
//! those architectures alone, taken from the whole compiled set, as `TORCH_CUDA_ARCH_LIST` narrows
//! PyTorch's build: binaries carried to one kind of GPU need its cubins only (sm_90's are half of
//! the set). A GPU of another architecture then runs on the tiles, with the reason recorded.
//!
//! `PROBATTN_KERNELS=none` embeds no kernel (a faster first build; the fused CUDA route then
//! says it has none). Without a Python that has Triton the build embeds none either, and says why
//! in a warning and in `probattn doctor`; with one, a kernel that fails to compile fails the
//! build.

use std::collections::hash_map::DefaultHasher;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What the embedded set is compiled for (`kernels.aot`'s flags).
const ARCHS: &str = "80,90";
const DTYPES: &str = "bfloat16,float16,float32";
const HEAD_DIMS: &str = "64,128,256";
/// The files of python/probattn_tools/kernels/ the cubins are compiled from: the cache's key.
const SOURCES: [&str; 8] = ["aot.py", "plans.py", "passes.py", "tiles.py", "bam.py", "sinkhorn.py", "settings.py", "tuning.json"];
/// Compiled sets kept in the cache (the newest), for checkouts at other commits.
const KEPT: usize = 4;

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let kernels_dir = root.join("../python/probattn_tools/kernels");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    for var in ["PROBATTN_PYTHON", "PROBATTN_KERNELS", "PROBATTN_KERNEL_CACHE", "PROBATTN_CUDA_ARCHS", "XDG_CACHE_HOME", "HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for name in SOURCES {
        println!("cargo:rerun-if-changed={}", kernels_dir.join(name).display());
    }
    let archs = selected_archs().unwrap_or_else(|why| panic!("probattn-kernels: {why}"));
    let generated = match compiled(&root, &kernels_dir) {
        Ok(dir) => embed(&dir, &archs),
        Err(why) => {
            println!("cargo:warning=probattn-kernels: no fused CUDA kernels embedded: {why}");
            none(&why)
        }
    };
    std::fs::write(out.join("kernels.rs"), generated).expect("writing kernels.rs");
}

/// The architectures to embed, as the manifest names them (`sm_90`): `PROBATTN_CUDA_ARCHS`'s, each
/// one the set is compiled for, or every one.
fn selected_archs() -> Result<Vec<String>, String> {
    let compiled: Vec<&str> = ARCHS.split(',').collect();
    let Ok(given) = std::env::var("PROBATTN_CUDA_ARCHS") else {
        return Ok(compiled.iter().map(|a| format!("sm_{a}")).collect());
    };
    let mut archs = Vec::new();
    for a in given.split(',').map(|a| a.trim().trim_start_matches("sm_")) {
        if !compiled.contains(&a) {
            return Err(format!("PROBATTN_CUDA_ARCHS={given}: the kernels are compiled for {ARCHS}, not {a:?}"));
        }
        archs.push(format!("sm_{a}"));
    }
    archs.sort();
    archs.dedup();
    Ok(archs)
}

/// The cache folder holding the compiled set: found, or compiled now.
fn compiled(root: &Path, kernels_dir: &Path) -> Result<PathBuf, String> {
    if std::env::var("PROBATTN_KERNELS").is_ok_and(|v| v == "none") {
        return Err("PROBATTN_KERNELS=none".into());
    }
    let python = std::env::var("PROBATTN_PYTHON")
        .map_err(|_| "PROBATTN_PYTHON is not set (./download_libtorch.sh writes it into .cargo/config.toml)".to_string())?;
    let triton = Command::new(&python)
        .args(["-c", "import triton; print(triton.__version__)"])
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if !triton.status.success() {
        return Err(format!("{python} has no Triton: {}", String::from_utf8_lossy(&triton.stderr).trim()));
    }
    let version = String::from_utf8_lossy(&triton.stdout).trim().to_string();

    let mut hasher = DefaultHasher::new();
    (version.as_str(), ARCHS, DTYPES, HEAD_DIMS).hash(&mut hasher);
    for name in SOURCES {
        let path = kernels_dir.join(name);
        name.hash(&mut hasher);
        std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?.hash(&mut hasher);
    }
    let cache = std::env::var_os("PROBATTN_KERNEL_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
        base.join("probattn/kernels")
    });
    let dir = cache.join(format!("triton-{version}-{:016x}", hasher.finish()));
    if dir.join("manifest.json").is_file() {
        return Ok(dir);
    }
    prune(&cache);
    // Compiled into a folder of its own, renamed into place once whole: an interrupted build
    // leaves no half-filled set behind to be taken for a whole one.
    let partial = cache.join(format!(".partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    let status = Command::new(&python)
        .args(["-m", "probattn_tools.kernels.aot", "--route", "--arch", ARCHS, "--dtypes", DTYPES, "--head-dims", HEAD_DIMS])
        .arg("--jobs")
        .arg(jobs.to_string())
        .arg("--out")
        .arg(&partial)
        .env("PYTHONPATH", root.join("../python"))
        .env_remove("TRITON_INTERPRET")
        .status()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        panic!("probattn-kernels: compiling the fused route's kernels failed ({status}); the output above says which");
    }
    match std::fs::rename(&partial, &dir) {
        Ok(()) => Ok(dir),
        // Another build finished the same set first: use its folder.
        Err(_) if dir.join("manifest.json").is_file() => {
            let _ = std::fs::remove_dir_all(&partial);
            Ok(dir)
        }
        Err(e) => Err(format!("moving {} to {}: {e}", partial.display(), dir.display())),
    }
}

/// Removes all but the `KEPT - 1` newest compiled sets from the cache, before a new one is added.
fn prune(cache: &Path) {
    let Ok(entries) = std::fs::read_dir(cache) else { return };
    let mut sets: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("triton-"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    sets.sort();
    let excess = sets.len().saturating_sub(KEPT - 1);
    for (_, path) in sets.into_iter().take(excess) {
        let _ = std::fs::remove_dir_all(path);
    }
}

/// `kernels.rs` embedding the manifest's cubins for `archs` and the manifest of those, as one zstd
/// stream (the cubins of one kernel differ little across its specializations: 310 MB become
/// 26), with each cubin's place in the decompressed bytes. The stream (and for part of the
/// architectures, its manifest) is written into the set's folder once.
fn embed(dir: &Path, archs: &[String]) -> String {
    let whole = dir.join("manifest.json");
    let manifest = std::fs::read_to_string(&whole).expect("reading the kernels' manifest");
    let mut value: serde_json::Value = serde_json::from_str(&manifest).expect("the kernels' manifest is JSON");
    let entries = value["entries"].as_array_mut().expect("the manifest lists its entries");
    let before = entries.len();
    entries.retain(|e| archs.iter().any(|a| e["arch"] == a.as_str()));
    // The whole set keeps the names it has always had; a part is named by its architectures.
    let (manifest_path, packed) = if entries.len() == before {
        (whole, dir.join("cubins.zst"))
    } else {
        let part = archs.join("-");
        let path = dir.join(format!("manifest-{part}.json"));
        if !path.is_file() {
            let text = serde_json::to_string_pretty(&value).expect("the manifest as JSON");
            let partial = dir.join(format!(".manifest-{part}.json.{}", std::process::id()));
            std::fs::write(&partial, text).expect("writing the manifest of part of the set");
            std::fs::rename(&partial, &path).expect("moving the manifest into place");
        }
        (path, dir.join(format!("cubins-{part}.zst")))
    };
    let mut places = Vec::new();
    let mut all = Vec::new();
    for entry in value["entries"].as_array().expect("the manifest lists its entries") {
        let file = entry["file"].as_str().expect("each entry names its file");
        let bytes = std::fs::read(dir.join(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"));
        places.push((file.to_string(), all.len(), bytes.len()));
        all.extend_from_slice(&bytes);
    }
    if !packed.is_file() {
        // A window over all of them: a kernel's cubins for the other dtypes and head dimensions
        // lie megabytes apart.
        let mut encoder = zstd::stream::Encoder::new(Vec::new(), 19).expect("a zstd encoder");
        encoder.window_log(27).expect("zstd's window");
        encoder.long_distance_matching(true).expect("zstd's long-distance matching");
        std::io::Write::write_all(&mut encoder, &all).expect("compressing the cubins");
        let compressed = encoder.finish().expect("compressing the cubins");
        let partial = dir.join(format!(".cubins.zst.{}", std::process::id()));
        std::fs::write(&partial, compressed).expect("writing the compressed cubins");
        std::fs::rename(&partial, &packed).expect("moving the compressed cubins into place");
    }
    let mut code = String::new();
    writeln!(code, "pub(crate) static MISSING: Option<&str> = None;").unwrap();
    writeln!(code, "#[cfg_attr(not(test), allow(dead_code))]\npub(crate) static SELECTED: &[&str] = &{archs:?};").unwrap();
    writeln!(code, "pub(crate) static MANIFEST: &str = include_str!({:?});", manifest_path.display().to_string()).unwrap();
    writeln!(code, "pub(crate) static PACKED: &[u8] = include_bytes!({:?});", packed.display().to_string()).unwrap();
    writeln!(code, "pub(crate) const UNPACKED_LEN: usize = {};", all.len()).unwrap();
    writeln!(code, "pub(crate) static PLACES: &[(&str, usize, usize)] = &[").unwrap();
    for (file, offset, len) in places {
        writeln!(code, "    ({file:?}, {offset}, {len}),").unwrap();
    }
    writeln!(code, "];").unwrap();
    code
}

/// `kernels.rs` without kernels, and why.
fn none(why: &str) -> String {
    format!(
        "pub(crate) static MISSING: Option<&str> = Some({why:?});\n#[cfg_attr(not(test), allow(dead_code))]\npub(crate) static SELECTED: &[&str] = &[];\npub(crate) static MANIFEST: &str = \"{{\\\"triton\\\": \\\"\\\", \\\"entries\\\": []}}\";\npub(crate) static PACKED: &[u8] = &[];\npub(crate) const UNPACKED_LEN: usize = 0;\npub(crate) static PLACES: &[(&str, usize, usize)] = &[];\n"
    )
}
