//! `probattn::interop`: TorchScript modules written by python/probattn_tools/export/torchscript.py load, list
//! their parameters and buffers and run; what is not TorchScript (a torch.export package, a torch.save
//! pickle, a truncated or foreign file), a missing method and inputs the module rejects are named
//! errors; PyTorch state dicts go into a native MultiHeadAttention by name with a report, and
//! back out under the same names, which PyTorch loads with `load_state_dict(strict=True)`.

mod common;

use anyhow::{ensure, Context, Result};
use common::{devices, run_python, TempDir};
use probattn::interop::{archive_kind, export_params, import_params, read_state_dict, ArchiveKind, TorchScript};
use probattn::{Error, MhaConfig, MhaInput, Mode, MultiHeadAttention};
use tch::{nn, IValue, Kind, Tensor};

/// Exports a scripted nn.MultiheadAttention(16, 4) in float64 with its state dict and inputs.
fn export_mha(tmp: &TempDir, method: &str) -> Result<()> {
    let (m, sd, inputs) = (tmp.path("mha.pt"), tmp.path("sd.safetensors"), tmp.path("in.safetensors"));
    run_python(
        "export.torchscript",
        &[
            "mha",
            "--embed-dim",
            "16",
            "--heads",
            "4",
            "--method",
            method,
            "--dtype",
            "float64",
            "--out",
            &m.to_string_lossy(),
            "--state-dict",
            &sd.to_string_lossy(),
            "--inputs",
            &inputs.to_string_lossy(),
        ],
    )
}

fn message(e: &Error) -> String {
    e.to_string()
}

#[test]
fn torchscript_loads_runs_and_matches_the_native_module() -> Result<()> {
    let tmp = TempDir::new("interop-load")?;
    export_mha(&tmp, "script")?;
    ensure!(archive_kind(&tmp.path("mha.pt"))? == ArchiveKind::TorchScript);
    for device in devices() {
        let ts = TorchScript::load(&tmp.path("mha.pt"), device)?;
        let params = ts.named_parameters()?;
        let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        ensure!(names == ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"], "parameters: {names:?}");

        // The same weights in a native module give the module's output (PyTorch layout (L, N, E)).
        let vs = nn::VarStore::new(device);
        let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(16, 4))?;
        let mut vs = vs;
        vs.double();
        let report = import_params(&vs, &params, |n| Some(n.to_string()), false)?;
        ensure!(report.is_complete() && report.matched.len() == 4, "{}", report.summary());
        let inputs = probattn::io::read_safetensors(&tmp.path("in.safetensors"))?;
        let get = |n: &str| inputs.get(n).map(|t| t.to_device(device)).context(n.to_string());
        let (q, k, v) = (get("query")?, get("key")?, get("value")?);
        let out =
            ts.forward_tensors(&[IValue::Tensor(q.shallow_clone()), IValue::Tensor(k.shallow_clone()), IValue::Tensor(v.shallow_clone())])?;
        let (q2, k2, v2) = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1));
        let ours = mha.forward_mode(&MhaInput::new(&q2, &k2, &v2), Mode::EVAL)?.context.transpose(0, 1);
        let err = (&out[0].1 - &ours).abs().max().double_value(&[]);
        ensure!(err < 1e-12, "{device:?}: native output differs from TorchScript by {err}");
        // ...and a wrong weight is seen.
        let _ = tch::no_grad(|| vs.variables()["out_proj.bias"].shallow_clone().g_add_scalar_(1e-6));
        let ours = mha.forward_mode(&MhaInput::new(&q2, &k2, &v2), Mode::EVAL)?.context.transpose(0, 1);
        ensure!((&out[0].1 - &ours).abs().max().double_value(&[]) > 5e-7, "a changed bias went unseen");
    }
    Ok(())
}

