//! `[batch]`: the OpenAI Batch API on the gateway (`/v1/files`, `/v1/batches`), run on the
//! fleet's spare capacity and kept in an embedded SQLite database so a restart resumes it.
//!
//! ```toml
//! [batch]
//! path = "/var/lib/kvgate/batch.sqlite3"  # the database; unset: the Batch API is off
//! max_file_mib = 200             # largest upload
//! max_lines = 50000              # lines in one input file
//! max_jobs_per_tenant = 16       # batches a tenant may have unfinished at once
//! max_disk_mib = 10240           # the database's size past which uploads are refused
//! retention_h = 168              # finished batches and their files are deleted after this
//! headroom = 0.7                 # a replica takes batch lines while its interactive signals
//!                                # stay under this share of the promise (see DESIGN)
//! max_per_replica = 8            # batch lines running on an idle replica at once (fewer
//!                                # as its KV usage or stall share nears the headroom)
//! max_in_flight = 0              # batch lines this gateway runs at once; 0: max_per_replica
//!                                # per healthy replica
//! lease_s = 30                   # several gateways on one database: a batch is run by one
//!                                # of them at a time, taken over when its lease runs out
//! node_id = "gw-1"               # this gateway's name in the leases, unique per gateway
//!                                # (default: host and the API address, so a gateway
//!                                # restarted in place takes its jobs back)
//! ```

use serde::Deserialize;

use crate::error::Validator;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// The SQLite database holding files, jobs, lines and results. Unset: the API is off.
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default = "default_file_mib")]
    pub max_file_mib: u64,
    #[serde(default = "default_lines")]
    pub max_lines: usize,
    #[serde(default = "default_jobs")]
    pub max_jobs_per_tenant: usize,
    #[serde(default = "default_disk_mib")]
    pub max_disk_mib: u64,
    #[serde(default = "default_retention_h")]
    pub retention_h: u64,
    /// Share (0–1] of each interactive promise (and of the KV high-water mark) a replica's
    /// predicted signals must stay under for it to take a new batch line.
    #[serde(default = "default_headroom")]
    pub headroom: f64,
    /// Batch lines running on an idle replica at once; fewer as its KV usage or stall share
    /// nears `headroom` (`batch/trough.rs`, `line_cap`). A flat 16 put the interactive p95
    /// TTFT at 2.5–7× its batch-free value on the bench's L4 fleet, 4 at 1.2× (BENCHMARKS).
    #[serde(default = "default_per_replica")]
    pub max_per_replica: usize,
    /// Batch lines this gateway runs at once; 0: `max_per_replica` per healthy replica.
    #[serde(default)]
    pub max_in_flight: usize,
    /// Seconds a gateway's claim on a batch lasts unless renewed (every third of it).
    #[serde(default = "default_lease")]
    pub lease_s: u64,
    /// This gateway's name in the leases, unique per gateway: two gateways with one name
    /// would both run each batch (default: the host name and the API address).
    #[serde(default)]
    pub node_id: Option<String>,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            path: None,
            max_file_mib: default_file_mib(),
            max_lines: default_lines(),
            max_jobs_per_tenant: default_jobs(),
            max_disk_mib: default_disk_mib(),
            retention_h: default_retention_h(),
            headroom: default_headroom(),
            max_per_replica: default_per_replica(),
            max_in_flight: 0,
            lease_s: default_lease(),
            node_id: None,
        }
    }
}

impl BatchConfig {
    pub fn enabled(&self) -> bool {
        self.path.is_some()
    }

    pub(crate) fn check(&self, v: &mut Validator) {
        if let Some(p) = &self.path {
            v.check(
                !p.trim().is_empty(),
                "batch.path",
                "\"\"",
                "must name a file",
            );
        }
        v.check(
            (1..=4096).contains(&self.max_file_mib),
            "batch.max_file_mib",
            self.max_file_mib,
            "must be between 1 and 4096",
        );
        v.check(
            (1..=1_000_000).contains(&self.max_lines),
            "batch.max_lines",
            self.max_lines,
            "must be between 1 and 1000000",
        );
        v.check(
            self.max_jobs_per_tenant >= 1,
            "batch.max_jobs_per_tenant",
            self.max_jobs_per_tenant,
            "must be at least 1",
        );
        v.check(
            self.max_disk_mib >= self.max_file_mib,
            "batch.max_disk_mib",
            self.max_disk_mib,
            "must be at least batch.max_file_mib (one upload must fit)",
        );
        v.check(
            self.retention_h >= 1,
            "batch.retention_h",
            self.retention_h,
            "must be at least 1 hour",
        );
        v.check(
            (1..=3600).contains(&self.lease_s),
            "batch.lease_s",
            self.lease_s,
            "must be between 1 and 3600 seconds",
        );
        v.check(
            (1..=1024).contains(&self.max_per_replica),
            "batch.max_per_replica",
            self.max_per_replica,
            "must be between 1 and 1024",
        );
        v.check(
            self.headroom > 0.0 && self.headroom <= 1.0,
            "batch.headroom",
            self.headroom,
            "must be in (0, 1]: the share of the promise batch work may fill up to",
        );
    }
}

fn default_file_mib() -> u64 {
    200
}
fn default_lines() -> usize {
    50_000
}
fn default_jobs() -> usize {
    16
}
fn default_disk_mib() -> u64 {
    10_240
}
fn default_retention_h() -> u64 {
    168
}
fn default_lease() -> u64 {
    30
}
fn default_headroom() -> f64 {
    0.7
}
fn default_per_replica() -> usize {
    8
}

#[cfg(test)]
mod tests {
    use crate::GatewayConfig;

    #[test]
    fn the_batch_api_is_off_until_a_database_is_named() {
        let c = GatewayConfig::from_toml("replicas = [\"a:1\"]").unwrap();
        assert!(!c.batch.enabled());
        let c = GatewayConfig::from_toml("replicas = [\"a:1\"]\n[batch]\npath = \"b.sqlite3\"")
            .unwrap();
        assert!(c.batch.enabled());
        assert_eq!(c.batch.max_lines, 50_000);
        let e = GatewayConfig::from_toml(
            "replicas = [\"a:1\"]\n[batch]\nheadroom = 0\nmax_disk_mib = 1\nmax_file_mib = 2",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("batch.headroom"), "{e}");
        assert!(e.contains("batch.max_disk_mib"), "{e}");
    }
}
