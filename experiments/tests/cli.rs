//! The `probattn` binary as a user runs it: doctor, attend against the PyTorch reference
//! (through python/probattn_tools/reference/parity.py compare, the script the README gives users), and bad input.

mod binary;
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Command;

use anyhow::{ensure, Context, Result};
use binary::{probattn, text};
use common::{manifest, python, python_module, run_python, TempDir};

#[test]
fn doctor_reports_versions_and_cuda() -> Result<()> {
    let out = probattn(&["doctor"])?;
    let said = text(&out);
    ensure!(out.status.success(), "{said}");
    // The pins as the workspace states them (Cargo.toml's tch, download_libtorch.sh's torch), so
    // that moving to another torch edits the pins and not this test.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let pin = |file: &str, prefix: &str| -> Result<String> {
        let text = std::fs::read_to_string(root.join(file))?;
        let line = text.lines().find(|l| l.starts_with(prefix)).ok_or_else(|| anyhow::anyhow!("no {prefix} in {file}"))?;
        Ok(line[prefix.len()..].trim_matches(|c| c == '"' || c == '=' || c == ' ').to_string())
    };
    let (tch, torch) = (pin("Cargo.toml", "tch = ")?, pin("download_libtorch.sh", "TORCH_VERSION=")?);
    ensure!(!tch.is_empty() && !torch.is_empty(), "pins: tch {tch:?}, torch {torch:?}");
    for expected in
        [format!("tch       {tch}"), format!("libtorch  {torch}"), "cpu       ".into(), "threads".into(), "CUDA".into(), "cuDNN".into()]
    {
        ensure!(said.contains(&expected), "doctor did not say '{expected}':\n{said}");
    }
    let json: serde_json::Value = serde_json::from_slice(&probattn(&["doctor", "--json", "--threads", "1"])?.stdout)?;
    ensure!(json["threads"] == 1, "{json}");
    ensure!(json["libtorch_cuda_loaded"] == true, "libtorch_cuda.so is not linked: the build.rs --no-as-needed link is missing\n{json}");
    // The embedded kernels by architecture, as the build compiled them (or why it embedded none),
    // and whether this GPU has a match.
    let fused = &json["fused_cuda"];
    match fused["missing"].as_str() {
        None => {
            // Every architecture compiled, or those PROBATTN_CUDA_ARCHS named to the build
            // (scripts/cuda_bundle.sh embeds sm_90's alone).
            let archs: Vec<String> = option_env!("PROBATTN_CUDA_ARCHS")
                .unwrap_or("80,90")
                .split(',')
                .map(|a| format!("sm_{}", a.trim().trim_start_matches("sm_")))
                .collect();
            let listed: Vec<&String> = fused["embedded"].as_object().map(|m| m.keys().collect()).unwrap_or_default();
            ensure!(listed.len() == archs.len(), "embedded {listed:?}, built for {archs:?}: {fused}");
            for arch in &archs {
                ensure!(fused["embedded"][arch].as_u64() > Some(0) && said.contains(&format!("{arch} (")), "{arch}: {fused}\n{said}");
            }
            // The sets by dtype and head dimension, the same on every architecture.
            let sets: Vec<&str> = fused["sets"].as_array().map(|s| s.iter().filter_map(|x| x.as_str()).collect()).unwrap_or_default();
            ensure!(sets.contains(&"bfloat16 d 64") && sets.contains(&"float32 d 128") && !sets.contains(&"float32 d 256"), "{fused}");
            ensure!(
                said.contains("dtypes and head dimensions: bfloat16 d 64, 128, 256; float16 d 64, 128, 256; float32 (TF32) d 64, 128"),
                "{said}"
            );
        }
        Some(why) => ensure!(said.contains(&format!("fused     no kernels embedded: {why}")), "{said}"),
    }
    ensure!(fused["gpu_matches"].as_bool().is_some() && (fused["gpu_matches"] == true || fused["why_not"].is_string()), "{fused}");
    // This GPU's shared memory a block, and the embedded sets too large for it (none without a GPU).
    ensure!(fused["too_large_here"].as_array().is_some() && (fused["gpu"].is_null() == fused["gpu_shared_optin"].is_null()), "{fused}");
    let required = probattn(&["doctor", "--require-cuda"])?;
    if tch::Cuda::is_available() {
        ensure!(required.status.success(), "{}", text(&required));
    } else {
        ensure!(!required.status.success(), "--require-cuda passed without CUDA");
        ensure!(text(&required).contains("CUDA is required (--require-cuda) but not usable"), "{}", text(&required));
    }
    Ok(())
}

