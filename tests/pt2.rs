//! `probattn::interop::Pt2Package`: an AOTInductor package of `nn.MultiheadAttention` made by
//! python/probattn_tools/export/pt2.py runs from Rust and equals the eager module and our native module; what is
//! not a runnable package (missing, truncated, TorchScript, an uncompiled torch.export program, a
//! package for CUDA on a machine without it, wrong inputs) is a named error, never an abort.
//! Also `probattn::memory`'s CPU counter.

mod common;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, ensure, Context, Result};
use common::{run_python, TempDir};
use probattn::interop::{import_params, Pt2Package, TorchScript};
use probattn::{memory, Masks, MhaConfig, MhaInput, Mode, MultiHeadAttention};
use tch::{nn, Device, Kind, Tensor};

/// The folder of the exported package, made once per change of the export scripts (compiling
/// takes ~40 s on two cores): `mha.pt2` (nn.MultiheadAttention(16, 4), float32, with a key
/// padding mask), its inputs, state dict and eager outputs.
fn exported() -> Result<&'static Path> {
    static DIR: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
        let mut hasher = DefaultHasher::new();
        for script in ["probattn_tools/export/pt2.py", "probattn_tools/export/torchscript.py"] {
            std::fs::read(root.join(script)).map_err(|e| e.to_string())?.hash(&mut hasher);
        }
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("pt2-{:016x}", hasher.finish()));
        if !dir.join("mha.pt2").is_file() {
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
            run_python(
                "export.pt2",
                &[
                    "mha",
                    "--embed-dim",
                    "16",
                    "--heads",
                    "4",
                    "--key-padding",
                    "--out",
                    &p("mha.pt2"),
                    "--inputs",
                    &p("in.safetensors"),
                    "--state-dict",
                    &p("sd.safetensors"),
                    "--outputs",
                    &p("out.safetensors"),
                ],
            )
            .map_err(|e| format!("{e:#}"))?;
        }
        Ok(dir)
    });
    dir.as_deref().map_err(|e| anyhow!("exporting the package: {e}"))
}

fn read(dir: &Path, name: &str) -> Result<std::collections::HashMap<String, Tensor>> {
    Ok(probattn::io::read_safetensors(&dir.join(name))?)
}

#[test]
fn a_pt2_package_equals_the_eager_module_and_the_native_one() -> Result<()> {
    let dir = exported()?;
    let package = Pt2Package::load(&dir.join("mha.pt2"), Device::Cpu)?;
    let names: Vec<&str> = package.inputs().context("export.pt2 records the inputs")?.iter().map(|s| s.name.as_str()).collect();
    ensure!(names == ["query", "key", "value", "key_padding_mask"], "inputs {names:?}");
    let inputs = read(dir, "in.safetensors")?;
    let xs: Vec<&Tensor> = names.iter().map(|n| &inputs[*n]).collect();
    let ours = package.run(&xs)?;
    ensure!(ours.len() == 2, "{} outputs", ours.len());
    let eager = read(dir, "out.safetensors")?;
    // float32 rounding: the package's kernels fuse and reorder the eager module's arithmetic.
    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    for (i, name) in ["output", "weights"].iter().enumerate() {
        let d = diff(&ours[i], &eager[*name]);
        ensure!(d < 1e-5, "{name}: the package differs from the eager module by {d}");
    }

    // The package's own weights, under state_dict names, go into a native module...
    let constants = package.named_constants()?;
    let state = read(dir, "sd.safetensors")?;
    let mut names: Vec<&str> = constants.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    ensure!(names == ["in_proj_bias", "in_proj_weight", "out_proj.bias", "out_proj.weight"], "constants {names:?}");
    for (name, t) in &constants {
        ensure!(t.equal(&state[name]), "{name}: the package's weight is not the state dict's");
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(16, 4))?;
    ensure!(import_params(&vs, &constants, |n| Some(n.to_string()), false)?.is_complete());
    // ...which gives the package's outputs (our layout is (N, L, E)).
    let t = |n: &str| inputs[n].transpose(0, 1);
    let (q, k, v) = (t("query"), t("key"), t("value"));
    let masks = Masks { key_padding: Some(&inputs["key_padding_mask"]), ..Default::default() };
    let native = tch::no_grad(|| mha.forward_mode(&MhaInput::new(&q, &k, &v).with_masks(masks).with_weights(), Mode::EVAL))?;
    let d = diff(&native.context.transpose(0, 1), &ours[0]);
    ensure!(d < 1e-5, "native output differs from the package's by {d}");
    let d = diff(&native.weights.context("weights")?.mean_dim(1, false, None), &ours[1]);
    ensure!(d < 1e-5, "native weights differ from the package's by {d}");
    Ok(())
}

fn load_error(path: &Path) -> Result<String> {
    match Pt2Package::load(path, Device::Cpu) {
        Ok(_) => bail!("{} loaded as a package", path.display()),
        Err(e) => Ok(e.to_string()),
    }
}