#[test]
fn what_is_not_torchscript_is_named() -> Result<()> {
    let tmp = TempDir::new("interop-formats")?;
    export_mha(&tmp, "trace")?;
    run_python("export.torchscript", &["other-formats", "--dir", &tmp.0.to_string_lossy()])?;
    let err = |name: &str| -> Result<String> {
        match TorchScript::load(&tmp.path(name), tch::Device::Cpu) {
            Ok(_) => anyhow::bail!("{name} loaded as TorchScript"),
            Err(e) => Ok(message(&e)),
        }
    };
    let m = err("linear.pt2")?;
    ensure!(m.contains("linear.pt2") && m.contains("torch.export") && m.contains("torch.jit.script"), "{m}");
    let m = err("state.pt")?;
    ensure!(m.contains("torch.save() pickle") && m.contains("safetensors"), "{m}");
    let m = err("sd.safetensors")?;
    ensure!(m.contains("not a TorchScript archive"), "{m}");
    let m = err("absent.pt")?;
    ensure!(m.contains("absent.pt") && m.contains("no such"), "{m}");
    // A truncated archive, and one whose directory is intact but whose contents are not.
    let bytes = std::fs::read(tmp.path("mha.pt"))?;
    std::fs::write(tmp.path("truncated.pt"), &bytes[..bytes.len() / 2])?;
    let m = err("truncated.pt")?;
    ensure!(m.contains("truncated.pt") && m.contains("not a TorchScript archive"), "{m}");
    let mut garbled = bytes.clone();
    let data_pkl = garbled.windows(8).position(|w| w == b"data.pkl").context("no data.pkl in the archive")?;
    for b in &mut garbled[data_pkl + 8..data_pkl + 200] {
        *b = 0x5a;
    }
    std::fs::write(tmp.path("garbled.pt"), &garbled)?;
    let m = err("garbled.pt")?;
    ensure!(m.contains("garbled.pt"), "{m}");
    Ok(())
}

#[test]
fn missing_methods_and_rejected_inputs_are_named() -> Result<()> {
    let tmp = TempDir::new("interop-call")?;
    export_mha(&tmp, "script")?;
    let ts = TorchScript::load(&tmp.path("mha.pt"), tch::Device::Cpu)?;
    let x = Tensor::randn([5, 2, 16], (Kind::Double, tch::Device::Cpu));
    let m = message(&ts.call("translate", &[IValue::Tensor(x.shallow_clone())]).unwrap_err());
    ensure!(m.contains("mha.pt") && m.contains("no method 'translate'"), "{m}");
    // A 4-D query: nn.MultiheadAttention takes 2-D or 3-D.
    let q = Tensor::randn([5, 2, 1, 16], (Kind::Double, tch::Device::Cpu));
    let m = message(
        &ts.call("forward", &[IValue::Tensor(q), IValue::Tensor(x.shallow_clone()), IValue::Tensor(x.shallow_clone())]).unwrap_err(),
    );
    ensure!(m.contains("forward(Double[5, 2, 1, 16]") && m.contains("Error"), "{m}");
    ensure!(!m.contains("Traceback"), "the TorchScript traceback leaked into the message: {m}");
    // The wrong dtype.
    let q = Tensor::randn([5, 2, 16], (Kind::Float, tch::Device::Cpu));
    let m = message(&ts.call("forward", &[IValue::Tensor(q), IValue::Tensor(x.shallow_clone()), IValue::Tensor(x)]).unwrap_err());
    ensure!(m.contains("Float[5, 2, 16]") && m.contains("Error"), "{m}");
    Ok(())
}

#[test]
fn state_dicts_go_both_ways_by_name() -> Result<()> {
    let tmp = TempDir::new("interop-weights")?;
    export_mha(&tmp, "script")?;
    let source = read_state_dict(&tmp.path("sd.safetensors"))?;
    let fresh = || -> Result<(nn::VarStore, MultiHeadAttention)> {
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(16, 4))?;
        vs.double();
        Ok((vs, mha))
    };

    // In: every tensor copied.
    let (vs, _) = fresh()?;
    import_params(&vs, &source, |n| Some(n.to_string()), false)?;
    for (name, t) in &source {
        ensure!(vs.variables()[name].equal(t), "{name} not copied exactly");
    }

    // A mismatch is refused whole, with every problem named, unless partial imports are allowed.
    let mut bad: Vec<(String, Tensor)> =
        source.iter().filter(|(n, _)| n != "out_proj.bias").map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    bad.push(("out_proj.scale".into(), Tensor::ones([16], (Kind::Double, tch::Device::Cpu))));
    let wrong = bad.iter_mut().find(|(n, _)| n == "in_proj_bias").context("in_proj_bias")?;
    wrong.1 = Tensor::zeros([47], (Kind::Double, tch::Device::Cpu));
    let (vs, _) = fresh()?;
    let before = vs.variables()["in_proj_weight"].copy();
    let m = message(&import_params(&vs, &bad, |n| Some(n.to_string()), false).unwrap_err());
    for needle in [
        "missing (not in the source): out_proj.bias",
        "unexpected (no such parameter here): out_proj.scale",
        "wrong shape: in_proj_bias: source [47], here [48]",
    ] {
        ensure!(m.contains(needle), "no '{needle}' in:\n{m}");
    }
    ensure!(vs.variables()["in_proj_weight"].equal(&before), "a refused import changed the weights");
    let report = import_params(&vs, &bad, |n| Some(n.to_string()), true)?;
    ensure!(report.matched == ["in_proj_weight", "out_proj.weight"], "{report:?}");
    let want = &source.iter().find(|(n, _)| n == "in_proj_weight").context("in_proj_weight")?.1;
    ensure!(vs.variables()["in_proj_weight"].equal(want), "the partial import skipped a match");

    // Out: a native module's weights load into PyTorch strictly; a misnamed export does not.
    let (vs, _) = fresh()?;
    let out = tmp.path("ours.safetensors");
    export_params(&vs, &out, |n| n.to_string())?;
    run_python(
        "export.torchscript",
        &["load-state-dict", "mha", "--embed-dim", "16", "--heads", "4", "--state-dict", &out.to_string_lossy()],
    )?;
    let misnamed = tmp.path("misnamed.safetensors");
    export_params(&vs, &misnamed, |n| n.replace("out_proj.", "out_proj_"))?;
    let refused = run_python(
        "export.torchscript",
        &["load-state-dict", "mha", "--embed-dim", "16", "--heads", "4", "--state-dict", &misnamed.to_string_lossy()],
    );
    ensure!(refused.is_err_and(|e| e.to_string().contains("out_proj_weight")), "PyTorch accepted a misnamed state dict");
    Ok(())
}

