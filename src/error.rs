//! The library's error type: every fallible public function returns [`Result`].

use std::path::PathBuf;

/// What went wrong, in terms a user can act on (the message names the tensor, file or flag).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor has the wrong rank, size or dtype for where it was passed.
    #[error("shape error: {0}")]
    Shape(String),
    /// A configuration value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An attention variant name that the library does not know.
    #[error("unknown attention variant '{name}' (known: {known})")]
    UnknownVariant { name: String, known: String },
    /// A combination the library refuses because its result would be wrong (not merely slow).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// NaN or infinity in user input.
    #[error("non-finite input: {0}")]
    NonFinite(String),
    /// The requested device cannot be used.
    #[error("device error: {0}")]
    Device(String),
    /// A tensor could not be allocated: libtorch's allocator refused (CPU) or the device ran out
    /// (CUDA). The message names the computation and, where one applies, what needs less memory.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A collective of a distributed run failed: a rank died, the rendezvous or a collective timed
    /// out, or the ranks disagree.
    #[error("distributed: {0}")]
    Distributed(String),
    /// A file could not be read or written.
    /// (The I/O error is part of the message and not a `source()`, so a printed chain names it
    /// once.)
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    /// A file exists but its content is unusable (corrupt, missing entries, wrong layout).
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// An error raised inside libtorch.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
    /// A JSON (de)serialization error.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// `Result` with the library's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// [`Error::OutOfMemory`] for `what`, from libtorch's `message` (its line that names the
    /// failed allocation, without tch's wrapping or a C++ backtrace) and an optional `hint`.
    pub fn out_of_memory(what: &str, message: &str, hint: Option<&str>) -> Error {
        let line = message.split("\\n").flat_map(str::lines).find(|l| is_allocation_failure(l)).unwrap_or(message);
        let line = line.split_once("Torch(\"").map_or(line, |(_, rest)| rest).trim().trim_end_matches("\")");
        let hint = hint.map(|h| format!("; {h}")).unwrap_or_default();
        Error::OutOfMemory(format!("{what}: {line}{hint}"))
    }
}

/// Whether `message` is libtorch's report of a failed allocation (CPU or CUDA).
pub fn is_allocation_failure(message: &str) -> bool {
    ["can't allocate memory", "CUDA out of memory", "out of memory", "std::bad_alloc"].iter().any(|m| message.contains(m))
}

/// The text of a panic's payload, if it has one.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied())
}

/// Runs `body`, turning a failed allocation into [`Error::OutOfMemory`] naming `what` and `hint`.
///
/// tch's tensor operations panic when libtorch reports an error (its `f_` forms return it), so an
/// allocation that cannot be made inside a chain of them arrives as a panic whose message is
/// libtorch's; this catches exactly those (any other panic continues) and the `f_` errors with
/// the same message. The panic's own message has been printed by the panic hook by then, unless
/// the program's hook is quiet about allocation failures, as the `probattn` binary's is.
pub fn catch_out_of_memory<T>(what: &str, hint: Option<&str>, body: impl FnOnce() -> Result<T>) -> Result<T> {
    let named = |message: &str| Error::out_of_memory(what, message, hint);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Err(Error::Tch(tch::TchError::Torch(message)))) if is_allocation_failure(&message) => Err(named(&message)),
        Ok(result) => result,
        Err(payload) => match panic_message(payload.as_ref()) {
            Some(message) if is_allocation_failure(message) => Err(named(message)),
            _ => std::panic::resume_unwind(payload),
        },
    }
}
