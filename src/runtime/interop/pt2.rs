//! AOTInductor packages (`.pt2`): what PyTorch 2.11 offers in TorchScript's place.
//!
//! A package is made in PyTorch by
//! `torch._inductor.aoti_compile_and_package(torch.export.export(module, args, kwargs))`
//! (python/probattn_tools/export/pt2.py does it for our reference modules): the exported program compiled to a
//! shared library for one device and fixed input shapes. [`Pt2Package`] loads it with libtorch's
//! own `torch::inductor::AOTIModelPackageLoader` (through the C++ layer in `probattn-sys/csrc/`, since tch
//! cannot) and runs it on our tensors, forward only: a package holds no autograd graph.
//!
//! What is checked before libtorch sees the file, each a named [`Error`]: that it is there, that it
//! is an AOTInductor package (not TorchScript, a plain `torch.export.save`, a truncated or foreign
//! file), that it was compiled for the device asked for (a CUDA package on a machine without
//! CUDA), and that this processor has the vector instructions it was compiled with. Each input's
//! dtype, sizes, strides and device are then checked by the compiled model itself
//! (`AOTI_RUNTIME_CHECK_INPUTS`, which the loader turns on) and, where python/probattn_tools/export/pt2.py
//! recorded the inputs in the package's metadata, by name before the call.
//!
//! ```no_run
//! use probattn::interop::Pt2Package;
//! use tch::{Device, Kind, Tensor};
//!
//! // python -m probattn_tools.export.pt2 mha --embed-dim 16 --heads 4 --out mha.pt2
//! let package = Pt2Package::load("mha.pt2".as_ref(), Device::Cpu)?;
//! let x = Tensor::randn([5, 2, 16], (Kind::Float, Device::Cpu)); // (L, N, E)
//! let outputs = package.run(&[&x, &x, &x])?; // attn_output, attn_weights
//! assert_eq!(outputs[0].size(), [5, 2, 16]);
//! # Ok::<(), probattn::Error>(())
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::{Device, Kind, Tensor};

use super::{archive_kind, ArchiveKind};
use crate::cxx::{self, Pt2Handle};
use crate::{Error, Result};

/// The metadata key under which python/probattn_tools/export/pt2.py records the inputs (JSON: a list of
/// [`InputSpec`]), in the order the package takes them.
pub const INPUTS_METADATA_KEY: &str = "probattn.inputs";

/// One input of a package, as python/probattn_tools/export/pt2.py records it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct InputSpec {
    /// The argument's name in the module's `forward` (`query`, `key_padding_mask`, ...).
    pub name: String,
    /// PyTorch's name of the dtype (`float32`, `float64`, `bool`, `int64`).
    pub dtype: String,
    pub shape: Vec<i64>,
}

/// A loaded AOTInductor package.
#[derive(Debug)]
pub struct Pt2Package {
    handle: Pt2Handle,
    path: PathBuf,
    device: Device,
    metadata: BTreeMap<String, String>,
    inputs: Option<Vec<InputSpec>>,
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "float32",
        Kind::Double => "float64",
        Kind::Half => "float16",
        Kind::BFloat16 => "bfloat16",
        Kind::Bool => "bool",
        Kind::Int64 => "int64",
        Kind::Int => "int32",
        _ => "another dtype",
    }
}

/// Whether this processor has the vector instructions `isa` (AOTInductor's `AOTI_CPU_ISA`, e.g.
/// "AVX512 AVX512_VNNI" or "AVX2") names; `None` when it cannot be told.
fn cpu_has(isa: &str) -> Option<bool> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let flags: Vec<&str> = info.lines().find(|l| l.starts_with("flags"))?.split_whitespace().collect();
    let needs = |flag: &str| flags.contains(&flag);
    Some(isa.split_whitespace().all(|part| match part {
        "AVX512" => needs("avx512f") && needs("avx512bw") && needs("avx512vl"),
        "AVX512_VNNI" => needs("avx512_vnni"),
        "AVX2" => needs("avx2") && needs("fma"),
        "AVX2_VNNI" => needs("avx_vnni"),
        _ => true, // an ISA name we do not know: leave it to the loader
    }))
}

