//! `probattn compare` as a user runs it on torch.nn.MultiheadAttention exported by
//! python/probattn_tools/export/torchscript.py: agreement within the stated tolerances (float64 1e-12, float32
//! 1e-5, forward and gradients), the layout found on its own, a wrong head count caught, and bad
//! input named with exit status 1.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use anyhow::{ensure, Context, Result};
use binary::{probattn, text};
use common::{python_module, run_python, write_corpus, TempDir};

/// Exports nn.MultiheadAttention(16, 4) with `extra` flags; returns (module, inputs) paths.
fn export(tmp: &TempDir, tag: &str, extra: &[&str]) -> Result<(String, String)> {
    export_model("mha", tmp, tag, extra)
}

fn export_model(model: &str, tmp: &TempDir, tag: &str, extra: &[&str]) -> Result<(String, String)> {
    let (m, i) = (
        tmp.path(&format!("{tag}.pt")).to_string_lossy().to_string(),
        tmp.path(&format!("{tag}.safetensors")).to_string_lossy().to_string(),
    );
    run_python("export.torchscript", &[&[model, "--embed-dim", "16", "--heads", "4", "--out", &m, "--inputs", &i][..], extra].concat())?;
    Ok((m, i))
}

fn compare(module: &str, inputs: &str, extra: &[&str]) -> Result<serde_json::Value> {
    compare_native("mha", module, inputs, extra)
}

fn compare_native(native: &str, module: &str, inputs: &str, extra: &[&str]) -> Result<serde_json::Value> {
    let o = probattn(
        &[
            &[
                "compare",
                "--torchscript",
                module,
                "--native",
                native,
                "--heads",
                "4",
                "--inputs",
                inputs,
                "--json",
                "--threads",
                "1",
                "--repeats",
                "3",
            ][..],
            extra,
        ]
        .concat(),
    )?;
    ensure!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).with_context(|| text(&o))
}

/// `nn.Transformer` (E 16, 4 heads, 2 + 2 layers, FFN 32) loads the state dict at `path` with
/// `strict=True`: our weights carry PyTorch's names and shapes.
fn loads_into_nn_transformer(path: &std::path::Path) -> Result<()> {
    let path = path.to_string_lossy();
    let args =
        ["load-state-dict", "transformer", "--embed-dim", "16", "--heads", "4", "--layers", "2", "--ffn", "32", "--state-dict", &path];
    run_python("export.torchscript", &args)
}

fn worst(json: &serde_json::Value) -> Result<(f64, usize)> {
    let outputs = json["outputs"].as_array().context("no outputs")?;
    let worst = outputs.iter().map(|o| o["max_rel_diff"].as_f64().unwrap_or(f64::INFINITY)).fold(0.0, f64::max);
    Ok((worst, outputs.len()))
}

#[test]
fn multihead_attention_agrees_forward_and_backward() -> Result<()> {
    let tmp = TempDir::new("compare-mha")?;
    // float64, scripted, PyTorch's default layout (L, N, E), with a key padding mask.
    let (m, i) = export(&tmp, "f64", &["--dtype", "float64", "--key-padding", "--method", "script"])?;
    let json = compare(&m, &i, &["--backward"])?;
    let (rel, n) = worst(&json)?;
    ensure!(n == 9, "expected output, weights, 3 input and 4 parameter gradients: {json}");
    ensure!(rel <= 1e-12, "float64 differs by {rel} (relative): {json}");
    ensure!(json["batch_first"] == false && json["dtype"] == "double", "{json}");
    ensure!(json["torchscript_ms"].as_f64().is_some_and(|t| t > 0.0) && json["native_ms"].as_f64().is_some_and(|t| t > 0.0), "{json}");

    // float32, traced, batch_first: the layout is found without being told.
    let (m, i) = export(&tmp, "f32", &["--batch-first", "--method", "trace", "--batch", "3", "--tgt-len", "4", "--src-len", "6"])?;
    let json = compare(&m, &i, &["--backward"])?;
    let (rel, _) = worst(&json)?;
    ensure!(rel <= 1e-5, "float32 differs by {rel}: {json}");
    ensure!(json["batch_first"] == true && json["dtype"] == "float", "{json}");

    // The comparison can fail: the wrong head count gives other weights and outputs.
    let o = probattn(&["compare", "--torchscript", &m, "--native", "mha", "--heads", "2", "--inputs", &i, "--json", "--repeats", "1"])?;
    ensure!(o.status.success(), "{}", text(&o));
    let (rel, _) = worst(&serde_json::from_slice(&o.stdout)?)?;
    ensure!(rel > 1e-3, "--heads 2 against a 4-head module agreed to {rel}");
    Ok(())
}

