//! PyTorch interop: TorchScript modules and AOTInductor packages in, PyTorch state dicts both ways.
//!
//! - [`Pt2Package`] loads an AOTInductor package (`.pt2`, `torch.export` + AOTInductor: what
//!   PyTorch 2.11 recommends in TorchScript's place) on the CPU or CUDA and runs it (`pt2.rs`).
//! - [`TorchScript`] loads a module saved by `torch.jit.script(m).save(path)` or
//!   `torch.jit.trace(m, example).save(path)` (tch's `CModule`) on a device, in eval or train
//!   mode, lists its parameters and buffers and calls its methods. What is not TorchScript is named before
//!   libtorch sees it: a `torch.export` package (`.pt2`), a `torch.save` pickle, a file that is no
//!   archive at all. libtorch's own failures (a module saved by a newer PyTorch, a method that does
//!   not exist, inputs of the wrong rank or dtype) come back as [`Error::File`] naming the file and
//!   the method, with libtorch's first line of explanation rather than its TorchScript traceback.
//! - [`import_params`] copies PyTorch-named tensors (a TorchScript module's parameters or a
//!   safetensors state dict) into a [`tch::nn::VarStore`] by name and returns an
//!   [`ImportReport`] of every parameter matched, missing, unexpected or of the wrong shape;
//!   [`export_params`] writes a VarStore as a safetensors state dict under PyTorch's names, which
//!   `load_state_dict(strict=True)` accepts when the module's names are PyTorch's (our
//!   [`crate::MultiHeadAttention`] uses `nn.MultiheadAttention`'s).
//!
//! ```
//! use probattn::interop::{export_params, import_params, read_state_dict, TorchScript};
//! use probattn::{MhaConfig, MultiHeadAttention};
//! use tch::{nn, Device};
//!
//! let dir = std::env::temp_dir().join(format!("probattn-doc-interop-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! let path = dir.join("mha.safetensors");
//!
//! // A layer's weights out under nn.MultiheadAttention's names, and into another layer by name.
//! let ours = nn::VarStore::new(Device::Cpu);
//! let _a = MultiHeadAttention::new(&ours.root(), MhaConfig::new(16, 4))?;
//! export_params(&ours, &path, |name| name.to_string())?;
//! let theirs = nn::VarStore::new(Device::Cpu);
//! let _b = MultiHeadAttention::new(&theirs.root(), MhaConfig::new(16, 4))?;
//! let report = import_params(&theirs, &read_state_dict(&path)?, |name| Some(name.to_string()), false)?;
//! assert!(report.is_complete() && report.matched.len() == 4); // in_proj_weight, in_proj_bias, out_proj.{weight, bias}
//!
//! // A file that is not TorchScript is named as what it is before libtorch sees it.
//! let err = TorchScript::load(&path, Device::Cpu).unwrap_err().to_string();
//! assert!(err.contains("mha.safetensors"), "{err}");
//! std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use tch::{nn, CModule, Device, IValue, Kind, Tensor};

use crate::{Error, Result};

mod pt2;
pub use pt2::{InputSpec, Pt2Package, INPUTS_METADATA_KEY};

/// What a file given as a TorchScript module turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArchiveKind {
    /// A TorchScript archive: a zip with `<name>/data.pkl` and `<name>/code/`.
    TorchScript,
    /// An AOTInductor package (`torch._inductor.aoti_compile_and_package`, `.pt2`): a
    /// `torch.export` package that holds compiled code under `<name>/data/aotinductor/`.
    AotInductor,
    /// A `torch.export` package (`torch.export.save`, `.pt2`): a zip with an `archive_format`
    /// entry or `models/` and `data/` folders, and no TorchScript code.
    TorchExport,
    /// `torch.save(obj)` (zip serialization): `data.pkl` and no `code/`.
    TorchSave,
    /// Not a zip archive (a legacy `torch.save` pickle, a safetensors file, anything else).
    NotAnArchive,
}

