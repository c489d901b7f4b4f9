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
    // The code a binary was built from, for results' provenance (a run can outlast commits).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for watched in [".git/HEAD", ".git/index", ".git/packed-refs", "src", "models/src", "experiments/src"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    // A commit moves the branch HEAD points to, not HEAD itself: watch that ref too.
    let head = std::fs::read_to_string(root.join(".git/HEAD")).unwrap_or_default();
    if let Some(reference) = head.trim().strip_prefix("ref: ") {
        println!("cargo:rerun-if-changed={}", root.join(".git").join(reference).display());
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    println!("cargo:rustc-env=PROBATTN_GIT_SHA={}", git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into()));
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!("cargo:rustc-env=PROBATTN_GIT_DIRTY={dirty}");
    // A dirty build's diff against HEAD goes into the binary, so its results can save the code
    // that made them beside them (experiments/src/provenance.rs); empty for a clean build.
    let diff = if dirty { git(&["diff", "HEAD", "--no-color"]).unwrap_or_default() } else { String::new() };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts"));
    std::fs::write(out.join("dirty.diff"), diff).expect("writing the build's diff into OUT_DIR");
}
