//! probattn-sys: probattn's C++ layer (`csrc/`, compiled by `build.rs` against the libtorch that
//! tch links) and its boundary: the `extern "C"` declarations and the only `unsafe` code that
//! calls them. Everything public is safe and returns [`Error`]; the `probattn` crate builds its
//! tiles, memory statistics, `.pt2` loading and distributed training on it, and turns [`Error`]
//! into its own.
//!
//! Each C++ function catches every exception and returns it as a message (see
//! `csrc/probattn.h`), so libtorch's errors arrive here as values, never as an abort.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr;

use tch::Tensor;
use torch_sys::C_tensor;

mod fused_cuda;
mod tiled;
pub use fused_cuda::{
    fused_cuda_attention, fused_cuda_dry_run, fused_cuda_status, fused_linear_kl_terms, CudaDevice, FusedOutput, FusedSpec,
};
pub use probattn_kernels as kernels;
pub use tiled::{counter_noise, tiled_attention, widened_matmul, widened_softmax, TiledOutput, TiledRoute, TiledSpec};

/// What a call into the C++ layer can fail with.
#[derive(Debug)]
pub enum Error {
    /// A bad argument: a path or a name with a NUL byte, a path that is not UTF-8.
    Config(String),
    /// A file the C++ layer could not read as asked.
    File { path: PathBuf, message: String },
    /// libtorch raised (its message).
    Torch(String),
    /// A device query failed.
    Device(String),
    /// A route that was required does not serve the call (why).
    NotServed(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(m) | Self::Torch(m) | Self::Device(m) | Self::NotServed(m) => f.write_str(m),
            Self::File { path, message } => write!(f, "{}: {message}", path.display()),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// The CPU memory counter built as a shared library too (`libprobattn_memory.so`), for the
/// Python side of `probattn bench`.
pub const MEMORY_LIB: &str = env!("PROBATTN_MEMORY_LIB");

#[repr(C)]
struct PaTensors {
    _opaque: [u8; 0],
}

#[repr(C)]
struct PaPt2 {
    _opaque: [u8; 0],
}

/// libtorch's autocast state for one device type (`pa_autocast_state`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AutocastState {
    enabled: i32,
    dtype: i32,
}

#[repr(C)]
struct PaDist {
    _opaque: [u8; 0],
}

#[repr(C)]
struct PaReducer {
    _opaque: [u8; 0],
}

extern "C" {
    fn pa_string_free(s: *mut c_char);
    fn pa_silence_warning(prefix: *const c_char) -> *mut c_char;
    fn pa_cpu_rng_state(out: *mut *mut C_tensor) -> *mut c_char;
    fn pa_set_cpu_rng_state(state: *const C_tensor) -> *mut c_char;
    fn pa_tensors_len(list: *const PaTensors) -> usize;
    fn pa_tensors_name(list: *const PaTensors, i: usize) -> *const c_char;
    fn pa_tensors_get(list: *const PaTensors, i: usize) -> *mut C_tensor;
    fn pa_tensors_free(list: *mut PaTensors);
    fn pa_pt2_metadata(path: *const c_char, model_name: *const c_char, json: *mut *mut c_char) -> *mut c_char;
    fn pa_pt2_load(path: *const c_char, model_name: *const c_char, device_index: i64, out: *mut *mut PaPt2) -> *mut c_char;
    fn pa_pt2_run(package: *mut PaPt2, inputs: *const *const C_tensor, n: usize, outputs: *mut *mut PaTensors) -> *mut c_char;
    fn pa_pt2_constants(package: *mut PaPt2, out: *mut *mut PaTensors) -> *mut c_char;
    fn pa_pt2_free(package: *mut PaPt2);
    fn pa_jit_named_buffers(path: *const c_char, out: *mut *mut PaTensors) -> *mut c_char;
    fn pa_autocast_enter(cuda: i32, dtype: i32, previous: *mut AutocastState) -> *mut c_char;
    fn pa_autocast_exit(cuda: i32, previous: *const AutocastState) -> *mut c_char;
    fn pa_autocast_state_of(cuda: i32, state: *mut AutocastState) -> *mut c_char;
    fn pa_autocast_set_enabled(cuda: i32, enabled: i32) -> *mut c_char;
    fn pa_allow_tf32(allow: i32, previous: *mut i32) -> *mut c_char;
    fn pa_deterministic_algorithms(set: i32, previous: *mut i32) -> *mut c_char;
    fn pa_cpu_memory_track() -> *mut c_char;
    fn pa_cpu_memory_stats(current: *mut i64, peak: *mut i64, tracking: *mut i64) -> *mut c_char;
    fn pa_cpu_memory_reset_peak() -> *mut c_char;
    fn pa_cuda_memory_stats(
        device: i64,
        allocated: *mut i64,
        allocated_peak: *mut i64,
        reserved: *mut i64,
        reserved_peak: *mut i64,
    ) -> *mut c_char;
    fn pa_cuda_memory_reset_peak(device: i64) -> *mut c_char;
    fn pa_dist_has_gloo() -> i32;
    fn pa_dist_has_nccl() -> i32;
    fn pa_dist_join(
        backend: *const c_char,
        host: *const c_char,
        port: i32,
        is_server: i32,
        prefix: *const c_char,
        rank: i32,
        world_size: i32,
        timeout_ms: i64,
        out: *mut *mut PaDist,
    ) -> *mut c_char;
    fn pa_dist_broadcast(dist: *mut PaDist, tensors: *const *const C_tensor, n: usize, root: i32) -> *mut c_char;
    fn pa_dist_all_reduce(dist: *mut PaDist, tensors: *const *const C_tensor, n: usize, op: i32) -> *mut c_char;
    fn pa_dist_all_gather(dist: *mut PaDist, tensor: *const C_tensor, out: *mut *mut PaTensors) -> *mut c_char;
    fn pa_dist_barrier(dist: *mut PaDist) -> *mut c_char;
    fn pa_dist_free(dist: *mut PaDist);
    fn pa_reducer_new(
        dist: *mut PaDist,
        params: *const *const C_tensor,
        n: usize,
        bucket_bytes: i64,
        find_unused: i32,
        out: *mut *mut PaReducer,
    ) -> *mut c_char;
    fn pa_reducer_prepare(reducer: *mut PaReducer, outputs: *const *const C_tensor, n: usize) -> *mut c_char;
    fn pa_reducer_free(reducer: *mut PaReducer);
}

/// Takes ownership of a C string the C++ layer allocated; `None` for NULL.
fn take_string(s: *mut c_char) -> Option<String> {
    if s.is_null() {
        return None;
    }
    // SAFETY: `s` is not NULL, so it is a NUL-terminated string from `copy_string` (malloc) or the
    // layer's static out-of-memory message, which `pa_string_free` knows not to free; freed here
    // exactly once.
    unsafe {
        let text = CStr::from_ptr(s).to_string_lossy().into_owned();
        pa_string_free(s);
        Some(text)
    }
}

/// `Ok` when the C++ call returned no message; `what` names the call in the error.
fn check(message: *mut c_char, what: impl FnOnce(String) -> Error) -> Result<()> {
    match take_string(message) {
        None => Ok(()),
        Some(text) => Err(what(text)),
    }
}

/// Drops every later libtorch warning that starts with `prefix` (see `device::silence_libtorch_warning`).
pub fn silence_warning(prefix: &str) -> Result<()> {
    let prefix = CString::new(prefix).map_err(|_| Error::Config(format!("{prefix:?}: a warning prefix with a NUL byte")))?;
    // SAFETY: a valid NUL-terminated string, borrowed for the call (the C++ side copies it).
    check(unsafe { pa_silence_warning(prefix.as_ptr()) }, |m| Error::Config(format!("silencing a libtorch warning: {m}")))
}

/// The CPU's default generator's state (what `tch::manual_seed` seeds), as `torch.get_rng_state`
/// returns it.
pub fn cpu_rng_state() -> Result<Tensor> {
    let mut out = ptr::null_mut();
    // SAFETY: `out` is written on success only, with a new tensor that `Tensor::from_ptr` owns.
    unsafe {
        check(pa_cpu_rng_state(&mut out), Error::Torch)?;
        Ok(Tensor::from_ptr(out))
    }
}

/// Sets the CPU's default generator back to a state from [`cpu_rng_state`].
pub fn set_cpu_rng_state(state: &Tensor) -> Result<()> {
    // SAFETY: the tensor is borrowed for the call; the C++ side copies the state.
    check(unsafe { pa_set_cpu_rng_state(state.as_ptr()) }, Error::Torch)
}

fn c_path(path: &Path) -> Result<CString> {
    let text = path.to_str().ok_or_else(|| Error::Config(format!("{}: the C++ layer needs a UTF-8 path", path.display())))?;
    CString::new(text).map_err(|_| Error::Config(format!("{text:?}: a path with a NUL byte")))
}

/// Moves a `pa_tensors` list into Rust and frees it. A NULL list, or a NULL entry (no memory for
/// its handle), is an error: skipping the entry would shift every later one (a `.pt2`'s outputs).
fn take_tensors(list: *mut PaTensors) -> std::result::Result<Vec<(String, Tensor)>, String> {
    if list.is_null() {
        return Err("the C++ layer returned no list of tensors".into());
    }
    // SAFETY: `list` is a live list from the C++ layer; `pa_tensors_get` returns NULL or a new
    // `at::Tensor*` that `Tensor::from_ptr` owns from then on; the list is freed once, after,
    // whatever happens to its entries.
    unsafe {
        let n = pa_tensors_len(list);
        let mut out = Vec::with_capacity(n);
        let mut failed = None;
        for i in 0..n {
            let name = pa_tensors_name(list, i);
            let name = if name.is_null() { String::new() } else { CStr::from_ptr(name).to_string_lossy().into_owned() };
            let t = pa_tensors_get(list, i);
            if t.is_null() {
                failed = Some(format!("entry {i} of {n} ({name:?}) could not be handed over (out of memory)"));
                break;
            }
            out.push((name, Tensor::from_ptr(t)));
        }
        pa_tensors_free(list);
        match failed {
            Some(message) => Err(message),
            None => Ok(out),
        }
    }
}

fn file_error(path: &Path) -> impl FnOnce(String) -> Error + '_ {
    move |message| Error::File { path: path.into(), message }
}