/// Reads the zip directory of `path` (not the data) to tell the formats apart.
pub fn archive_kind(path: &Path) -> Result<ArchiveKind> {
    let file = File::open(path).map_err(|error| Error::Io { path: path.into(), error })?;
    let Ok(mut zip) = zip::ZipArchive::new(file) else {
        return Ok(ArchiveKind::NotAnArchive);
    };
    let names: Vec<String> = (0..zip.len()).filter_map(|i| zip.by_index_raw(i).ok().map(|f| f.name().to_string())).collect();
    let has = |pred: &dyn Fn(&str) -> bool| names.iter().any(|n| pred(n));
    let code = has(&|n| n.split('/').nth(1) == Some("code"));
    Ok(if code && has(&|n| n.ends_with("data.pkl")) {
        ArchiveKind::TorchScript
    } else if has(&|n| n.split('/').skip(1).take(2).eq(["data", "aotinductor"])) {
        ArchiveKind::AotInductor
    } else if has(&|n| n.ends_with("archive_format")) || (has(&|n| n.split('/').nth(1) == Some("models")) && !code) {
        ArchiveKind::TorchExport
    } else if has(&|n| n.ends_with("data.pkl")) {
        ArchiveKind::TorchSave
    } else {
        ArchiveKind::NotAnArchive
    })
}

/// A loaded TorchScript module.
#[derive(Debug)]
pub struct TorchScript {
    module: CModule,
    path: PathBuf,
    device: Device,
}

/// The informative line of a libtorch error. An error raised inside TorchScript code opens with
/// "The following operation failed in the TorchScript interpreter.", then two tracebacks, and
/// ends with the Python-style exception line (`RuntimeError: ...`): that last line is the one.
fn first_line(e: &tch::TchError) -> String {
    let text = e.to_string();
    let text = text.trim_start_matches("Internal torch error: ");
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let is_exception = |l: &str| l.split_once(": ").is_some_and(|(head, _)| head.ends_with("Error") || head.ends_with("Exception"));
    let line = lines.iter().rev().find(|l| is_exception(l)).or(lines.first()).copied().unwrap_or("(no message)");
    line.chars().take(400).collect()
}

