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

impl From<probattn_sys::Error> for Error {
    fn from(e: probattn_sys::Error) -> Self {
        match e {
            probattn_sys::Error::Config(m) => Error::Config(m),
            probattn_sys::Error::File { path, message } => Error::File { path, message },
            probattn_sys::Error::Torch(m) => Error::Tch(tch::TchError::Torch(m)),
            probattn_sys::Error::Device(m) => Error::Device(m),
            probattn_sys::Error::NotServed(m) => Error::Unsupported(m),
        }
    }
}

impl Error {
    /// A variant that normalizes each key over the queries, asked to run under a causal mask:
    /// the one message [`crate::attend`] and [`crate::tiled`] give.
    pub fn causal_leak(variant: &str) -> Self {
        Error::Unsupported(format!(
            "{variant} normalizes each key over all queries, so under a causal mask future queries would change the \
             weights of earlier ones (a leak); use softmax for causal attention"
        ))
    }

    /// [`Error::OutOfMemory`] for `what`, from libtorch's `message` ([`libtorch_message`]) and an
    /// optional `hint`.
    pub fn out_of_memory(what: &str, message: &str, hint: Option<&str>) -> Error {
        let line = libtorch_message(message);
        let hint = hint.map(|h| format!("; {h}")).unwrap_or_default();
        Error::OutOfMemory(format!("{what}: {line}{hint}"))
    }

    /// A libtorch error from an `f_` operation: [`Error::OutOfMemory`] (as
    /// [`Error::out_of_memory`]) when it reports a failed allocation, else [`Error::Tch`].
    pub fn from_torch(error: tch::TchError, what: &str, hint: Option<&str>) -> Error {
        match error {
            tch::TchError::Torch(message) if is_allocation_failure(&message) => Error::out_of_memory(what, &message, hint),
            other => Error::Tch(other),
        }
    }
}

/// The first line of a libtorch error as tch reports it: without tch's `Torch("...")` wrapping
/// and without the C++ backtrace that follows (escaped `\n` in tch's text, or real newlines).
pub fn libtorch_message(text: &str) -> &str {
    let line = text.lines().next().unwrap_or_default();
    let line = line.split_once("Torch(\"").map_or(line, |(_, rest)| rest);
    line.split("\\n").next().unwrap_or_default().trim().trim_end_matches("\")")
}

/// Whether `message` is libtorch's report of a failed allocation (CPU or CUDA).
pub fn is_allocation_failure(message: &str) -> bool {
    ["can't allocate memory", "CUDA out of memory", "out of memory", "std::bad_alloc"].iter().any(|m| message.contains(m))
}

/// The text of a panic's payload, if it has one.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied())
}

/// Runs `body`, turning a panic on a failed allocation into [`Error::OutOfMemory`] naming `what`
/// and `hint` (as `E`, which may be [`Error`] or any error built from one).
///
/// tch's tensor operations panic when libtorch reports an error (its `f_` forms return it, and
/// [`Error::from_torch`] names an allocation failure among those), so an allocation that cannot
/// be made inside a chain of them arrives as a panic whose message is libtorch's; this catches
/// exactly those, and any other panic continues. The panic's own message has been printed by the
/// panic hook by then, unless the program's hook is quiet about allocation failures, as the
/// `probattn` binary's is.
pub fn catch_out_of_memory<T, E: From<Error>>(
    what: &str,
    hint: Option<&str>,
    body: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => match panic_message(payload.as_ref()) {
            Some(message) if is_allocation_failure(message) => Err(Error::out_of_memory(what, message, hint).into()),
            _ => std::panic::resume_unwind(payload),
        },
    }
}