#[test]
fn nn_transformer_agrees_and_its_weights_go_both_ways() -> Result<()> {
    use probattn::interop::export_params;
    use probattn_models::transformer::{pytorch_name, Transformer, TransformerConfig};

    let tmp = TempDir::new("compare-transformer")?;
    // float64, time-first, padded sources and targets: every output and gradient.
    let (m, i) = export_model("transformer", &tmp, "f64", &["--dtype", "float64", "--key-padding", "--layers", "2", "--ffn", "32"])?;
    let json = compare_native("transformer", &m, &i, &["--backward"])?;
    let (rel, n) = worst(&json)?;
    // output, grad.src, grad.tgt, and the 64 parameters of 2+2 layers with final norms.
    ensure!(n == 3 + 64, "{n} compared tensors: {json}");
    ensure!(rel <= 1e-12, "float64 differs by {rel}: {json}");
    // float32, batch-first (PyTorch's nested-tensor encoder path), other lengths.
    let (m, i) =
        export_model("transformer", &tmp, "f32", &["--batch-first", "--key-padding", "--batch", "3", "--tgt-len", "6", "--src-len", "4"])?;
    let json = compare_native("transformer", &m, &i, &["--backward"])?;
    let (rel, _) = worst(&json)?;
    ensure!(rel <= 1e-5 && json["batch_first"] == true, "float32 differs by {rel}: {json}");
    // With DNAS in our encoder the same weights give another model, and the table says so.
    let json = compare_native("transformer", &m, &i, &["--variant", "dnas"])?;
    ensure!(worst(&json)?.0 > 1e-3 && json["variant"] == "dnas", "{json}");

    // Our Transformer's weights (with final norms) load into nn.Transformer strictly.
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let cfg = TransformerConfig {
        encoder_layers: 2,
        decoder_layers: 2,
        embed_dim: 16,
        heads: 4,
        ffn_dim: 32,
        final_norm: true,
        ..TransformerConfig::iwslt()
    };
    Transformer::new(&vs.root(), cfg)?;
    let out = tmp.path("ours.safetensors");
    export_params(&vs, &out, |n| pytorch_name(n).unwrap_or_else(|| n.to_string()))?;
    loads_into_nn_transformer(&out)?;
    Ok(())
}

#[test]
fn probattn_torch_exports_agree_with_the_native_variants() -> Result<()> {
    let tmp = TempDir::new("compare-probattn-torch")?;
    // BAM in eval mode: its base softmax's weights; the contextual prior's parameters load by
    // name (a misnamed one would fail the import) and, unused outside training, get no gradient
    // on either side, so they are not among the compared tensors.
    for variant in ["softmax", "dnas", "hnas", "sinkhorn-3", "bam-wc", "bam-lf"] {
        let (m, i) = export_model("probattn-mha", &tmp, variant, &["--variant", variant, "--dtype", "float64", "--key-padding"])?;
        let json = compare(&m, &i, &["--backward", "--variant", variant])?;
        let (rel, n) = worst(&json)?;
        // HNAS has one more parameter (hybrid_logit), so one more gradient.
        ensure!(n == if variant == "hnas" { 10 } else { 9 }, "{variant}: {n} compared tensors: {json}");
        ensure!(rel <= 1e-12, "{variant}: float64 differs by {rel}: {json}");
    }
    let (m, i) = export_model("probattn-mha", &tmp, "dnas-f32", &["--variant", "dnas", "--method", "trace", "--batch-first"])?;
    let json = compare(&m, &i, &["--backward", "--variant", "dnas"])?;
    ensure!(worst(&json)?.0 <= 1e-5 && json["batch_first"] == true, "{json}");
    // A DNAS module is not a softmax one.
    let json = compare(&m, &i, &["--variant", "softmax"])?;
    ensure!(worst(&json)?.0 > 1e-3, "DNAS and softmax agreed: {json}");
    Ok(())
}