/// The metadata of the AOTInductor package at `path` (`AOTI_DEVICE_KEY`, the user's own), read
/// without loading the compiled model.
pub fn pt2_metadata(path: &Path, model_name: &str) -> Result<String> {
    let (p, m) = (c_path(path)?, CString::new(model_name).map_err(|_| Error::Config("a model name with a NUL byte".into()))?);
    let mut json = ptr::null_mut();
    // SAFETY: valid C strings; `json` is written on success only.
    check(unsafe { pa_pt2_metadata(p.as_ptr(), m.as_ptr(), &mut json) }, file_error(path))?;
    take_string(json).ok_or_else(|| Error::File { path: path.into(), message: "the C++ layer returned no metadata".into() })
}

/// A loaded AOTInductor package (owns libtorch's `AOTIModelPackageLoader`).
#[derive(Debug)]
pub struct Pt2Handle {
    raw: *mut PaPt2,
}

impl Pt2Handle {
    /// `device_index`: −1 for the CPU, else the CUDA device.
    pub fn load(path: &Path, model_name: &str, device_index: i64) -> Result<Self> {
        let (p, m) = (c_path(path)?, CString::new(model_name).map_err(|_| Error::Config("a model name with a NUL byte".into()))?);
        let mut raw = ptr::null_mut();
        // SAFETY: valid C strings; `raw` is written on success only.
        check(unsafe { pa_pt2_load(p.as_ptr(), m.as_ptr(), device_index, &mut raw) }, file_error(path))?;
        Ok(Self { raw })
    }

