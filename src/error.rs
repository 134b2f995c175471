//! Typed errors. Every bad input names the argument and the value it got.

use crate::types::{DType, Device};

/// Why a backend declines a problem: one line per reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    /// The backend that declined.
    pub backend: &'static str,
    /// Each reason, as a sentence.
    pub reasons: Vec<String>,
}

impl std::error::Error for Unsupported {}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "backend `{}` does not support this problem: {}", self.backend, self.reasons.join("; "))
    }
}

/// Every error attnkit returns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The backend exists by name but its cargo feature was off at build time.
    #[error("backend `{backend}` was not compiled in: enable the cargo feature `{feature}`")]
    NotCompiled {
        /// Backend name.
        backend: &'static str,
        /// The cargo feature that builds it.
        feature: &'static str,
    },
    /// No backend of that name exists.
    #[error("unknown backend `{0}` (known: reference, cpu, wgpu, cuda)")]
    UnknownBackend(String),
    /// The backend was compiled in but found no device to run on.
    #[error("backend `{backend}` found no device: {msg}")]
    NoDevice {
        /// Backend name.
        backend: &'static str,
        /// What the driver said.
        msg: String,
    },
    /// An argument has the wrong shape.
    #[error("`{arg}` has shape {got:?}, expected {expected}")]
    Shape {
        /// Argument name (as in the SPEC: `q`, `k_cache`, `out`, ...).
        arg: &'static str,
        /// The shape given.
        got: Vec<usize>,
        /// The shape or rank expected, in words.
        expected: String,
    },
    /// An argument has the wrong dtype.
    #[error("`{arg}` has dtype {got}, expected {expected}")]
    DType {
        /// Argument name.
        arg: &'static str,
        /// The dtype given.
        got: DType,
        /// The dtype(s) expected, in words.
        expected: String,
    },
    /// An argument lives on another device than the backend.
    #[error("`{arg}` is on {got}, but backend `{backend}` runs on {expected}")]
    Device {
        /// Argument name.
        arg: &'static str,
        /// The device the tensor is on.
        got: Device,
        /// The backend's device.
        expected: Device,
        /// Backend name.
        backend: &'static str,
    },
    /// An argument has a bad value (non-monotone cu_seqlens, block index out of range, ...).
    #[error("`{arg}` = {value}: {msg}")]
    Value {
        /// Argument name, with an index where one helps (`cu_seqlens_q[3]`).
        arg: String,
        /// The offending value, printed.
        value: String,
        /// What is wrong with it.
        msg: String,
    },
    /// The backend cannot run this problem (head dim, dtype, feature).
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    /// A driver or runtime failure inside a backend.
    #[error("backend `{backend}`: {msg}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What failed.
        msg: String,
    },
    /// Reading or writing a file.
    #[error("{path}: {msg}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        msg: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn value(arg: impl Into<String>, value: impl std::fmt::Display, msg: impl Into<String>) -> Self {
        Error::Value { arg: arg.into(), value: value.to_string(), msg: msg.into() }
    }
}