#[test]
fn probattn_torch_bam_samples_as_the_reference() -> Result<()> {
    // Training mode with a fixed noise draw, float64, scripted: weights, output, KL and every
    // gradient against python/probattn_tools/reference/formulas.py (which tests/parity.rs holds the Rust BAM to).
    let out = python_module("export.torchscript")?.arg("check-bam").output()?;
    ensure!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| text(&out))?;
    for variant in ["bam-nokl", "bam-lf", "bam-lc", "bam-wf", "bam-wc"] {
        let r = &report[variant];
        let mut diffs = vec![r["weights"].as_f64(), r["output"].as_f64(), r["eval_weights_vs_softmax"].as_f64()];
        let grads = r["gradients"].as_object().context("no gradients")?;
        diffs.extend(grads.values().map(|g| g.as_f64()));
        ensure!(diffs.iter().all(|d| d.is_some_and(|d| d <= 1e-12)), "{variant}: {r}");
        ensure!(grads.contains_key("prior.f1.weight") == variant.ends_with('c'), "{variant}: prior parameters {r}");
        let has_kl = variant != "bam-nokl";
        ensure!(r["kl"].as_f64().is_some_and(|d| d <= 1e-12) == has_kl, "{variant}: KL {r}");
        ensure!(r["kl_value"].as_f64().is_some_and(f64::is_finite) == has_kl, "{variant}: KL value {r}");
        ensure!(r["eval_kl_is_none"] == true, "{variant}: eval mode left a KL term: {r}");
        ensure!(r["sampled_differs_from_mean"].as_f64().is_some_and(|d| d > 1e-3), "{variant}: sampling had no effect: {r}");
    }
    Ok(())
}

#[test]
fn the_translation_baseline_runs_our_trained_weights() -> Result<()> {
    let tmp = TempDir::new("compare-translation")?;
    let data = tmp.path("data");
    std::fs::create_dir_all(&data)?;
    write_corpus(&data, [200, 10, 12])?;
    let (d, run) = (data.to_string_lossy().to_string(), tmp.path("run").to_string_lossy().to_string());
    let flags: Vec<&str> =
        "--preset tiny --bpe-vocab 120 --max-tokens 300 --max-epochs 3 --beam 2 --warmup-updates 20 --threads 1 --device cpu"
            .split(' ')
            .collect();
    let o = probattn(&[&["translate", "--data-dir", &d, "--out", &run][..], &flags].concat())?;
    ensure!(o.status.success(), "{}", text(&o));

    // Our checkpoint -> a PyTorch state dict -> the baseline (strict) -> TorchScript.
    let (sd, m) = (tmp.path("sd.safetensors").to_string_lossy().to_string(), tmp.path("base.pt").to_string_lossy().to_string());
    let o = probattn(&["export", "--checkpoint", &format!("{run}/seed-1/checkpoint_best.safetensors"), "--out", &sd])?;
    ensure!(o.status.success() && text(&o).contains("tensors under the PyTorch baseline's names"), "{}", text(&o));
    let o = python_module("baselines.translate")?
        .args(["--run", &run, "--load-state-dict", &sd, "--export-torchscript", &m, "--threads", "1"])
        .output()?;
    ensure!(o.status.success(), "the baseline did not load our weights strictly: {}", text(&o));

    // Same logits and gradients (float64), and the same greedy translations.
    let compare: Vec<&str> = "--native translation --heads 4 --json --repeats 2 --threads 1".split(' ').collect();
    let o = probattn(&[&["compare", "--torchscript", &m, "--dtype", "float64", "--backward"][..], &compare].concat())?;
    ensure!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let (rel, n) = worst(&json)?;
    ensure!(n > 30 && rel <= 1e-12, "float64 translation model differs by {rel} over {n} tensors: {json}");
    let test = format!("{d}/test.de");
    let tok = format!("{run}/tokenizer.json");
    let o = probattn(&[&["compare", "--torchscript", &m, "--greedy-file", &test, "--tokenizer", &tok][..], &compare].concat())?;
    ensure!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(json["greedy"]["sentences"] == 12 && json["greedy"]["identical"] == 12, "{json}");
    // --greedy-file needs the tokenizer; a bad checkpoint is named.
    let o = probattn(&["compare", "--torchscript", &m, "--native", "translation", "--heads", "4", "--greedy-file", &test])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("--tokenizer"), "{}", text(&o));
    let o = probattn(&["export", "--checkpoint", &sd, "--out", &tmp.path("x.safetensors").to_string_lossy()])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("not a probattn translate checkpoint"), "{}", text(&o));
    Ok(())
}