    /// Runs the compiled model on `inputs` (borrowed) and returns its outputs.
    pub fn run(&self, inputs: &[&Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let pointers: Vec<*const C_tensor> = inputs.iter().map(|t| t.as_ptr()).collect();
        let mut list = ptr::null_mut();
        // SAFETY: `self.raw` is live; the input pointers borrow tensors that outlive the call.
        into_string_result(unsafe { pa_pt2_run(self.raw, pointers.as_ptr(), pointers.len(), &mut list) })?;
        Ok(take_tensors(list)?.into_iter().map(|(_, t)| t).collect())
    }

    /// The package's weights and buffers under their original (`state_dict`) names.
    pub fn constants(&self) -> std::result::Result<Vec<(String, Tensor)>, String> {
        let mut list = ptr::null_mut();
        // SAFETY: `self.raw` is live.
        into_string_result(unsafe { pa_pt2_constants(self.raw, &mut list) })?;
        take_tensors(list)
    }
}

impl Drop for Pt2Handle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `pa_pt2_load` and is freed once.
        unsafe { pa_pt2_free(self.raw) }
    }
}

/// `torch::jit::Module::named_buffers()` of the TorchScript module at `path`, loaded on the CPU.
pub fn jit_named_buffers(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let p = c_path(path)?;
    let mut list = ptr::null_mut();
    let listing = |m| Error::File { path: path.into(), message: format!("listing its buffers: {m}") };
    // SAFETY: a valid C string; `list` is written on success only.
    check(unsafe { pa_jit_named_buffers(p.as_ptr(), &mut list) }, listing)?;
    take_tensors(list).map_err(listing)
}

