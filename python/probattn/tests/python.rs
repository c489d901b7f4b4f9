//! Builds the `probattn` Python package from this crate's extension (cargo's own build of it,
//! copied beside the package's Python files as maturin would install it) and runs its tests
//! (`test_*.py` here) with the set-up's Python, against the references of python/probattn_tools.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};

/// The extension cargo built with this test: `lib_native.so` in the target folder of the test
/// binary (`target/<profile>/deps/..`).
fn extension() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let deps = exe.parent().context("test binary folder")?;
    let name = format!("{}_native{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    [deps.join(&name), deps.join("..").join(&name)]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| format!("no {name} beside {} (cargo builds the extension with this crate)", deps.display()))
}

/// `probattn/` in a fresh folder: the package's Python files and the extension as
/// `_native.abi3.so`.
fn package() -> Result<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("python-package");
    let _ = std::fs::remove_dir_all(&dir);
    let pkg = dir.join("probattn");
    std::fs::create_dir_all(&pkg)?;
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("probattn");
    for entry in std::fs::read_dir(&source)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, pkg.join(path.file_name().context("file name")?))?;
        }
    }
    std::fs::copy(extension()?, pkg.join("_native.abi3.so"))?;
    Ok(dir)
}

#[test]
fn the_python_package_passes_its_tests() -> Result<()> {
    // Each test module in a process of its own, all side by side: the compile tests alone take
    // minutes, and one process keeps one core busy most of the time.
    let python = common::python()?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let package = package()?;
    let path = std::env::join_paths([&package, &root.join("python")])?;
    // From the package's folder: `python -m` puts the working directory first on sys.path, and
    // the crate's folder holds the package's sources without the extension.
    common::run_unittest_modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests"), 5, || {
        let mut command = Command::new(&python);
        command.current_dir(&package).env("PYTHONPATH", &path);
        Ok(command)
    })
}

#[test]
fn the_required_torch_is_the_set_ups() -> Result<()> {
    // probattn/__init__.py refuses any torch but the one the extension is built against: the
    // version download_libtorch.sh installs.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let setup = std::fs::read_to_string(root.join("download_libtorch.sh"))?;
    let version = setup.lines().find_map(|l| l.strip_prefix("TORCH_VERSION=")).context("TORCH_VERSION in download_libtorch.sh")?;
    let version = version.trim_matches('"');
    let init = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("probattn/__init__.py"))?;
    ensure!(init.contains(&format!("REQUIRED_TORCH = \"{version}\"")), "probattn/__init__.py does not require torch {version}");
    let pyproject = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("pyproject.toml"))?;
    ensure!(pyproject.contains(&format!("\"torch=={version}\"")), "pyproject.toml does not pin torch=={version}");
    Ok(())
}
