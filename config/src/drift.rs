//! `[drift]`: the gateway's checks that its tokenizer and chat template are the engine's (the
//! runbook's failure that produces no error), beyond the count every answer's usage allows.
//!
//! ```toml
//! [drift]
//! token_id_share = 0.02        # share of requests whose token ids are compared with the
//!                              # engine's own (its /tokenize: kvgate replicas, vLLM); 0: off
//! prompt_sample_share = 0.0    # share of rendered prompts written to prompt_sample_path
//! prompt_sample_path = "/var/log/kvgate/prompts.jsonl"
//! ```
//!
//! Rendered prompts are users' text: the sample file is off by default, is a file of its own
//! (never the access log), and its lines carry no tenant, key, session or request id, so it
//! cannot be joined with the access log's tenants.

use serde::Deserialize;

use crate::error::Validator;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriftConfig {
    /// Share of requests (0–1) whose prompt token ids are compared with the engine's.
    #[serde(default = "default_id_share")]
    pub token_id_share: f64,
    /// Share of requests (0–1) whose rendered prompt is written to `prompt_sample_path`.
    #[serde(default)]
    pub prompt_sample_share: f64,
    /// JSON-lines file the sampled rendered prompts are appended to (sensitive).
    #[serde(default)]
    pub prompt_sample_path: Option<String>,
}

impl Default for DriftConfig {
    fn default() -> Self {
        DriftConfig {
            token_id_share: default_id_share(),
            prompt_sample_share: 0.0,
            prompt_sample_path: None,
        }
    }
}

fn default_id_share() -> f64 {
    0.02
}

impl DriftConfig {
    pub(crate) fn check(&self, v: &mut Validator, access_log_path: &str) {
        for (field, x) in [
            ("drift.token_id_share", self.token_id_share),
            ("drift.prompt_sample_share", self.prompt_sample_share),
        ] {
            v.check(
                (0.0..=1.0).contains(&x),
                field,
                x,
                "must be a share between 0 and 1",
            );
        }
        if self.prompt_sample_share > 0.0 {
            match self.prompt_sample_path.as_deref() {
                None | Some("") => v.check(
                    false,
                    "drift.prompt_sample_path",
                    "(unset)",
                    "must name a file when drift.prompt_sample_share is above 0",
                ),
                Some(p) => v.check(
                    p != "-"
                        && !p.starts_with("/dev/")
                        && !p.starts_with("/proc/")
                        && !same_file(p, access_log_path),
                    "drift.prompt_sample_path",
                    format!("{p:?}"),
                    "must be a file of its own: not standard output or a device, not the \
                     access log (rendered prompts never sit beside tenant ids)",
                ),
            }
        }
    }
}

/// Whether two paths name the same file: equal as written, or equal once their folders are
/// resolved (`/var/log/./a` and `/var/log/a`, links included).
fn same_file(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    let resolve = |p: &str| {
        let p = std::path::Path::new(p);
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        Some(std::fs::canonicalize(dir).ok()?.join(p.file_name()?))
    };
    matches!((resolve(a), resolve(b)), (Some(x), Some(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use crate::gateway::GatewayConfig;

    #[test]
    fn rendered_prompts_never_share_the_access_logs_file() {
        let mut c = GatewayConfig::with_replicas(vec!["127.0.0.1:8001".into()]);
        c.drift.prompt_sample_share = 0.1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("drift.prompt_sample_path"), "{e}");
        c.access_log.path = "/var/log/kvgate/access.jsonl".into();
        c.drift.prompt_sample_path = Some(c.access_log.path.clone());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not the access log"), "{e}");
        c.drift.prompt_sample_path = Some("-".into());
        assert!(c.validate().is_err());
        c.drift.prompt_sample_path = Some("/dev/stdout".into());
        assert!(c.validate().is_err());
        let tmp = std::env::temp_dir().display().to_string();
        c.access_log.path = format!("{tmp}/kvgate-access.jsonl");
        c.drift.prompt_sample_path = Some(format!("{tmp}/./kvgate-access.jsonl"));
        assert!(c.validate().is_err(), "the same file spelt differently");
        c.drift.prompt_sample_path = Some("/var/log/kvgate/prompts.jsonl".into());
        c.validate().unwrap();
        c.drift.token_id_share = 1.5;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("drift.token_id_share"), "{e}");
    }
}