#[test]
fn the_svgd_hook_moves_a_torchscript_module_as_it_moves_the_native_one() -> Result<()> {
    use probattn::interop::register_in_proj;
    use probattn::repulsive::{ModuleKind, RepulsiveConfig, RepulsiveHook, Selection};
    use tch::nn::OptimizerConfig;

    let tmp = TempDir::new("interop-svgd")?;
    export_mha(&tmp, "script")?;
    for device in devices() {
        // The TorchScript module, trainable through a VarStore, and the native module with its weights.
        let vs_ts = nn::VarStore::new(device);
        let ts = TorchScript::load_trainable(&tmp.path("mha.pt"), &vs_ts.root())?;
        let params = ts.named_parameters()?;
        let mut vs = nn::VarStore::new(device);
        let mha = MultiHeadAttention::new(&vs.root(), MhaConfig::new(16, 4))?;
        vs.double();
        import_params(&vs, &params, |n| Some(n.to_string()), false)?;

        let inputs = probattn::io::read_safetensors(&tmp.path("in.safetensors"))?;
        let get = |n: &str| inputs.get(n).map(|t| t.to_device(device)).context(n.to_string());
        let (q, k, v) = (get("query")?, get("key")?, get("value")?);
        let g = Tensor::randn([5, 2, 16], (Kind::Double, device));
        let ts_out = |ts: &TorchScript| -> Result<Tensor> {
            Ok(ts
                .forward_tensors(&[
                    IValue::Tensor(q.shallow_clone()),
                    IValue::Tensor(k.shallow_clone()),
                    IValue::Tensor(v.shallow_clone()),
                ])?
                .remove(0)
                .1)
        };
        let native_out = || -> Result<Tensor> {
            let (q2, k2, v2) = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1));
            Ok(mha.forward_mode(&MhaInput::new(&q2, &k2, &v2), Mode::EVAL)?.context.transpose(0, 1))
        };
        (ts_out(&ts)? * &g).sum(Kind::Double).backward();
        (native_out()? * &g).sum(Kind::Double).backward();

        let cfg = RepulsiveConfig { alpha: 0.5, stepsize: 0.1, ..Default::default() };
        let mut hook_ts = RepulsiveHook::new(cfg.clone(), Selection::default())?;
        let names = register_in_proj(&mut hook_ts, &params, "*in_proj_weight", 4)?;
        ensure!(names == ["in_proj_weight"] && hook_ts.sets().len() == 3, "{names:?}, {} sets", hook_ts.sets().len());
        let mut hook_n = RepulsiveHook::new(cfg, Selection::default())?;
        hook_n.add_attention("mha", &mha, ModuleKind::Other, 0);
        let plain = vs.variables()["in_proj_weight"].grad().copy();
        hook_ts.apply()?;
        hook_n.apply()?;
        let (grad_ts, grad_n) = (params[0].1.grad(), vs.variables()["in_proj_weight"].grad());
        let err = (&grad_ts - &grad_n).abs().max().double_value(&[]);
        ensure!(err < 1e-12, "{device:?}: the hook's directions differ by {err}");
        ensure!((&grad_n - &plain).abs().max().double_value(&[]) > 1e-4, "the hook left the gradient as it was");

        // One SGD step on each VarStore moves the TorchScript module's own weights the same way.
        let before = params[0].1.copy();
        let mut opt_ts = nn::Sgd::default().build(&vs_ts, 0.1)?;
        let mut opt_n = nn::Sgd::default().build(&vs, 0.1)?;
        opt_ts.step();
        opt_n.step();
        for (name, t) in ts.named_parameters()? {
            let err = (&t - &vs.variables()[&name]).abs().max().double_value(&[]);
            ensure!(err < 1e-12, "{device:?}: {name} differs by {err} after the step");
        }
        ensure!((&ts.named_parameters()?[0].1 - &before).abs().max().double_value(&[]) > 1e-4, "the step did not move the module");
        let err = tch::no_grad(|| -> Result<f64> { Ok((ts_out(&ts)? - native_out()?).abs().max().double_value(&[])) })?;
        ensure!(err < 1e-12, "{device:?}: after the step the outputs differ by {err}");
    }
    Ok(())
}

