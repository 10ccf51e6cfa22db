//! Who may do what. Three credentials, each a bearer token:
//! - the **admin token** guards the admin port (policy reload, explain, replica state,
//!   metrics); it is required when that port listens beyond loopback;
//! - the **fleet token** is what the gateway presents to replicas, which refuse their internal
//!   endpoints (KV events, cache flush, tokenize/detokenize) without it;
//! - **API keys** identify clients: each maps to a tenant (its prefix-cache scope) and to the
//!   priority classes it may use. The key file is reloaded when it changes and on SIGHUP; a
//!   bad file is refused whole and the keys in force stay.
//!
//! Secrets come from environment variables or files, never from the gateway file itself, and
//! are compared in constant time.

use std::path::{Path, PathBuf};

use arc_swap::ArcSwap;
use config::{ApiKeys, Grant};
use http::HeaderMap;
use parking_lot::Mutex;
pub use protocol::auth::{bearer, check_bearer, constant_eq, unauthorized};
use protocol::ApiError;

pub const ADMIN_TOKEN_ENV: &str = "KVGATE_ADMIN_TOKEN";
pub const FLEET_TOKEN_ENV: &str = "KVGATE_FLEET_TOKEN";
pub const API_KEYS_ENV: &str = "KVGATE_API_KEYS";

/// Why a secret or the API key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{0} is set but empty")]
    EmptyEnv(String),
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: a token needs at least 16 characters (got {len})")]
    ShortToken { path: String, len: usize },
    #[error("{path}: {source}")]
    KeyFile {
        path: String,
        source: config::ConfigError,
    },
    #[error("{API_KEYS_ENV}: {0}")]
    EnvKeys(config::ConfigError),
    #[error(
        "the admin port listens on {0} (not loopback): give it a token with {ADMIN_TOKEN_ENV} \
         or auth.admin_token_file, or listen on 127.0.0.1"
    )]
    OpenAdminPort(String),
}

fn read(path: &Path) -> Result<String, AuthError> {
    std::fs::read_to_string(path).map_err(|source| AuthError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// A secret from `env` (wins) or `file`; `Ok(None)` when neither is set.
pub fn read_secret(env: &str, file: Option<&str>) -> Result<Option<String>, AuthError> {
    if let Ok(v) = std::env::var(env) {
        let v = v.trim().to_string();
        if v.is_empty() {
            return Err(AuthError::EmptyEnv(env.to_string()));
        }
        return Ok(Some(v));
    }
    let Some(path) = file else { return Ok(None) };
    let text = read(Path::new(path))?;
    let v = text.trim().to_string();
    if v.len() < 16 {
        return Err(AuthError::ShortToken {
            path: path.to_string(),
            len: v.len(),
        });
    }
    Ok(Some(v))
}

/// Whether a listen address binds only the loopback interface.
pub fn is_loopback(listen: &str) -> bool {
    match listen.parse::<std::net::SocketAddr>() {
        Ok(a) => a.ip().is_loopback(),
        Err(_) => listen.starts_with("localhost:"),
    }
}

/// The client API keys in force, reloadable.
pub struct ApiKeyStore {
    keys: ArcSwap<ApiKeys>,
    path: Option<PathBuf>,
    env: Option<String>,
    last_seen: Mutex<Option<u64>>,
}

fn load(path: Option<&PathBuf>, env: Option<&str>) -> Result<(ApiKeys, Option<u64>), AuthError> {
    let (mut keys, seen) = match path {
        Some(p) => {
            let text = read(p)?;
            let k = ApiKeys::from_toml(&text).map_err(|source| AuthError::KeyFile {
                path: p.display().to_string(),
                source,
            })?;
            (k, Some(xxhash_rust::xxh3::xxh3_64(text.as_bytes())))
        }
        None => (ApiKeys::default(), None),
    };
    if let Some(spec) = env {
        keys.add_env(spec).map_err(AuthError::EnvKeys)?;
    }
    Ok((keys, seen))
}

impl ApiKeyStore {
    /// Loads the key file (if any) and `KVGATE_API_KEYS` (if set).
    pub fn new(path: Option<PathBuf>) -> Result<Self, AuthError> {
        let env = std::env::var(API_KEYS_ENV)
            .ok()
            .filter(|s| !s.trim().is_empty());
        let (keys, seen) = load(path.as_ref(), env.as_deref())?;
        Ok(ApiKeyStore {
            keys: ArcSwap::from_pointee(keys),
            path,
            env,
            last_seen: Mutex::new(seen),
        })
    }

    /// No keys at all: the API is open to anyone (one anonymous tenant).
    pub fn is_open(&self) -> bool {
        self.keys.load().is_empty()
    }

    pub fn count(&self) -> usize {
        self.keys.load().len()
    }

    /// Re-reads the key file; `force` even when its text did not change. `Ok(true)` when new
    /// keys are in force; an error leaves the old ones.
    pub fn reload(&self, force: bool) -> Result<bool, AuthError> {
        let Some(path) = &self.path else {
            return Ok(false);
        };
        if !force {
            let text = read(path)?;
            if *self.last_seen.lock() == Some(xxhash_rust::xxh3::xxh3_64(text.as_bytes())) {
                return Ok(false);
            }
        }
        let result = load(Some(path), self.env.as_deref());
        match result {
            Ok((keys, seen)) => {
                *self.last_seen.lock() = seen;
                tracing::info!(keys = keys.len(), file = %path.display(), "API keys reloaded");
                self.keys.store(std::sync::Arc::new(keys));
                Ok(true)
            }
            Err(e) => {
                // Remember the bad text too, so the watcher reports it once, not every second.
                if let Ok(text) = std::fs::read_to_string(path) {
                    *self.last_seen.lock() = Some(xxhash_rust::xxh3::xxh3_64(text.as_bytes()));
                }
                tracing::warn!(error = %e, "API key file rejected; the keys in force stay");
                Err(e)
            }
        }
    }

    /// The caller's grant: `Ok(None)` on an open API, an error for a missing or unknown key.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Grant>, ApiError> {
        let keys = self.keys.load();
        if keys.is_empty() {
            return Ok(None);
        }
        let presented = bearer(headers)
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .ok_or_else(|| {
                unauthorized(
                    "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                    "missing_api_key",
                )
            })?;
        keys.lookup(presented)
            .cloned()
            .map(Some)
            .ok_or_else(|| unauthorized("Incorrect API key provided.", "invalid_api_key"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_listeners_are_recognised() {
        assert!(is_loopback("127.0.0.1:9090"));
        assert!(is_loopback("[::1]:9090"));
        assert!(is_loopback("localhost:9090"));
        assert!(!is_loopback("0.0.0.0:9090"));
        assert!(!is_loopback("10.1.2.3:9090"));
    }
}