impl TorchScript {
    /// Loads `path` on `device` in eval mode; errors name the file and what it is instead.
    pub fn load(path: &Path, device: Device) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::Io {
                path: path.into(),
                error: std::io::Error::new(std::io::ErrorKind::NotFound, "no such TorchScript file"),
            });
        }
        let file_error = |message: String| Error::File { path: path.into(), message };
        match archive_kind(path)? {
            ArchiveKind::TorchScript => {}
            ArchiveKind::AotInductor => {
                return Err(file_error(
                    "an AOTInductor package (.pt2), not TorchScript: load it with probattn::interop::Pt2Package \
                     (`probattn compare --pt2`)"
                        .into(),
                ))
            }
            ArchiveKind::TorchExport => {
                return Err(file_error(
                    "a torch.export package (.pt2) with no compiled model, which libtorch cannot run: compile it with \
                     torch._inductor.aoti_compile_and_package(torch.export.export(m, args)) and load that with Pt2Package, \
                     or export the module with torch.jit.script(m).save(PATH) (docs/interop.md)"
                        .into(),
                ))
            }
            ArchiveKind::TorchSave => {
                return Err(file_error(
                    "a torch.save() pickle, not TorchScript: save a module with torch.jit.script(m).save(PATH), \
                     or its weights as a safetensors state dict (safetensors.torch.save_file(m.state_dict(), PATH))"
                        .into(),
                ))
            }
            ArchiveKind::NotAnArchive => {
                return Err(file_error(
                    "not a TorchScript archive (a zip with data.pkl and code/): corrupt, truncated or another format".into(),
                ))
            }
        }
        let mut module = CModule::load_on_device(path, device).map_err(|e| {
            file_error(format!(
                "libtorch 2.11 (what tch 0.24 links) could not load this TorchScript module ({}); one saved by a newer PyTorch needs a matching libtorch",
                first_line(&e)
            ))
        })?;
        module.f_set_eval()?;
        if device != Device::Cpu {
            // `load_on_device` moves the parameters but leaves registered buffers where they were
            // saved (tch-rs #822); `to` moves both (and keeps the floating dtype it is given).
            let kind = module.named_parameters().ok().and_then(|p| p.first().map(|(_, t)| t.kind())).unwrap_or(Kind::Float);
            module.to(device, kind, false);
        }
        Ok(Self { module, path: path.into(), device })
    }

    /// [`Self::load`] for training: the module's parameters are also added to `vs` (named with
    /// `_` for `.`, as tch's `TrainableCModule` names them), sharing their storage, so an
    /// optimizer over `vs` updates the module, and gradients of a backward pass through the module
    /// land on them. The module is left in train mode.
    pub fn load_trainable(path: &Path, vs: &nn::Path) -> Result<Self> {
        let mut ts = Self::load(path, vs.device())?;
        for (name, t) in ts.named_parameters()? {
            let trainable = t.requires_grad();
            let _ = vs.add(&name.replace('.', "_"), t, trainable);
        }
        ts.set_train(true)?;
        Ok(ts)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Train mode (dropout active) or eval mode.
    pub fn set_train(&mut self, train: bool) -> Result<()> {
        if train {
            self.module.f_set_train()?;
        } else {
            self.module.f_set_eval()?;
        }
        Ok(())
    }

    /// Casts every parameter and buffer to `kind` (floating kinds only).
    pub fn to_kind(&mut self, kind: Kind) {
        self.module.to(self.device, kind, false);
    }

    /// The module's parameters by PyTorch name (`layers.0.self_attn.in_proj_weight`), sharing
    /// storage with the module: gradients of a backward pass through the module land on them.
    pub fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.module
            .named_parameters()
            .map_err(|e| Error::File { path: self.path.clone(), message: format!("listing parameters: {}", first_line(&e)) })
    }

    /// The module's buffers (`register_buffer`: BatchNorm's running statistics, constants), by
    /// dotted name, on the module's device: libtorch's `torch::jit::Module::named_buffers()`
    /// through the C++ layer, which tch's C API does not reach. tch does not hand out its module's
    /// C++ object, so the layer loads the file again to list them: the values are *as saved in the
    /// file*, which are the module's own unless something in this process has changed them since
    /// it was loaded (a training-mode forward updating running statistics, say).
    pub fn named_buffers(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(crate::cxx::jit_named_buffers(&self.path)?.into_iter().map(|(n, t)| (n, t.to_device(self.device))).collect())
    }

    /// Calls `method` (`forward` for the module's call) with `inputs`. A missing method, or inputs
    /// the module's code rejects (wrong rank, dtype, count), is an [`Error::File`] naming both.
    pub fn call(&self, method: &str, inputs: &[IValue]) -> Result<IValue> {
        let out = if method == "forward" { self.module.forward_is(inputs) } else { self.module.method_is(method, inputs) };
        out.map_err(|e| {
            let line = first_line(&e);
            let message = if line.contains(&format!("'{method}'")) && (line.contains("not defined") || line.contains("does not have")) {
                format!("the module has no method '{method}'")
            } else if line.contains("Expected all tensors to be on the same device") {
                // torch.jit.trace records `device=x.device` as the tracing device: a constant.
                format!(
                    "{method}({}) failed: {line} (the module holds a tensor made on a fixed device, as torch.jit.trace records \
                     `device=x.device`; re-export it with that tensor as a buffer, or run it on the device it was traced on)",
                    describe_inputs(inputs)
                )
            } else {
                format!("{method}({}) failed: {line}", describe_inputs(inputs))
            };
            Error::File { path: self.path.clone(), message }
        })
    }

    /// Calls `forward` and returns its tensor outputs with their positions (a tensor, or a tuple
    /// or list of tensors and `None`s: the `None`s are dropped, the positions say where each
    /// tensor was).
    pub fn forward_tensors(&self, inputs: &[IValue]) -> Result<Vec<(usize, Tensor)>> {
        let out = self.call("forward", inputs)?;
        let items = match out {
            IValue::Tensor(t) => vec![IValue::Tensor(t)],
            IValue::Tuple(v) | IValue::GenericList(v) => v,
            IValue::TensorList(v) => v.into_iter().map(IValue::Tensor).collect(),
            other => {
                return Err(Error::File {
                    path: self.path.clone(),
                    message: format!("forward returned {}, not tensors", ivalue_kind(&other)),
                })
            }
        };
        Ok(items.into_iter().enumerate().filter_map(|(i, v)| if let IValue::Tensor(t) = v { Some((i, t)) } else { None }).collect())
    }
}