#[test]
fn attend_agrees_with_the_pytorch_reference_on_fresh_cases() -> Result<()> {
    let dir = TempDir::new("cli-attend")?;
    let root = dir.0.to_string_lossy().to_string();
    run_python("reference.parity", &["cases", "--out", &root, "--seed", "424242", "--count", "20", "--bam"])?;
    for case in manifest(&dir.0)? {
        let name = case["name"].as_str().context("name")?;
        let variant = case["variant"].as_str().context("variant")?;
        let input = dir.path(&format!("{name}.safetensors")).to_string_lossy().to_string();
        let output = dir.path(&format!("{name}.out.safetensors")).to_string_lossy().to_string();
        // The flags both programs take: --causal, and BAM's --train and settings.
        let mut flags: Vec<String> = vec![];
        if case["causal"].as_bool() == Some(true) {
            flags.push("--causal".into());
        }
        if case["train"].as_bool() == Some(true) {
            flags.push("--train".into());
        }
        if let Some(bam) = case["bam"].as_object() {
            for (key, value) in bam {
                let value = value.as_str().map(String::from).unwrap_or_else(|| value.to_string());
                flags.push(format!("--{}={value}", key.replace('_', "-")));
            }
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut args = vec!["attend", "--variant", variant, "--input", &input, "--output", &output, "--device", "cpu"];
        let mut compare = vec!["compare", "--variant", variant, "--input", &input, "--output", &output];
        args.extend(&flags);
        compare.extend(&flags);
        let out = probattn(&args)?;
        ensure!(out.status.success(), "{name}: {}", text(&out));
        run_python("reference.parity", &compare).with_context(|| format!("{name} ({variant})"))?;
    }
    Ok(())
}

#[test]
fn the_compare_script_catches_a_wrong_output() -> Result<()> {
    // A check that cannot fail proves nothing: perturb one weight and expect compare to fail.
    let dir = TempDir::new("cli-compare")?;
    let root = dir.0.to_string_lossy().to_string();
    run_python("reference.parity", &["cases", "--out", &root, "--seed", "5", "--count", "2"])?;
    let input = dir.path("case-001.safetensors").to_string_lossy().to_string();
    let output = dir.path("out.safetensors").to_string_lossy().to_string();
    ensure!(probattn(&["attend", "--variant", "dnas", "--input", &input, "--output", &output])?.status.success());
    let script = "import sys; from safetensors.torch import load_file, save_file\n\
                  t = load_file(sys.argv[1]); t['weights'].view(-1)[0] += 1e-8; save_file(t, sys.argv[1])";
    ensure!(Command::new(python()?).args(["-c", script, &output]).status()?.success());
    ensure!(run_python("reference.parity", &["compare", "--variant", "dnas", "--input", &input, "--output", &output]).is_err());
    Ok(())
}

/// Writes tensors with the project's Python: `spec` is Python building a dict `t`.
fn write_input(path: &Path, spec: &str) -> Result<()> {
    let script = format!("import sys, torch\nfrom safetensors.torch import save_file\n{spec}\nsave_file(t, sys.argv[1])");
    let status = Command::new(python()?).args(["-c", &script, &path.to_string_lossy()]).status()?;
    ensure!(status.success(), "writing {}", path.display());
    Ok(())
}

#[test]
fn bad_input_is_named_and_nothing_is_written() -> Result<()> {
    let dir = TempDir::new("cli-bad")?;
    let good = "t = {'q': torch.randn(1, 2, 3, 4), 'k': torch.randn(1, 2, 5, 4), 'v': torch.randn(1, 2, 5, 4)}";
    let inputs = [
        ("good", good.to_string()),
        ("rank3", "t = {'q': torch.randn(2, 3, 4), 'k': torch.randn(2, 3, 4), 'v': torch.randn(2, 3, 4)}".into()),
        ("nan", format!("{good}\nt['k'][0, 1, 2, 3] = float('nan')")),
        ("badmask", format!("{good}\nt['attn_mask'] = torch.zeros(4, 5, dtype=torch.bool)")),
        ("floatmask", format!("{good}\nt['key_padding_mask'] = torch.zeros(1, 5)")),
        ("sizes", format!("{good}\nt['v'] = torch.randn(1, 2, 6, 4)")),
        ("noq", format!("{good}\ndel t['q']")),
        ("logit", format!("{good}\nt['hybrid_logit'] = torch.zeros(3)")),
        ("noise", format!("{good}\nt['noise'] = torch.rand(1, 2, 3, 4)")),
        (
            "prior",
            format!(
                "{good}\nt.update({{'prior.f1.weight': torch.randn(2, 10, 3), 'prior.f1.bias': torch.zeros(2, 10), \
                                            'prior.f2.weight': torch.randn(2, 10), 'prior.f2.bias': torch.zeros(2)}})"
            ),
        ),
    ];
    for (name, spec) in &inputs {
        write_input(&dir.path(&format!("{name}.safetensors")), spec)?;
    }
    std::fs::write(dir.path("corrupt.safetensors"), b"\x08\0\0\0\0\0\0\0{\"a\":1}")?;
    let p = |name: &str| dir.path(name).to_string_lossy().to_string();
    let out = p("out.safetensors");
    // (variant, flags, the input file's stem, what the error says)
    let cases: [(&str, &[&str], &str, &str); 18] = [
        ("dnas", &[], "rank3", "q has shape [2, 3, 4]; expected rank 4"),
        ("dnas", &[], "nan", "k holds 1 NaN"),
        ("dnas", &[], "badmask", "attn_mask has shape [4, 5], which does not broadcast to [1, 2, 3, 5]"),
        ("dnas", &[], "floatmask", "key_padding_mask has dtype Float"),
        ("dnas", &[], "sizes", "same number of keys"),
        ("dnas", &[], "noq", "has no tensor 'q'"),
        ("hnas", &[], "logit", "hybrid_logit has shape [3], expected (2,)"),
        ("dnas", &[], "missing", "missing.safetensors: no such file"),
        ("dnas", &[], "corrupt", "corrupt.safetensors: not a readable safetensors file"),
        ("dnax", &[], "good", "unknown attention variant 'dnax'"),
        ("dnas", &["--causal"], "good", "leak"),
        ("dnas", &["--bogus"], "good", "unexpected argument '--bogus'"),
        ("dnas", &["--device", "tpu"], "good", "unknown device 'tpu'"),
        ("dnas", &["--allocator", "jemalloc"], "good", "invalid value 'jemalloc' for '--allocator"),
        ("bam-wc", &["--train"], "noise", "noise has shape [1, 2, 3, 4], expected the weights' shape [1, 2, 3, 5]"),
        ("bam-wf", &["--k", "0"], "good", "BAM k must be positive"),
        ("bam-wc", &[], "prior", "prior.f1.weight has shape [2, 10, 3], expected [2, 10, 4]"),
        ("bam-lc", &["--base", "bam-wc"], "good", "BAM's base must be deterministic"),
    ];
    for (variant, flags, stem, expected) in cases {
        let input = p(&format!("{stem}.safetensors"));
        let mut args = vec!["attend", "--variant", variant];
        args.extend(flags);
        args.extend(["--input", &input, "--output", &out]);
        let run = probattn(&args)?;
        let said = text(&run);
        ensure!(!run.status.success(), "{args:?} succeeded");
        ensure!(said.contains(expected), "{args:?}: expected '{expected}' in:\n{said}");
        ensure!(!said.contains("panicked"), "{args:?} panicked:\n{said}");
        ensure!(!Path::new(&out).exists(), "{args:?} left an output file");
    }
    let missing_dir = dir.path("no/such/dir/out.safetensors").to_string_lossy().to_string();
    let run = probattn(&["attend", "--variant", "dnas", "--input", &p("good.safetensors"), "--output", &missing_dir])?;
    ensure!(!run.status.success() && text(&run).contains("no such directory"), "{}", text(&run));
    let left: Vec<_> = std::fs::read_dir(&dir.0)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().contains(".tmp-"))
        .collect();
    ensure!(left.is_empty(), "temporary files left: {left:?}");
    Ok(())
}

