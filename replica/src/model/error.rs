//! [`LoadError`], the one error every model loader returns: the safetensors reader, the
//! hyper-parameter parsers and the weight loader all report through it (GGUF header errors are
//! wrapped as they come), so it sits below them all and imports none of them. Every variant
//! names the file and the tensor or key, and says what was expected.

use std::path::Path;

use protocol::gguf::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("cannot read {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path}: {what} is not supported")]
    Unsupported { path: String, what: String },
    #[error("{path}: `{key}` should be {expected}")]
    Key {
        path: String,
        key: String,
        expected: &'static str,
    },
    #[error("{path}: tensor `{tensor}`: {what}")]
    Tensor {
        path: String,
        tensor: String,
        what: String,
    },
    #[error("{path} is truncated or corrupt: {what}")]
    Corrupt { path: String, what: String },
}

impl LoadError {
    /// A failed read of `path`.
    pub(super) fn io(path: &Path, e: std::io::Error) -> Self {
        LoadError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        }
    }
}