fn ivalue_kind(v: &IValue) -> &'static str {
    match v {
        IValue::None => "None",
        IValue::Tensor(_) => "a tensor",
        IValue::Double(_) => "a float",
        IValue::Int(_) => "an int",
        IValue::Bool(_) => "a bool",
        IValue::Tuple(_) => "a tuple",
        IValue::String(_) => "a string",
        IValue::GenericDict(_) => "a dict",
        _ => "a non-tensor value",
    }
}

/// `Float[2, 5, 16], None, Bool[2, 7]`: what was passed, for error messages.
fn describe_inputs(inputs: &[IValue]) -> String {
    inputs
        .iter()
        .map(|v| match v {
            IValue::Tensor(t) => format!("{:?}{:?}", t.kind(), t.size()),
            other => ivalue_kind(other).trim_start_matches("a ").trim_start_matches("an ").to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `*` matches any run of characters (dots included); everything else matches itself.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) || name.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

/// Which attention module a PyTorch parameter name belongs to, by `nn.Transformer`'s naming:
/// `encoder.layers.I.self_attn` (encoder self-attention, layer I), `decoder.layers.I.self_attn`
/// (decoder self-attention), `decoder.layers.I.multihead_attn` (cross-attention); anything else
/// is `Other`, at the first number in the name (or 0).
pub fn module_kind_of(name: &str) -> (crate::repulsive::ModuleKind, usize) {
    use crate::repulsive::ModuleKind;
    let parts: Vec<&str> = name.split('.').collect();
    let layer = parts.iter().find_map(|p| p.parse::<usize>().ok()).unwrap_or(0);
    let side = parts.iter().find(|p| **p == "encoder" || **p == "decoder").copied();
    let kind = match (side, parts.contains(&"self_attn"), parts.contains(&"multihead_attn")) {
        (Some("encoder"), true, _) => ModuleKind::EncoderSelf,
        (Some("decoder"), true, _) => ModuleKind::DecoderSelf,
        (Some("decoder"), _, true) => ModuleKind::Cross,
        _ => ModuleKind::Other,
    };
    (kind, layer)
}

/// Registers with `hook` every packed `in_proj_weight` among `params` whose name matches
/// `pattern` (e.g. `*.self_attn.in_proj_weight`, or `*in_proj_weight` for all), as Q, K and V
/// sets of `heads` particles; the hook's selection filters them by [`module_kind_of`]. Returns
/// the names registered; none is an error that lists the candidates.
pub fn register_in_proj(
    hook: &mut crate::repulsive::RepulsiveHook,
    params: &[(String, Tensor)],
    pattern: &str,
    heads: i64,
) -> Result<Vec<String>> {
    let mut names = vec![];
    for (name, t) in params.iter().filter(|(n, _)| glob_match(pattern, n)) {
        let (kind, layer) = module_kind_of(name);
        hook.add_in_proj(name, t, heads, kind, layer)?;
        names.push(name.clone());
    }
    if names.is_empty() {
        let candidates: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).filter(|n| n.ends_with("in_proj_weight")).collect();
        return Err(Error::Config(format!(
            "no parameter matches '{pattern}' (in_proj_weight parameters: {})",
            if candidates.is_empty() { "none".into() } else { candidates.join(", ") }
        )));
    }
    Ok(names)
}

/// What [`import_params`] did with each name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImportReport {
    /// Copied: the destination's name.
    pub matched: Vec<String>,
    /// Destination parameters the source lacks (left as they were).
    pub missing: Vec<String>,
    /// Source names that map to no destination parameter.
    pub unexpected: Vec<String>,
    /// `(name, source shape, destination shape)`.
    pub wrong_shape: Vec<(String, Vec<i64>, Vec<i64>)>,
}

