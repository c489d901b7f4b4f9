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