#[test]
fn attend_memory_efficient_writes_what_the_eager_path_does() -> Result<()> {
    // python/probattn_tools/reference/parity.py's cases (masks in every layout, HNAS logits, noise), variants both ways:
    // output, received mass and KL agree; no weights are written.
    let dir = TempDir::new("cli-attend-tiled")?;
    let root = dir.0.to_string_lossy().to_string();
    run_python("reference.parity", &["cases", "--out", &root, "--seed", "11", "--count", "3"])?;
    for case in 0..3 {
        let input = dir.path(&format!("case-{case:03}.safetensors")).to_string_lossy().to_string();
        // BAM (--train) samples on the tiled path from the counter-based draws keyed by --seed,
        // and on the eager path from those draws written into the input as `noise`.
        let tensors = probattn::io::read_safetensors(std::path::Path::new(&input))?;
        let (q, k) = (&tensors["q"], &tensors["k"]);
        let shape = [q.size()[0], q.size()[1], q.size()[2], k.size()[2]];
        let plain: Vec<(&str, &tch::Tensor)> =
            tensors.iter().filter(|(n, _)| n.as_str() != "noise").map(|(n, t)| (n.as_str(), t)).collect();
        let without_noise = dir.path("without-noise.safetensors");
        probattn::io::write_safetensors_atomic(&without_noise, &plain)?;
        let with_draws = |kind| -> Result<String> {
            let draws = probattn::tiled::counter_noise(kind, shape, 9, (q.kind(), tch::Device::Cpu))?;
            let path = dir.path("with-draws.safetensors");
            probattn::io::write_safetensors_atomic(&path, &[plain.clone(), vec![("noise", &draws)]].concat())?;
            Ok(path.to_string_lossy().to_string())
        };
        let without_noise = without_noise.to_string_lossy().to_string();
        let variants: [&[&str]; 8] = [
            &["softmax"],
            &["dnas"],
            &["hnas"],
            &["sinkhorn-3"],
            &["bam-wc", "--train", "--k", "5"],
            &["bam-lf", "--train", "--base", "dnas"],
            &["bam-lc", "--train", "--base", "sinkhorn-2", "--sigma", "0.5"],
            &["bam-wc", "--train", "--base", "hnas", "--k", "5"],
        ];
        for variant in variants {
            let (eager, tiled) = (dir.path("eager.safetensors"), dir.path("tiled.safetensors"));
            let (e, t) = (eager.to_string_lossy().to_string(), tiled.to_string_lossy().to_string());
            let bam = probattn::normalize::BamKind::from_name(variant[0]);
            let (eager_input, tiled_input) = match bam {
                Some(kind) => (with_draws(kind)?, without_noise.clone()),
                None => (input.clone(), input.clone()),
            };
            let args = |input: &str, out: &str| -> Vec<String> {
                let head = ["attend", "--variant"].iter().chain(variant);
                head.chain(&["--seed", "9", "--input", input, "--output", out]).map(|a| a.to_string()).collect()
            };
            let o = probattn(&args(&eager_input, &e).iter().map(String::as_str).collect::<Vec<_>>())?;
            ensure!(o.status.success(), "{}", text(&o));
            let tiled_args = [args(&tiled_input, &t), vec!["--memory-efficient".into(), "--tile".into(), "3".into()]].concat();
            let o = probattn(&tiled_args.iter().map(String::as_str).collect::<Vec<_>>())?;
            ensure!(o.status.success() && text(&o).contains("weights none (memory-efficient)"), "{}", text(&o));
            let (a, b) = (probattn::io::read_safetensors(&eager)?, probattn::io::read_safetensors(&tiled)?);
            ensure!(!b.contains_key("weights"), "the memory-efficient path wrote weights");
            ensure!(a.contains_key("kl") == b.contains_key("kl"), "{variant:?}: kl written by one path only");
            // float64 to 1e-10; float32 cases to its rounding (HNAS mixes in another order).
            let tolerance = if a["output"].kind() == tch::Kind::Double { 1e-10 } else { 1e-5 };
            let names: &[&str] = if a.contains_key("kl") { &["output", "received_mass", "kl"] } else { &["output", "received_mass"] };
            for &name in names {
                let d = (&a[name] - &b[name]).abs().max().double_value(&[]);
                ensure!(d <= tolerance, "case {case} {variant:?}: {name} differs by {d}");
            }
        }
    }
    Ok(())
}