impl ImportReport {
    /// Every destination parameter was filled and every source tensor used.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.wrong_shape.is_empty()
    }

    /// One line per problem, then the count matched.
    pub fn summary(&self) -> String {
        let mut lines = vec![];
        lines.extend(self.missing.iter().map(|n| format!("missing (not in the source): {n}")));
        lines.extend(self.unexpected.iter().map(|n| format!("unexpected (no such parameter here): {n}")));
        lines.extend(self.wrong_shape.iter().map(|(n, s, d)| format!("wrong shape: {n}: source {s:?}, here {d:?}")));
        lines.push(format!("{} parameter(s) matched", self.matched.len()));
        lines.join("\n")
    }
}

/// Copies `source` tensors into the variables of `vs` by name: `rename` maps a source (PyTorch)
/// name to the VarStore name, or `None` to skip it on purpose (not reported). Values are cast to
/// each variable's dtype and device. Nothing is copied unless the import is complete, or
/// `allow_partial` is set, in which case the matched tensors are copied and the report says what
/// was not.
pub fn import_params<F>(vs: &nn::VarStore, source: &[(String, Tensor)], rename: F, allow_partial: bool) -> Result<ImportReport>
where
    F: Fn(&str) -> Option<String>,
{
    let vars: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
    let mut report = ImportReport::default();
    let mut copies: Vec<(Tensor, &Tensor)> = vec![];
    let mut seen: HashMap<String, String> = HashMap::new();
    for (name, t) in source {
        let Some(dest) = rename(name) else { continue };
        if let Some(first) = seen.insert(dest.clone(), name.clone()) {
            return Err(Error::Config(format!("source names {first} and {name} both map to {dest}")));
        }
        match vars.get(&dest) {
            None => report.unexpected.push(name.clone()),
            Some(var) if var.size() != t.size() => report.wrong_shape.push((name.clone(), t.size(), var.size())),
            Some(var) => {
                report.matched.push(dest.clone());
                copies.push((var.shallow_clone(), t));
            }
        }
    }
    report.missing = vars.keys().filter(|k| !seen.contains_key(*k)).cloned().collect();
    if !report.is_complete() && !allow_partial {
        return Err(Error::Config(format!(
            "the weights do not fit the model (allow a partial import to copy what matches):\n{}",
            report.summary()
        )));
    }
    tch::no_grad(|| {
        for (mut var, t) in copies {
            var.copy_(&t.to_device(var.device()).to_kind(var.kind()));
        }
    });
    Ok(report)
}

/// Reads a safetensors state dict as `(name, tensor)` pairs in name order.
pub fn read_state_dict(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let mut v: Vec<(String, Tensor)> = crate::io::read_safetensors(path)?.into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

/// Writes the variables of `vs` as a safetensors state dict (atomically), each renamed by
/// `rename` (VarStore name to PyTorch name).
pub fn export_params<F>(vs: &nn::VarStore, path: &Path, rename: F) -> Result<()>
where
    F: Fn(&str) -> String,
{
    let named: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (rename(&n), t)).collect();
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    crate::io::write_safetensors_atomic(path, &refs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repulsive::ModuleKind;

    #[test]
    fn globs_match_runs_of_any_characters() {
        assert!(glob_match("*in_proj_weight", "encoder.layers.0.self_attn.in_proj_weight"));
        assert!(glob_match("encoder.*.self_attn.*", "encoder.layers.3.self_attn.in_proj_weight"));
        assert!(glob_match("exact", "exact"));
        assert!(!glob_match("exact", "exactly"));
        assert!(!glob_match("*.self_attn.in_proj_weight", "layers.0.multihead_attn.in_proj_weight"));
        assert!(!glob_match("a*b*c", "acb"));
        assert!(!glob_match("ab*b", "ab"));
    }

    #[test]
    fn module_kinds_follow_nn_transformer_names() {
        assert_eq!(module_kind_of("encoder.layers.2.self_attn.in_proj_weight"), (ModuleKind::EncoderSelf, 2));
        assert_eq!(module_kind_of("decoder.layers.1.self_attn.in_proj_weight"), (ModuleKind::DecoderSelf, 1));
        assert_eq!(module_kind_of("decoder.layers.0.multihead_attn.in_proj_weight"), (ModuleKind::Cross, 0));
        assert_eq!(module_kind_of("in_proj_weight"), (ModuleKind::Other, 0));
    }
}