#[test]
fn what_is_not_a_runnable_package_is_named() -> Result<()> {
    let dir = exported()?;
    let tmp = TempDir::new("pt2-errors")?;
    let package = dir.join("mha.pt2");

    let m = load_error(&tmp.path("absent.pt2"))?;
    ensure!(m.contains("absent.pt2") && m.contains("no such .pt2 package"), "{m}");

    let bytes = std::fs::read(&package)?;
    std::fs::write(tmp.path("truncated.pt2"), &bytes[..bytes.len() / 2])?;
    let m = load_error(&tmp.path("truncated.pt2"))?;
    ensure!(m.contains("truncated.pt2") && m.contains("corrupt, truncated"), "{m}");

    run_python("export.torchscript", &["mha", "--embed-dim", "16", "--heads", "4", "--out", &tmp.path("mha.pt").to_string_lossy()])?;
    let m = load_error(&tmp.path("mha.pt"))?;
    ensure!(m.contains("a TorchScript archive") && m.contains("TorchScript"), "{m}");
    let m = TorchScript::load(&package, Device::Cpu).err().context("a .pt2 loaded as TorchScript")?.to_string();
    ensure!(m.contains("an AOTInductor package") && m.contains("Pt2Package"), "{m}");

    run_python("export.torchscript", &["other-formats", "--dir", &tmp.0.to_string_lossy()])?;
    let m = load_error(&tmp.path("linear.pt2"))?;
    ensure!(m.contains("without compiled code") && m.contains("aoti_compile_and_package"), "{m}");

    if !tch::Cuda::is_available() {
        let cuda = tmp.path("mha-cuda.pt2");
        run_python(
            "export.pt2",
            &["retarget", "--package", &package.to_string_lossy(), "--device-key", "cuda", "--out", &cuda.to_string_lossy()],
        )?;
        let m = load_error(&cuda)?;
        ensure!(m.contains("compiled for CUDA") && m.contains("no CUDA device"), "{m}");
    }
    // A CPU package asked to run on CUDA.
    let m = Pt2Package::load(&package, Device::Cuda(0)).err().context("a CPU package loaded for CUDA")?.to_string();
    ensure!(m.contains("compiled for cpu"), "{m}");

    // Wrong inputs: a count, a shape, a dtype; each named before the compiled model sees it.
    let loaded = Pt2Package::load(&package, Device::Cpu)?;
    let inputs = read(dir, "in.safetensors")?;
    let (q, k, v, pad) = (&inputs["query"], &inputs["key"], &inputs["value"], &inputs["key_padding_mask"]);
    let m = loaded.run(&[q, k, v]).err().context("three inputs ran")?.to_string();
    ensure!(m.contains("takes 4 inputs (query, key, value, key_padding_mask), got 3"), "{m}");
    let longer = Tensor::cat(&[q, q], 0);
    let m = loaded.run(&[&longer, k, v, pad]).err().context("a longer query ran")?.to_string();
    ensure!(m.contains("input query is float32[10, 2, 16]") && m.contains("[5, 2, 16]"), "{m}");
    let double = q.to_kind(Kind::Double);
    let m = loaded.run(&[&double, k, v, pad]).err().context("a float64 query ran")?.to_string();
    ensure!(m.contains("input query is float64"), "{m}");

    // Without the recorded names only the compiled model checks its inputs: the exception it
    // raises inside libtorch's C++ comes back as an error, not an abort.
    let bare = tmp.path("bare.pt2");
    run_python("export.pt2", &["retarget", "--package", &package.to_string_lossy(), "--drop-inputs", "--out", &bare.to_string_lossy()])?;
    let loaded = Pt2Package::load(&bare, Device::Cpu)?;
    ensure!(loaded.inputs().is_none(), "the input names were not dropped");
    ensure!(loaded.run(&[q, k, v, pad])?.len() == 2, "the bare package does not run");
    let m = loaded.run(&[&longer, k, v, pad]).err().context("a longer query ran without the recorded names")?.to_string();
    ensure!(m.contains("bare.pt2") && m.contains("running the package failed"), "{m}");
    let m = loaded.run(&[q, k]).err().context("two inputs ran without the recorded names")?.to_string();
    ensure!(m.contains("running the package failed"), "{m}");
    Ok(())
}

#[test]
fn cpu_memory_is_counted_by_tensor_bytes() -> Result<()> {
    memory::track(Device::Cpu)?;
    let (kept, peak) = memory::peak_during(Device::Cpu, || {
        let big = Tensor::ones([1024, 1024], (Kind::Float, Device::Cpu)); // 4 MiB, freed at the end
        let small = Tensor::ones([256, 256], (Kind::Double, Device::Cpu)); // 512 KiB, kept
        let _ = big.sum(Kind::Float);
        small
    })?;
    let mib = 1024 * 1024;
    // Other tests of this binary run in parallel threads and allocate too: bounds, not equalities.
    ensure!(peak >= 4 * mib + mib / 2, "peak {peak} below the 4.5 MiB this held at once");
    let after = memory::stats(Device::Cpu)?;
    ensure!(after.current_bytes >= mib / 2 && after.peak_bytes >= after.current_bytes, "the kept 512 KiB are not counted: {after:?}");
    drop(kept);
    // CUDA statistics on a machine without CUDA: a named error, not an abort.
    if !tch::Cuda::is_available() {
        let m = memory::stats(Device::Cuda(0)).err().context("CUDA statistics without CUDA")?.to_string();
        ensure!(m.contains("memory statistics") && m.contains("CUDA"), "{m}");
    }
    Ok(())
}
