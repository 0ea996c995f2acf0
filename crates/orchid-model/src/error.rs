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

impl Error {
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