#[test]
fn an_nn_transformer_fine_tunes_with_dnas_and_svgd_heads_and_goes_back() -> Result<()> {
    use probattn::repulsive::RepulsiveConfig;
    use probattn_experiments::finetune::{finetune, FinetuneConfig};

    let tmp = TempDir::new("compare-finetune")?;
    let (m, _) = export_model("transformer", &tmp, "tr", &["--layers", "2", "--ffn", "32"])?;
    let out = tmp.path("tuned.safetensors");
    let cfg = FinetuneConfig {
        heads: 4,
        variant: "dnas".parse()?,
        repulsive: Some(RepulsiveConfig::default()),
        steps: 40,
        lr: 3e-3,
        batch: 8,
        len: 6,
        seed: 0,
    };
    let r = finetune(std::path::Path::new(&m), &cfg, &out, tch::Device::Cpu)?;
    // 2 encoder layers x Q, K, V + 2 decoder layers x 2 modules x Q, K, V.
    ensure!(r.particle_sets == 18, "{} particle sets", r.particle_sets);
    ensure!(r.import.contains("64 parameter(s) matched") && !r.import.contains("missing"), "{}", r.import);
    ensure!(r.loss_after < 0.9 * r.loss_before, "the held-out loss went from {} to {}", r.loss_before, r.loss_after);
    loads_into_nn_transformer(&out)?;
    // HNAS's gates have no nn.Transformer counterpart: they keep their initial value, and the
    // report says so.
    let cfg = FinetuneConfig { variant: "hnas".parse()?, repulsive: None, steps: 1, ..cfg };
    let r = finetune(std::path::Path::new(&m), &cfg, &out, tch::Device::Cpu)?;
    ensure!(r.import.contains("missing (not in the source): encoder.0.self_attn.hybrid_logit") && r.particle_sets == 0, "{}", r.import);
    Ok(())
}

#[test]
fn the_gat_baseline_agrees() -> Result<()> {
    let tmp = TempDir::new("compare-gat")?;
    let gat = |tag: &str, extra: &[&str]| -> Result<(String, String)> {
        let (m, i) = (
            tmp.path(&format!("{tag}.pt")).to_string_lossy().to_string(),
            tmp.path(&format!("{tag}.safetensors")).to_string_lossy().to_string(),
        );
        run_python("export.torchscript", &[&["gat", "--out", &m, "--inputs", &i][..], extra].concat())?;
        Ok((m, i))
    };
    let (m, i) = gat("f64", &["--dtype", "float64", "--nodes", "40", "--features", "24", "--classes", "6"])?;
    let json = compare_native("gat", &m, &i, &["--backward"])?;
    let (rel, n) = worst(&json)?;
    ensure!(n == 10 && rel <= 1e-12, "float64 GAT differs by {rel} over {n} tensors: {json}");
    let (m, i) = gat("f32", &[])?;
    let json = compare_native("gat", &m, &i, &["--backward"])?;
    ensure!(worst(&json)?.0 <= 1e-5, "{json}");
    let json = compare_native("gat", &m, &i, &["--variant", "dnas"])?;
    ensure!(worst(&json)?.0 > 1e-3, "DNAS and softmax GAT agreed: {json}");
    Ok(())
}

#[test]
fn bad_input_is_named() -> Result<()> {
    let tmp = TempDir::new("compare-bad")?;
    let (m, i) = export(&tmp, "mha", &[])?;
    let run = |args: &[&str]| probattn(&[&["compare", "--native", "mha"][..], args].concat());

    let o = run(&["--torchscript", &m, "--inputs", &i])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("--heads"), "{}", text(&o));
    let o = run(&["--torchscript", &m, "--heads", "3", "--inputs", &i])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("--heads 3 does not divide"), "{}", text(&o));
    let o = run(&["--torchscript", &tmp.path("none.pt").to_string_lossy(), "--heads", "4"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("none.pt"), "{}", text(&o));
    run_python("export.torchscript", &["other-formats", "--dir", &tmp.0.to_string_lossy()])?;
    let o = run(&["--torchscript", &tmp.path("linear.pt2").to_string_lossy(), "--heads", "4"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("torch.export"), "{}", text(&o));
    // Inputs of the wrong rank, a missing argument, an unknown tensor: named before libtorch sees them.
    let inputs = tmp.path("bad.safetensors");
    let write = |tensors: &[(&str, tch::Tensor)]| -> Result<()> {
        let refs: Vec<(&str, &tch::Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        Ok(tch::Tensor::write_safetensors(&refs, &inputs)?)
    };
    let t = |shape: &[i64]| tch::Tensor::randn(shape, (tch::Kind::Float, tch::Device::Cpu));
    let bad = inputs.to_string_lossy().to_string();
    write(&[("query", t(&[5, 2, 1, 16])), ("key", t(&[7, 2, 16])), ("value", t(&[7, 2, 16]))])?;
    let o = run(&["--torchscript", &m, "--heads", "4", "--inputs", &bad])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("query has shape [5, 2, 1, 16]"), "{}", text(&o));
    write(&[("query", t(&[5, 2, 16])), ("key", t(&[7, 2, 16]))])?;
    let o = run(&["--torchscript", &m, "--heads", "4", "--inputs", &bad])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("has no 'value'"), "{}", text(&o));
    write(&[("query", t(&[5, 2, 16])), ("key", t(&[7, 2, 16])), ("value", t(&[7, 2, 16])), ("attn_bias", t(&[5, 7]))])?;
    let o = run(&["--torchscript", &m, "--heads", "4", "--inputs", &bad])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("unknown tensor 'attn_bias'"), "{}", text(&o));
    let nan = t(&[5, 2, 16]);
    let _ = nan.get(0).get(0).get(0).fill_(f64::NAN);
    write(&[("query", nan), ("key", t(&[7, 2, 16])), ("value", t(&[7, 2, 16]))])?;
    let o = run(&["--torchscript", &m, "--heads", "4", "--inputs", &bad])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("query holds 1 NaN"), "{}", text(&o));
    let o = run(&["--torchscript", &m, "--heads", "4", "--no-such-flag"])?;
    ensure!(o.status.code() == Some(1) && text(&o).contains("--no-such-flag"), "{}", text(&o));
    Ok(())
}

