// Links libtorch (CUDA included) and sets its rpath: see link_libtorch.rs at the workspace root.
include!("../link_libtorch.rs");

fn main() {
    link_libtorch();
    // `probattn doctor` reports the tch version this binary was built with, read from the lock
    // file so it cannot drift from what cargo resolved.
    let lock = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = std::fs::read_to_string(&lock).unwrap_or_default();
    let version = text
        .split("[[package]]")
        .find(|p| p.contains("\nname = \"tch\"\n"))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
        .map(|v| v.trim_end_matches('"').to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=PROBATTN_TCH_VERSION={version}");
    // The project's Python (for data conversion and the PyTorch baselines), as
    // download_libtorch.sh set it in .cargo/config.toml; PROBATTN_PYTHON overrides it at run time.
    println!("cargo:rerun-if-env-changed=PROBATTN_PYTHON");
    let python = std::env::var("PROBATTN_PYTHON").unwrap_or_else(|_| "python3".into());
    println!("cargo:rustc-env=PROBATTN_PYTHON_DEFAULT={python}");
}
