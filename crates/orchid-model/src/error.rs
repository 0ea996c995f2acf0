//! Errors a checkpoint, a config or a request can trigger. Each names what was wrong and where.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },
    #[error("config field `{field}`: {msg}")]
    Config { field: String, msg: String },
    #[error("{file}: config field `{field}`: {msg}")]
    ConfigFile { file: PathBuf, field: String, msg: String },
    #[error("{file}: tensor `{tensor}`: {msg}")]
    Tensor { file: PathBuf, tensor: String, msg: String },
    #[error("{file}: {msg}")]
    Checkpoint { file: PathBuf, msg: String },
    #[error("{op}: {msg}")]
    Op { op: &'static str, msg: String },
    #[error("{0}")]
    Backend(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A model folder that cannot be used: its config, checkpoint, tokenizer or chat template is
/// broken or missing. The message names the file and the tensor or field. The `orchid` binary
/// exits with code 3 for this error (and for an [`Error`] that [`Error::is_load_error`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LoadError(pub String);

impl Error {
    /// Whether this error is about the model folder (config, checkpoint files, tensors) rather
    /// than about running the model (an op or a device failure).
    pub fn is_load_error(&self) -> bool {
        !matches!(self, Error::Op { .. } | Error::Backend(_))
    }

    /// Attaches the file a config error came from.
    pub fn in_file(self, file: &Path) -> Error {
        match self {
            Error::Config { field, msg } => Error::ConfigFile { file: file.to_path_buf(), field, msg },
            other => other,
        }
    }

    pub fn tensor(file: &Path, tensor: &str, msg: impl Into<String>) -> Error {
        Error::Tensor { file: file.to_path_buf(), tensor: tensor.to_string(), msg: msg.into() }
    }
}
