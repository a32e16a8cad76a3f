//! One error type for the whole crate: every bad input becomes a message that names the problem.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// The GGUF file is malformed, truncated, hostile or uses something we do not support.
    #[error("GGUF: {0}")]
    Gguf(String),
    /// The file parsed, but does not describe a model we can run.
    #[error("model: {0}")]
    Model(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A chat template that is missing, does not compile or fails to render.
    #[error("chat template: {0}")]
    Template(String),
    /// An invalid JSON schema, regex or grammar, or a structured-output constraint that cannot be
    /// followed (a forced token it refuses, a tokenizer it cannot read).
    #[error("constraint: {0}")]
    Constraint(String),
    /// A request the model cannot serve (prompt longer than the context, empty prompt, ...).
    #[error("{0}")]
    Input(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for `Err(Error::Gguf(format!(...)))`.
macro_rules! gguf_err {
    ($($arg:tt)*) => { Err($crate::error::Error::Gguf(format!($($arg)*))) };
}
pub(crate) use gguf_err;