#[test]
fn pt2_packages_compare_like_torchscript() -> Result<()> {
    // nn.MultiheadAttention with a key padding mask, and nn.Transformer, as AOTInductor packages
    // (python/probattn_tools/export/pt2.py compiles each, ~30 s here): the same --inputs file, the same JSON.
    let tmp = TempDir::new("compare-pt2")?;
    let p = |name: &str| tmp.path(name).to_string_lossy().to_string();
    let mha = ["mha", "--embed-dim", "16", "--heads", "4", "--key-padding", "--batch-first"];
    run_python("export.pt2", &[&mha[..], &["--out", &p("mha.pt2"), "--inputs", &p("mha.safetensors")]].concat())?;
    let transformer = ["transformer", "--embed-dim", "16", "--heads", "4", "--layers", "1", "--ffn", "32", "--key-padding"];
    run_python("export.pt2", &[&transformer[..], &["--out", &p("t.pt2"), "--inputs", &p("t.safetensors")]].concat())?;
    for (native, package, inputs, count) in [("mha", "mha.pt2", "mha.safetensors", 2), ("transformer", "t.pt2", "t.safetensors", 1)] {
        let o = probattn(&[
            "compare",
            "--pt2",
            &p(package),
            "--native",
            native,
            "--heads",
            "4",
            "--inputs",
            &p(inputs),
            "--json",
            "--threads",
            "1",
            "--repeats",
            "3",
        ])?;
        ensure!(o.status.success(), "{}", text(&o));
        let json: serde_json::Value = serde_json::from_slice(&o.stdout).with_context(|| text(&o))?;
        let (rel, n) = worst(&json)?;
        ensure!(n == count && rel <= 1e-5, "{native}: float32 differs by {rel} over {n} outputs: {json}");
        ensure!(json["reference"] == "pt2" && json["torchscript_ms"].as_f64().is_some_and(|t| t > 0.0), "{json}");
    }
    // What a package cannot do, and what is not a package: exit status 1 and a named error.
    let (m, i) = export(&tmp, "ts", &[])?;
    for (args, expected) in [
        (vec!["--pt2", &p("mha.pt2"), "--inputs", &p("mha.safetensors"), "--backward"], "a .pt2 package runs forward only"),
        (vec!["--pt2", &m, "--inputs", &i], "a TorchScript archive, not an AOTInductor package"),
        (vec!["--pt2", &p("absent.pt2")], "no such .pt2 package"),
        (vec!["--pt2", &p("mha.pt2"), "--inputs", &p("mha.safetensors"), "--dtype", "float64"], "runs in the dtype it was exported in"),
        (vec!["--pt2", &p("mha.pt2"), "--torchscript", &m], "cannot be used with"),
    ] {
        let o = probattn(&[&["compare", "--native", "mha", "--heads", "4"][..], &args].concat())?;
        ensure!(o.status.code() == Some(1) || (expected == "cannot be used with" && o.status.code() == Some(2)), "{args:?}: {}", text(&o));
        ensure!(text(&o).contains(expected), "{args:?}: {}", text(&o));
    }
    Ok(())
}