impl Pt2Package {
    /// Loads the package at `path` to run on `device`.
    pub fn load(path: &Path, device: Device) -> Result<Self> {
        let file_error = |message: String| Error::File { path: path.into(), message };
        if !path.is_file() {
            return Err(Error::Io { path: path.into(), error: std::io::Error::new(std::io::ErrorKind::NotFound, "no such .pt2 package") });
        }
        match archive_kind(path)? {
            ArchiveKind::AotInductor => {}
            ArchiveKind::TorchScript => {
                return Err(file_error(
                    "a TorchScript archive, not an AOTInductor package: load it with probattn::interop::TorchScript \
                     (`probattn compare --torchscript`)"
                        .into(),
                ))
            }
            ArchiveKind::TorchExport => {
                return Err(file_error(
                    "a torch.export program without compiled code (torch.export.save): compile it into a package with \
                     torch._inductor.aoti_compile_and_package(torch.export.export(m, args)) (python/probattn_tools/export/pt2.py)"
                        .into(),
                ))
            }
            ArchiveKind::TorchSave => return Err(file_error("a torch.save() pickle, not an AOTInductor package (.pt2)".into())),
            ArchiveKind::NotAnArchive => {
                return Err(file_error(
                    "not an AOTInductor package (a zip with data/aotinductor/): corrupt, truncated or another format".into(),
                ))
            }
        }
        let metadata: BTreeMap<String, String> = serde_json::from_str(&cxx::pt2_metadata(path, "model")?)
            .map_err(|e| file_error(format!("its metadata is not a JSON object of strings: {e}")))?;
        let compiled_for = metadata.get("AOTI_DEVICE_KEY").map(String::as_str).unwrap_or("cpu");
        let device_index = match (compiled_for, device) {
            ("cpu", Device::Cpu) => -1,
            ("cuda", Device::Cuda(i)) => {
                if !tch::Cuda::is_available() {
                    return Err(Error::Device(format!("{}: the package runs on CUDA, and no CUDA device is visible", path.display())));
                }
                i as i64
            }
            ("cuda", _) => {
                let here = if tch::Cuda::is_available() { "pass a CUDA device (--device cuda)" } else { "this machine has no CUDA device" };
                return Err(file_error(format!(
                    "the package was compiled for CUDA (AOTI_DEVICE_KEY cuda) and runs only there; {here}, or export it again \
                     for the CPU (python/probattn_tools/export/pt2.py --device cpu)"
                )));
            }
            (other, _) => {
                return Err(file_error(format!(
                    "the package was compiled for {other} (AOTI_DEVICE_KEY), not for {device:?}: export it again on that device"
                )))
            }
        };
        if compiled_for == "cpu" {
            if let Some(isa) = metadata.get("AOTI_CPU_ISA").filter(|isa| !isa.is_empty()) {
                if cpu_has(isa) == Some(false) {
                    return Err(file_error(format!(
                        "the package was compiled for a processor with {isa}, which this one lacks: export it again on this machine"
                    )));
                }
            }
        }
        let inputs = match metadata.get(INPUTS_METADATA_KEY) {
            Some(json) => {
                Some(serde_json::from_str(json).map_err(|e| file_error(format!("its {INPUTS_METADATA_KEY} metadata is unreadable: {e}")))?)
            }
            None => None,
        };
        let handle = Pt2Handle::load(path, "model", device_index)?;
        Ok(Self { handle, path: path.into(), device, metadata, inputs })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The package's metadata: AOTInductor's (`AOTI_DEVICE_KEY`, `AOTI_CPU_ISA`, ...) and the
    /// exporter's own.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The inputs in the order the package takes them, when the exporter recorded them
    /// (python/probattn_tools/export/pt2.py does).
    pub fn inputs(&self) -> Option<&[InputSpec]> {
        self.inputs.as_deref()
    }

    /// The package's weights and buffers under their `state_dict` names (`in_proj_weight`,
    /// `out_proj.weight`), on the package's device.
    pub fn named_constants(&self) -> Result<Vec<(String, Tensor)>> {
        let mut constants =
            self.handle.constants().map_err(|m| Error::File { path: self.path.clone(), message: format!("listing its weights: {m}") })?;
        constants.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(constants)
    }

    /// Runs the package on `inputs`, in the order it takes them (for `nn.MultiheadAttention`
    /// exported with `key_padding_mask` as a keyword: query, key, value, key_padding_mask), and
    /// returns its outputs. Inputs are made contiguous (the compiled model expects the example's
    /// strides); their device must be the package's.
    pub fn run(&self, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let error = |message: String| Error::File { path: self.path.clone(), message };
        if let Some(specs) = &self.inputs {
            if specs.len() != inputs.len() {
                let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
                return Err(error(format!("the package takes {} inputs ({}), got {}", specs.len(), names.join(", "), inputs.len())));
            }
            for (spec, t) in specs.iter().zip(inputs) {
                if kind_name(t.kind()) != spec.dtype || t.size() != spec.shape {
                    return Err(error(format!(
                        "input {} is {}{:?}; the package was exported for {}{:?} (its shapes are fixed at export)",
                        spec.name,
                        kind_name(t.kind()),
                        t.size(),
                        spec.dtype,
                        spec.shape
                    )));
                }
            }
        }
        if let Some((i, t)) = inputs.iter().enumerate().find(|(_, t)| t.device() != self.device) {
            return Err(error(format!("input {i} is on {:?}, the package runs on {:?}", t.device(), self.device)));
        }
        let contiguous: Vec<Tensor> = inputs.iter().map(|t| t.contiguous()).collect();
        let refs: Vec<&Tensor> = contiguous.iter().collect();
        self.handle.run(&refs).map_err(|m| {
            error(format!(
                "running the package failed ({m}); AOTInductor prints its reason on standard error above: a wrong input count, \
                 dtype, shape or device"
            ))
        })
    }
}