#[test]
fn plot_draws_runs_side_by_side_and_names_bad_input() -> Result<()> {
    let dir = TempDir::new("cli-plot")?;
    // A translate run (one metrics.jsonl per seed) and a gat run (one file, a seed on each line).
    let translate = dir.path("bam-wc");
    for seed in [1, 2] {
        std::fs::create_dir_all(translate.join(format!("seed-{seed}")))?;
        let lines: Vec<String> =
            (1..=3).map(|e| format!(r#"{{"seed":{seed},"epoch":{e},"kl":null,"valid_bleu":{}}}"#, 10.0 * e as f64 + seed as f64)).collect();
        std::fs::write(translate.join(format!("seed-{seed}/metrics.jsonl")), lines.join("\n") + "\n")?;
    }
    let gat = dir.path("gat-dnas");
    std::fs::create_dir_all(&gat)?;
    std::fs::write(gat.join("metrics.jsonl"), "{\"seed\":0,\"epoch\":0,\"val_acc\":0.5}\n{\"seed\":0,\"epoch\":1,\"val_acc\":0.7}\n")?;
    let p = |path: &Path| path.to_string_lossy().to_string();
    let svg = dir.path("curves.svg");
    let out = probattn(&["plot", &p(&translate), "--metric", "valid_bleu", "--out", &p(&svg)])?;
    ensure!(out.status.success(), "{}", text(&out));
    ensure!(text(&out).contains("2 curves of valid_bleu against epoch"), "{}", text(&out));
    let drawn = std::fs::read_to_string(&svg)?;
    for name in ["bam-wc seed 1", "bam-wc seed 2", "valid_bleu against epoch"] {
        ensure!(drawn.contains(name), "the chart does not show '{name}'");
    }
    // The same run twice under two labels, its seeds averaged.
    let (run, svg_path) = (p(&translate), p(&svg));
    let args = ["plot", &run, &run, "--metric", "valid_bleu", "--mean-seeds", "--label", "BAM", "--label", "again", "--out", &svg_path];
    let out = probattn(&args)?;
    ensure!(out.status.success() && std::fs::read_to_string(&svg)?.contains("BAM (mean of 2 seeds)"), "{}", text(&out));
    // Runs under one label are one group: a table's seeds, each in its own folder, average into one curve.
    let (s1, s2) = (p(&translate.join("seed-1/metrics.jsonl")), p(&translate.join("seed-2/metrics.jsonl")));
    let args = ["plot", &s1, &s2, "--metric", "valid_bleu", "--mean-seeds", "--label", "pooled", "--label", "pooled", "--out", &svg_path];
    let out = probattn(&args)?;
    ensure!(text(&out).contains("1 curve of") && std::fs::read_to_string(&svg)?.contains("pooled (mean of 2 seeds)"), "{}", text(&out));
    let out = probattn(&args.iter().copied().filter(|a| *a != "--mean-seeds").collect::<Vec<_>>())?;
    ensure!(std::fs::read_to_string(&svg)?.contains("pooled seed 2"), "{}", text(&out));
    // --from keeps the later points; a run with none left is named.
    let out = probattn(&["plot", &run, "--metric", "valid_bleu", "--from", "3", "--out", &svg_path])?;
    ensure!(out.status.success(), "{}", text(&out));
    let out = probattn(&["plot", &run, "--metric", "valid_bleu", "--from", "4", "--out", &svg_path])?;
    ensure!(!out.status.success() && text(&out).contains("has no point at epoch >= 4 (--from)"), "{}", text(&out));
    // Bad input: each named, and the chart left as it was.
    let before = std::fs::read_to_string(&svg)?;
    std::fs::write(dir.path("broken.jsonl"), "{\"seed\":1,\"epoch\":1,\"valid_bleu\":3}\nnot json\n")?;
    for (args, expected) in [
        (vec![p(&gat), "--metric".into(), "valid_bleu".into()], "has no values of 'valid_bleu'; its numeric columns: epoch, seed, val_acc"),
        (vec![p(&dir.path("missing")), "--metric".into(), "val_acc".into()], "missing does not exist"),
        (vec![p(&dir.0), "--metric".into(), "val_acc".into()], "its folders bam-wc, gat-dnas are runs: give them"),
        (vec![p(&translate.join("seed-1/metrics.jsonl")), "--metric".into(), "kl".into()], "has no values of 'kl'"),
        (vec![p(&svg), "--metric".into(), "val_acc".into()], "curves.svg is a file but not a metrics .jsonl"),
        (vec![p(&dir.path("broken.jsonl")), "--metric".into(), "valid_bleu".into()], "broken.jsonl:2 is not a JSON line"),
        (
            vec![p(&gat), p(&translate), "--metric".into(), "val_acc".into(), "--label".into(), "one".into()],
            "--label is given 1 times for 2 runs",
        ),
    ] {
        let mut full: Vec<String> = vec!["plot".into()];
        full.extend(args);
        full.extend(["--out".into(), p(&svg)]);
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        let out = probattn(&full)?;
        ensure!(!out.status.success() && text(&out).contains(expected), "{full:?}: expected '{expected}':\n{}", text(&out));
    }
    let out = probattn(&["plot", &p(&gat), "--metric", "val_acc", "--out", &p(&dir.path("curves.png"))])?;
    ensure!(!out.status.success() && text(&out).contains("must name an .svg file"), "{}", text(&out));
    ensure!(std::fs::read_to_string(&svg)? == before, "a refused plot changed the chart");
    Ok(())
}

#[test]
fn subcommands_share_flag_names() -> Result<()> {
    // The attention variant is --attention and the data folder --data-dir on every subcommand that
    // has one (each subcommand's own older name stays as an alias, or the reverse).
    for (command, flags) in [
        ("gat", &["--attention", "--data-dir", "--data", "--seeds", "--seed-start", "--out", "--k"][..]),
        ("translate", &["--attention", "--data-dir", "--data", "--seeds", "--seed-start", "--out", "--k"]),
        ("vqa", &["--attention", "--fusion", "--data-dir", "--data", "--seeds", "--seed-start", "--out", "--k"]),
        ("attend", &["--attention", "--variant"]),
        ("compare", &["--attention", "--variant"]),
        ("bench", &["--attention", "--variants"]),
    ] {
        let said = text(&probattn(&[command, "--help"])?);
        for flag in flags {
            let named = said.contains(&format!("{flag} <")) || said.contains(&format!("alias: {flag}]"));
            ensure!(named, "probattn {command} --help does not name {flag}:\n{said}");
        }
    }
    // An alias does what the flag does: an unknown variant is refused by name either way.
    let out = probattn(&["vqa", "--attention", "nonsense", "--quick"])?;
    ensure!(!out.status.success() && text(&out).contains("nonsense"), "{}", text(&out));
    // The tiled path has no attention dropout: asking for both is refused by name, before any work.
    let out = probattn(&["vqa", "--memory-efficient", "--attention-dropout", "0.1", "--quick"])?;
    ensure!(!out.status.success() && text(&out).contains("--attention-dropout must be 0"), "{}", text(&out));
    Ok(())
}

#[test]
fn commands_whose_tensors_cannot_fit_say_out_of_memory() -> Result<()> {
    // Sizes no machine holds (terabytes), so that the allocation is refused at once: an error
    // that names the shortage and the way out, exit status 1, no panic and nothing half-written.
    let tmp = TempDir::new("cli-oom")?;
    let named = |what: &str, o: &std::process::Output, hint: &str| -> Result<()> {
        let said = text(o);
        ensure!(o.status.code() == Some(1), "{what}: exit status {:?}:\n{said}", o.status.code());
        ensure!(said.contains("out of memory") && said.contains(hint) && !said.contains("panicked"), "{what}:\n{said}");
        Ok(())
    };
    // attend: eager DNAS over 600,000 queries and keys wants 1.44 TB of scores.
    let input = tmp.path("long.safetensors");
    let t = tch::Tensor::randn([1, 1, 600_000, 4], (tch::Kind::Float, tch::Device::Cpu));
    probattn::io::write_safetensors_atomic(&input, &[("q", &t), ("k", &t), ("v", &t)])?;
    let (i, o) = (input.to_string_lossy().to_string(), tmp.path("out.safetensors"));
    let args = ["attend", "--variant", "dnas", "--input", &i, "--output", &o.to_string_lossy(), "--device", "cpu", "--threads", "1"];
    named("attend", &probattn(&args)?, "--memory-efficient")?;
    ensure!(!o.exists(), "a failed attend wrote {}", o.display());
    // bench: the eager DNAS row at S = 600,000 (11.5 TB of weights); no length left to measure.
    let bench_out = tmp.path("bench");
    let args = ["bench", "--seq-lens", "600000", "--variants", "dnas", "--no-pytorch", "--repeats", "1", "--batch", "1"];
    named("bench", &probattn(&[&args[..], &["--threads", "1", "--out", &bench_out.to_string_lossy()]].concat())?, "--memory-efficient")?;
    ensure!(!bench_out.exists(), "a failed bench wrote {}", bench_out.display());
    // Training: a VQA head a trillion units wide (its bias alone is 4 TB; a smaller width such
    // as four billion is granted by the kernel and filled, 16 GB, before a later tensor fails).
    let (data, det) = common::tiny_sort_of_clevr(&tmp)?;
    let run = tmp.path("run").to_string_lossy().to_string();
    let args = [
        "vqa",
        "--data",
        &data,
        "--detectors",
        &det,
        "--fusion",
        "softmax",
        "--seeds",
        "1",
        "--max-epochs",
        "1",
        "--hidden",
        "1000000000000",
        "--threads",
        "1",
        "--out",
        &run,
    ];
    named("vqa", &probattn(&args)?, "smaller")?;
    ensure!(!Path::new(&run).join("results.json").exists(), "a failed run wrote results");
    Ok(())
}

#[test]
fn the_variant_registry_is_what_the_python_scripts_read() -> Result<()> {
    // python/probattn_tools/reference/variants.json is `probattn variants --json`, saved for the scripts: the two may not
    // drift (regenerate with `probattn variants --json > python/probattn_tools/reference/variants.json`).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let o = probattn(&["variants", "--json"])?;
    ensure!(o.status.success(), "{}", text(&o));
    let saved = std::fs::read_to_string(root.join("python/probattn_tools/reference/variants.json"))?;
    ensure!(
        String::from_utf8_lossy(&o.stdout) == saved,
        "python/probattn_tools/reference/variants.json differs from `probattn variants --json`: regenerate it with `probattn variants --json > python/probattn_tools/reference/variants.json`"
    );
    let table = probattn(&["variants"])?;
    ensure!(table.status.success() && text(&table).contains("| sinkhorn-N | doubly-normalized |"), "{}", text(&table));
    // The scripts' lists come from it.
    let out = Command::new(python()?)
        .current_dir(root.join("python"))
        .args([
            "-c",
            "from probattn_tools.reference import parity; from probattn_tools.tables import gat; print(parity.VARIANTS, gat.ORDER)",
        ])
        .output()?;
    ensure!(out.status.success(), "{}", text(&out));
    ensure!(
        text(&out).trim()
            == "['softmax', 'dnas', 'hnas', 'sinkhorn-1', 'sinkhorn-3'] ['softmax', 'dnas', 'hnas', 'sinkhorn-3', 'bam-nokl', 'bam-lf', 'bam-lc', 'bam-wf', 'bam-wc']",
        "{}",
        text(&out)
    );
    Ok(())
}

#[test]
fn every_python_script_compiles_and_answers_help() -> Result<()> {
    // The scripts users run (and the tests call) may not rot: each file of python/probattn_tools
    // compiles, and each script with a main answers `python -m probattn_tools.<module> --help`
    // with its usage and status 0.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/probattn_tools");
    let mut scripts = vec![];
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() && path.file_name().is_some_and(|n| n != "__pycache__") {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "py") {
                scripts.push(path);
            }
        }
    }
    scripts.sort();
    ensure!(scripts.len() >= 30, "found only {} scripts under {}", scripts.len(), root.display());
    let compile = Command::new(python()?).args(["-m", "py_compile"]).args(&scripts).output()?;
    ensure!(compile.status.success(), "{}", text(&compile));
    let mut failures = vec![];
    for script in scripts.iter().filter(|s| std::fs::read_to_string(s).is_ok_and(|t| t.contains("__main__"))) {
        let module = script.strip_prefix(&root)?.with_extension("").to_string_lossy().replace('/', ".");
        let o = python_module(&module)?.arg("--help").output()?;
        if !o.status.success() || o.stdout.is_empty() {
            failures.push(format!("{}: status {:?}\n{}", script.display(), o.status.code(), text(&o)));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

#[test]
fn the_python_packages_own_tests_pass() -> Result<()> {
    // python/tests: every module of probattn_tools imports, the table helpers and the reference
    // formulas keep what their docstrings say, the kernels match the formulas under Triton's
    // interpreter (run by hand: `python -m unittest discover -s python/tests`). Each test module
    // runs in a process of its own, all side by side: the kernel checks take minutes each.
    let dir = common::python_dir()?;
    common::run_unittest_modules(&dir.join("tests"), 4, || {
        let mut command = Command::new(python()?);
        command.env("PYTHONPATH", &dir);
        Ok(command)
    })
}