/// `register_in_proj` takes a glob over the module's parameter names; one that matches none of them
/// is an error that lists them.
#[test]
fn an_in_proj_pattern_that_matches_no_parameter_is_named() -> Result<()> {
    use probattn::interop::{glob_match, register_in_proj};
    use probattn::repulsive::{RepulsiveConfig, RepulsiveHook, Selection};

    ensure!(
        glob_match("*.self_attn.in_proj_weight", "layers.0.self_attn.in_proj_weight")
            && !glob_match("*.self_attn.in_proj_weight", "in_proj_weight")
    );
    let tmp = TempDir::new("interop-glob")?;
    export_mha(&tmp, "script")?;
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let params = TorchScript::load_trainable(&tmp.path("mha.pt"), &vs.root())?.named_parameters()?;
    let mut hook = RepulsiveHook::new(RepulsiveConfig::default(), Selection::default())?;
    let unmatched = register_in_proj(&mut hook, &params, "*.self_attn.in_proj_weight", 4);
    ensure!(
        unmatched.is_err_and(|e| e.to_string().contains("in_proj_weight parameters: in_proj_weight")),
        "an unmatched pattern was accepted"
    );
    Ok(())
}

#[test]
fn buffers_are_listed_as_pytorch_lists_them() -> Result<()> {
    // Nested BatchNorm statistics (moved by a training step) and its int64 counter, float64, bool,
    // a strided view of a larger tensor, a ModuleList member; scripted and traced.
    let tmp = TempDir::new("interop-buffers")?;
    for method in ["script", "trace"] {
        let (m, expected) = (tmp.path(&format!("{method}.pt")), tmp.path(&format!("{method}.safetensors")));
        run_python(
            "export.torchscript",
            &["buffers", "--out", &m.to_string_lossy(), "--expected", &expected.to_string_lossy(), "--method", method],
        )?;
        let want = read_state_dict(&expected)?;
        for device in devices() {
            let ts = TorchScript::load(&m, device)?;
            let got = ts.named_buffers()?;
            let (mut a, mut b): (Vec<&str>, Vec<&str>) =
                (got.iter().map(|(n, _)| n.as_str()).collect(), want.iter().map(|(n, _)| n.as_str()).collect());
            a.sort_unstable();
            b.sort_unstable();
            ensure!(a == b && b.len() == 9, "{method}: buffers {a:?}, PyTorch lists {b:?}");
            for (name, t) in &got {
                let w = &want.iter().find(|(n, _)| n == name).context("listed")?.1;
                ensure!(
                    t.device() == device && t.kind() == w.kind() && t.size() == w.size(),
                    "{method} {name}: {:?} {:?} {:?} vs {:?} {:?}",
                    t.device(),
                    t.kind(),
                    t.size(),
                    w.kind(),
                    w.size()
                );
                ensure!(t.to_device(tch::Device::Cpu).equal(w), "{method} {name}: values differ");
            }
            // Parameters are not buffers.
            let params: Vec<String> = ts.named_parameters()?.into_iter().map(|(n, _)| n).collect();
            ensure!(params.iter().all(|p| !a.contains(&p.as_str())) && params.contains(&"bn.weight".to_string()), "{params:?}");
        }
    }
    Ok(())
}