/// The lower-precision dtypes autocast can run in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutocastDtype {
    BFloat16 = 1,
    Float16 = 2,
}

impl AutocastState {
    /// Whether autocast is on, and in which dtype.
    pub fn enabled(&self) -> Option<AutocastDtype> {
        (self.enabled != 0).then_some(if self.dtype == AutocastDtype::Float16 as i32 {
            AutocastDtype::Float16
        } else {
            AutocastDtype::BFloat16
        })
    }
}

fn autocast_error(message: String) -> Error {
    Error::Torch(format!("autocast: {message}"))
}

/// Turns on libtorch's autocast for the CPU (`cuda` false) or CUDA on the calling thread, in
/// `dtype`; returns the state before, for [`autocast_exit`].
pub fn autocast_enter(cuda: bool, dtype: AutocastDtype) -> Result<AutocastState> {
    let mut previous = AutocastState::default();
    // SAFETY: a valid out-pointer.
    check(unsafe { pa_autocast_enter(i32::from(cuda), dtype as i32, &mut previous) }, autocast_error)?;
    Ok(previous)
}

/// Restores the state [`autocast_enter`] returned; the outermost region clears the cast cache.
pub fn autocast_exit(cuda: bool, previous: &AutocastState) -> Result<()> {
    // SAFETY: a valid pointer, read during the call only.
    check(unsafe { pa_autocast_exit(i32::from(cuda), previous) }, autocast_error)
}

/// Switches autocast for the CPU or CUDA on or off on the calling thread, outside any region.
pub fn autocast_set_enabled(cuda: bool, enabled: bool) -> Result<()> {
    // SAFETY: plain integer arguments.
    check(unsafe { pa_autocast_set_enabled(i32::from(cuda), i32::from(enabled)) }, autocast_error)
}

/// One of libtorch's process-wide switches through its C function (`pa_allow_tf32`,
/// `pa_deterministic_algorithms`): -1 only asks, 0 or 1 sets it; returns its value before.
fn switch(ffi: unsafe extern "C" fn(i32, *mut i32) -> *mut c_char, value: i32) -> Result<bool> {
    let mut previous = 0;
    // SAFETY: a valid out-pointer; the functions take -1, 0 or 1.
    check(unsafe { ffi(value, &mut previous) }, Error::Torch)?;
    Ok(previous != 0)
}

/// Whether libtorch lets CUDA's float32 matrix products run in TF32 (PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32`; process-wide, not per thread).
pub fn allow_tf32() -> Result<bool> {
    switch(pa_allow_tf32, -1)
}

