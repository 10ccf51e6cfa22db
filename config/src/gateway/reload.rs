//! What a reload of the gateway file can apply while running, and what it cannot.
//!
//! The running gateway re-reads its file on SIGHUP, when the file changes, and on
//! `POST /admin/replicas/reload`. It applies the replica list, the engines, the discovery
//! names and the models (`[model]` / `[[models]]`); every other section is fixed at start. [`GatewayConfig::needs_restart`] names the
//! sections in which a re-read file differs from the configuration in force, so the operator
//! hears that an edit was not applied instead of finding out later.

use std::path::Path;

use super::GatewayConfig;

impl GatewayConfig {
    /// Resolves the file paths the gateway file names (the policy file, the key and token
    /// files) against `dir`, the gateway file's folder.
    pub fn resolve_paths(&mut self, dir: &Path) {
        let rel = |p: &Option<String>| p.as_ref().map(|p| dir.join(p).display().to_string());
        self.policy_file = rel(&self.policy_file);
        self.auth.api_keys_file = rel(&self.auth.api_keys_file);
        self.auth.admin_token_file = rel(&self.auth.admin_token_file);
        self.auth.fleet_token_file = rel(&self.auth.fleet_token_file);
        self.batch.path = rel(&self.batch.path);
    }

    /// The sections (as the file names them) in which `next` differs from `self` and that a
    /// reload does not apply: the replica list, the engines, the discovery names and the
    /// models reload; everything else needs a restart.
    pub fn needs_restart(&self, next: &GatewayConfig) -> Vec<&'static str> {
        let mut out = Vec::new();
        // Each section by its field, named as the file names it.
        macro_rules! compare {
            ($($field:ident),*) => {
                $(if self.$field != next.$field {
                    out.push(stringify!($field));
                })*
            };
        }
        compare!(listen, admin_listen);
        let (mut a, mut b) = (self.discovery.clone(), next.discovery.clone());
        a.dns.clear();
        b.dns.clear();
        if a != b {
            out.push("discovery");
        }
        compare!(
            peers,
            cost,
            drift,
            batch,
            session_header,
            health,
            index,
            upstream,
            downstream,
            auth,
            access_log,
            policy,
            policy_file
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> GatewayConfig {
        let mut c = GatewayConfig::from_toml(text).unwrap();
        c.resolve_paths(Path::new("/etc/kvgate"));
        c
    }

    #[test]
    fn a_new_replica_list_needs_no_restart_and_other_sections_are_named() {
        let running = parse("replicas = [\"a:1\"]\npolicy_file = \"policy.toml\"\n");
        assert_eq!(
            running.policy_file.as_deref(),
            Some("/etc/kvgate/policy.toml")
        );
        let relisted = parse(
            "replicas = [\"a:1\", \"b:1\"]\npolicy_file = \"policy.toml\"\n\
             [discovery]\ndns = [\"fleet:8000\"]\n",
        );
        assert!(running.needs_restart(&relisted).is_empty());
        let edited = parse(
            "replicas = [\"a:1\"]\npolicy_file = \"other.toml\"\n\
             [model]\nblock_size = 32\n[upstream]\nretries = 7\n",
        );
        assert_eq!(
            running.needs_restart(&edited),
            vec!["upstream", "policy_file"]
        );
    }
}
