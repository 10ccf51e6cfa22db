//! Client API keys (`auth.api_keys_file`, e.g. `config/api_keys.toml`, and `KVGATE_API_KEYS`):
//! each key maps to a tenant and to the priority classes (`x-kvgate-priority`) it may use. The
//! tenant decides the request's prefix-cache scope (`cache_salt`) and appears in the access
//! log; the classes decide which routes it can reach.
//!
//! ```toml
//! [[keys]]
//! key_sha256 = "9f86d08188…"   # sha256 of the key, hex; or `key = "sk-…"` in clear
//! tenant = "acme"
//! priorities = ["interactive", "batch"]   # default: ["interactive"]
//! ```
//!
//! Keys are held and compared as SHA-256 digests, so a file need not hold them in clear.

use std::collections::HashMap;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{ConfigError, FieldError, Validator};
use crate::routes::Priority;

/// What a key grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub tenant: String,
    pub priorities: Vec<Priority>,
}

impl Grant {
    pub fn allows(&self, p: Priority) -> bool {
        self.priorities.contains(&p)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    key_sha256: Option<String>,
    tenant: String,
    #[serde(default = "default_priorities")]
    priorities: Vec<Priority>,
}

fn default_priorities() -> Vec<Priority> {
    vec![Priority::Interactive]
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: Vec<KeyEntry>,
}

/// A validated key table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ApiKeys {
    by_digest: HashMap<[u8; 32], Grant>,
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn parse_hex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn valid_tenant(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 64
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// The hex SHA-256 of `key`, as `key_sha256` wants it.
pub fn key_digest_hex(key: &str) -> String {
    digest(key).iter().map(|b| format!("{b:02x}")).collect()
}

impl ApiKeys {
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// The grant of a presented key, if it is known.
    pub fn lookup(&self, presented: &str) -> Option<&Grant> {
        self.by_digest.get(&digest(presented))
    }

    /// Tenants named by some key.
    pub fn tenants(&self) -> Vec<&str> {
        let mut t: Vec<&str> = self.by_digest.values().map(|g| g.tenant.as_str()).collect();
        t.sort_unstable();
        t.dedup();
        t
    }

    /// Parses and validates a keys file.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let f: KeysFile = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let mut v = Validator::new();
        let mut keys = ApiKeys::default();
        for (i, e) in f.keys.iter().enumerate() {
            let field = |n: &str| format!("keys[{i}].{n}");
            let d = match (&e.key, &e.key_sha256) {
                (Some(k), None) if k.len() >= 16 => Some(digest(k)),
                (Some(k), None) => {
                    v.check(
                        false,
                        &field("key"),
                        format!("({} characters)", k.len()),
                        "a key has at least 16 characters",
                    );
                    None
                }
                (None, Some(h)) => {
                    let d = parse_hex(h);
                    v.check(
                        d.is_some(),
                        &field("key_sha256"),
                        format!("{h:?}"),
                        "must be 64 hex digits (sha256 of the key)",
                    );
                    d
                }
                _ => {
                    v.check(
                        false,
                        &format!("keys[{i}]"),
                        "",
                        "give exactly one of key or key_sha256",
                    );
                    None
                }
            };
            v.check(
                valid_tenant(&e.tenant),
                &field("tenant"),
                format!("{:?}", e.tenant),
                "must be 1-64 letters, digits, '_', '-' or '.'",
            );
            v.check(
                !e.priorities.is_empty(),
                &field("priorities"),
                "[]",
                "list at least one priority class",
            );
            if let Some(d) = d {
                v.check(
                    !keys.by_digest.contains_key(&d),
                    &format!("keys[{i}]"),
                    "",
                    "the same key is listed twice",
                );
                keys.by_digest.insert(
                    d,
                    Grant {
                        tenant: e.tenant.clone(),
                        priorities: e.priorities.clone(),
                    },
                );
            }
        }
        v.finish()?;
        Ok(keys)
    }

    /// Adds keys from `KVGATE_API_KEYS`: `key=tenant[:class+class]`, comma-separated.
    pub fn add_env(&mut self, spec: &str) -> Result<(), ConfigError> {
        let mut errors = Vec::new();
        for (i, item) in spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .enumerate()
        {
            let err = |reason: &str| FieldError {
                field: format!("KVGATE_API_KEYS[{i}]"),
                value: "(hidden)".into(),
                reason: reason.into(),
            };
            let Some((key, rest)) = item.split_once('=') else {
                errors.push(err("must be key=tenant or key=tenant:interactive+batch"));
                continue;
            };
            let (tenant, classes) = rest.split_once(':').unwrap_or((rest, "interactive"));
            let priorities: Option<Vec<Priority>> =
                classes.split('+').map(Priority::parse).collect();
            match priorities {
                _ if key.len() < 16 => errors.push(err("a key has at least 16 characters")),
                _ if !valid_tenant(tenant) => errors.push(err("bad tenant name")),
                None => errors.push(err("priority classes are interactive and batch")),
                Some(p) => {
                    self.by_digest.insert(
                        digest(key),
                        Grant {
                            tenant: tenant.to_string(),
                            priorities: p,
                        },
                    );
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(errors))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_tenants_and_classes() {
        let hashed = key_digest_hex("sk-hashed-key-0123456789");
        let text = format!(
            "[[keys]]\nkey = \"sk-clear-key-0123456789\"\ntenant = \"acme\"\npriorities = [\"interactive\", \"batch\"]\n\
             [[keys]]\nkey_sha256 = \"{hashed}\"\ntenant = \"beta\"\n"
        );
        let k = ApiKeys::from_toml(&text).unwrap();
        let a = k.lookup("sk-clear-key-0123456789").unwrap();
        assert_eq!(a.tenant, "acme");
        assert!(a.allows(Priority::Batch));
        let b = k.lookup("sk-hashed-key-0123456789").unwrap();
        assert_eq!(b.tenant, "beta");
        assert!(!b.allows(Priority::Batch), "interactive only by default");
        assert!(k.lookup("sk-wrong").is_none());
        assert_eq!(k.tenants(), ["acme", "beta"]);
    }

    #[test]
    fn bad_entries_are_named() {
        let e = ApiKeys::from_toml(
            "[[keys]]\nkey = \"short\"\ntenant = \"a b\"\n[[keys]]\nkey_sha256 = \"xyz\"\ntenant = \"t\"\npriorities = []\n",
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "keys[0].key",
            "keys[0].tenant",
            "keys[1].key_sha256",
            "keys[1].priorities",
        ] {
            assert!(e.contains(needle), "{needle} in {e}");
        }
    }

    #[test]
    fn the_shipped_example_file_is_valid() {
        let text = include_str!("../api_keys.toml");
        let k = ApiKeys::from_toml(text).unwrap();
        assert_eq!(k.tenants(), ["acme", "beta"]);
        assert!(k.lookup("sk-example-only-replace-me-0001").is_some());
    }

    #[test]
    fn env_spec_adds_keys() {
        let mut k = ApiKeys::default();
        k.add_env("sk-env-key-00000000001=acme:interactive+batch, sk-env-key-00000000002=beta")
            .unwrap();
        assert!(k
            .lookup("sk-env-key-00000000001")
            .unwrap()
            .allows(Priority::Batch));
        assert!(!k
            .lookup("sk-env-key-00000000002")
            .unwrap()
            .allows(Priority::Batch));
        assert!(k.add_env("sk-env-key-00000000003=acme:urgent").is_err());
        assert!(k.add_env("nokey").is_err());
    }
}