/// Sets libtorch's switch [`allow_tf32`] reads; returns its value before.
pub fn set_allow_tf32(allow: bool) -> Result<bool> {
    switch(pa_allow_tf32, i32::from(allow))
}

/// Whether libtorch's deterministic algorithms are asked for (PyTorch's
/// `torch.are_deterministic_algorithms_enabled()`; process-wide).
pub fn deterministic_algorithms() -> Result<bool> {
    switch(pa_deterministic_algorithms, -1)
}

/// Sets libtorch's switch [`deterministic_algorithms`] reads (its warn-only setting kept); returns
/// its value before.
pub fn set_deterministic_algorithms(on: bool) -> Result<bool> {
    switch(pa_deterministic_algorithms, i32::from(on))
}

/// The calling thread's autocast state for the CPU or CUDA.
pub fn autocast_state(cuda: bool) -> Result<AutocastState> {
    let mut state = AutocastState::default();
    // SAFETY: a valid out-pointer.
    check(unsafe { pa_autocast_state_of(i32::from(cuda), &mut state) }, autocast_error)?;
    Ok(state)
}

fn memory_error(message: String) -> Error {
    Error::Device(format!("memory statistics: {message}"))
}

/// Installs the counting CPU allocator (once; later calls do nothing).
pub fn cpu_memory_track() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { pa_cpu_memory_track() }, memory_error)
}

/// `(current, peak, tracking)`: bytes held by counted CPU tensors, the most since the last reset,
/// and whether the counting allocator is the CPU allocator now.
pub fn cpu_memory_stats() -> Result<(i64, i64, bool)> {
    let (mut current, mut peak, mut tracking) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    check(unsafe { pa_cpu_memory_stats(&mut current, &mut peak, &mut tracking) }, memory_error)?;
    Ok((current, peak, tracking != 0))
}

pub fn cpu_memory_reset_peak() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { pa_cpu_memory_reset_peak() }, memory_error)
}

/// `(allocated, allocated peak, reserved, reserved peak)` bytes of CUDA device `device`.
pub fn cuda_memory_stats(device: i64) -> Result<[i64; 4]> {
    let mut s = [0i64; 4];
    let [a, ap, r, rp] = &mut s;
    // SAFETY: four valid out-pointers.
    check(unsafe { pa_cuda_memory_stats(device, a, ap, r, rp) }, memory_error)?;
    Ok(s)
}

pub fn cuda_memory_reset_peak(device: i64) -> Result<()> {
    // SAFETY: a plain integer argument.
    check(unsafe { pa_cuda_memory_reset_peak(device) }, memory_error)
}

/// Whether the C++ layer was built with Gloo (`ProcessGroupGloo`).
pub fn dist_has_gloo() -> bool {
    // SAFETY: no arguments; reads a constant.
    unsafe { pa_dist_has_gloo() != 0 }
}

/// Whether the C++ layer was built with NCCL (`ProcessGroupNCCL`).
pub fn dist_has_nccl() -> bool {
    // SAFETY: no arguments; reads a constant.
    unsafe { pa_dist_has_nccl() != 0 }
}

/// Where and how to join a process group (see `pa_dist_join` in csrc/probattn.h).
pub struct JoinSpec<'a> {
    pub backend: &'a str,
    pub host: &'a str,
    pub port: u16,
    pub is_server: bool,
    pub prefix: &'a str,
    pub rank: usize,
    pub world_size: usize,
    pub timeout_ms: i64,
}

fn c_string(what: &str, text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| Error::Config(format!("{what} {text:?} has a NUL byte")))
}

fn tensor_pointers(tensors: &[&Tensor]) -> Vec<*const C_tensor> {
    tensors.iter().map(|t| t.as_ptr()).collect()
}

/// A c10d process group (its TCPStore and its Gloo or NCCL backend).
#[derive(Debug)]
pub struct DistHandle {
    raw: *mut PaDist,
}

impl DistHandle {
    pub fn join(spec: &JoinSpec) -> std::result::Result<Self, String> {
        let to_message = |e: Error| e.to_string();
        let backend = c_string("the backend", spec.backend).map_err(to_message)?;
        let host = c_string("the address", spec.host).map_err(to_message)?;
        let prefix = c_string("the store prefix", spec.prefix).map_err(to_message)?;
        let mut raw = ptr::null_mut();
        // SAFETY: valid C strings borrowed for the call; `raw` is written on success only.
        let message = unsafe {
            pa_dist_join(
                backend.as_ptr(),
                host.as_ptr(),
                i32::from(spec.port),
                i32::from(spec.is_server),
                prefix.as_ptr(),
                spec.rank as i32,
                spec.world_size as i32,
                spec.timeout_ms,
                &mut raw,
            )
        };
        into_string_result(message)?;
        Ok(Self { raw })
    }

    /// Broadcasts each tensor in place from `root`.
    pub fn broadcast(&self, tensors: &[&Tensor], root: usize) -> std::result::Result<(), String> {
        let pointers = tensor_pointers(tensors);
        // SAFETY: `self.raw` is live; the pointers borrow tensors that outlive the call.
        into_string_result(unsafe { pa_dist_broadcast(self.raw, pointers.as_ptr(), pointers.len(), root as i32) })
    }

    /// All-reduces each tensor in place: `max` false sums, true takes the maximum.
    pub fn all_reduce(&self, tensors: &[&Tensor], max: bool) -> std::result::Result<(), String> {
        let pointers = tensor_pointers(tensors);
        // SAFETY: as in `broadcast`.
        into_string_result(unsafe { pa_dist_all_reduce(self.raw, pointers.as_ptr(), pointers.len(), i32::from(max)) })
    }

    /// Every rank's copy of `tensor` (same shape on every rank), in rank order.
    pub fn all_gather(&self, tensor: &Tensor) -> std::result::Result<Vec<Tensor>, String> {
        let mut list = ptr::null_mut();
        // SAFETY: `self.raw` is live; `tensor` outlives the call; `list` is written on success.
        into_string_result(unsafe { pa_dist_all_gather(self.raw, tensor.as_ptr(), &mut list) })?;
        Ok(take_tensors(list)?.into_iter().map(|(_, t)| t).collect())
    }

    pub fn barrier(&self) -> std::result::Result<(), String> {
        // SAFETY: `self.raw` is live.
        into_string_result(unsafe { pa_dist_barrier(self.raw) })
    }

    /// DDP's gradient engine over `params` (it keeps its own reference to the process group).
    pub fn reducer(&self, params: &[&Tensor], bucket_bytes: i64, find_unused: bool) -> std::result::Result<ReducerHandle, String> {
        let pointers = tensor_pointers(params);
        let mut raw = ptr::null_mut();
        // SAFETY: `self.raw` is live; the parameters outlive the call (the reducer holds its own
        // references to them); `raw` is written on success only.
        into_string_result(unsafe {
            pa_reducer_new(self.raw, pointers.as_ptr(), pointers.len(), bucket_bytes, i32::from(find_unused), &mut raw)
        })?;
        Ok(ReducerHandle { raw })
    }
}

impl Drop for DistHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `pa_dist_join` and is freed once.
        unsafe { pa_dist_free(self.raw) }
    }
}

/// A `c10d::Reducer`.
#[derive(Debug)]
pub struct ReducerHandle {
    raw: *mut PaReducer,
}

impl ReducerHandle {
    /// What DDP's forward does before backward: `outputs` are the tensors backward starts from
    /// (read only when the reducer looks for unused parameters).
    pub fn prepare(&self, outputs: &[&Tensor]) -> std::result::Result<(), String> {
        let pointers = tensor_pointers(outputs);
        // SAFETY: `self.raw` is live; the outputs outlive the call.
        into_string_result(unsafe { pa_reducer_prepare(self.raw, pointers.as_ptr(), pointers.len()) })
    }
}

impl Drop for ReducerHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `pa_reducer_new` and is freed once.
        unsafe { pa_reducer_free(self.raw) }
    }
}

fn into_string_result(message: *mut c_char) -> std::result::Result<(), String> {
    match take_string(message) {
        None => Ok(()),
        Some(text) => Err(text),
    }
}
