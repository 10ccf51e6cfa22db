//! The gateway file's rules: [`GatewayConfig::validate`] checks every field of a parsed file
//! and reports all the problems at once (`field / value / reason`), then hands the `[policy]`
//! table to its own validation. The replica list's rules live in [`crate::fleet`], which the
//! admin API's `PUT /admin/replicas` shares.

use crate::error::{ConfigError, Validator};
use crate::fleet::{check_replicas, is_host_port, is_zmq_tcp};
use crate::gateway::GatewayConfig;

impl GatewayConfig {
    /// Checks every field and reports all the problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut v = Validator::new();
        for (field, addr) in [
            ("listen", &self.listen),
            ("admin_listen", &self.admin_listen),
        ] {
            // host:port with a port the OS can bind (0 picks a free one); [v6]:port too.
            let ok = addr.rsplit_once(':').is_some_and(|(h, p)| {
                !h.is_empty() && !h.contains('/') && p.parse::<u16>().is_ok()
            });
            v.check(
                ok,
                field,
                format!("{addr:?}"),
                "must be host:port, e.g. \"127.0.0.1:8080\"",
            );
        }
        if self.discovery.dns.is_empty() || !self.replicas.is_empty() {
            check_replicas(&self.replicas, &mut v);
        }
        for e in &self.engines {
            for (field, endpoint) in [("kv_events", &e.kv_events), ("kv_replay", &e.kv_replay)] {
                if let Some(ep) = endpoint {
                    v.check(
                        is_zmq_tcp(ep),
                        &format!("replicas[{}].{field}", e.addr),
                        format!("{ep:?}"),
                        "must be tcp://host:port with the engine's host (the engine binds tcp://*:PORT; the gateway connects to it by name or address)",
                    );
                }
            }
            v.check(
                e.kv_replay.is_none() || e.kv_events.is_some(),
                &format!("replicas[{}].kv_replay", e.addr),
                "set",
                "needs kv_events (the replay socket only fills gaps in that stream)",
            );
        }
        for (i, name) in self.discovery.dns.iter().enumerate() {
            v.check(
                is_host_port(name),
                &format!("discovery.dns[{i}]"),
                format!("{name:?}"),
                "must be name:port, e.g. \"replicas.kvgate.svc.cluster.local:8000\"",
            );
        }
        v.check(
            self.discovery.kv_replay_port.is_none() || self.discovery.kv_events_port.is_some(),
            "discovery.kv_replay_port",
            "set",
            "needs discovery.kv_events_port (the replay socket only fills gaps in that stream)",
        );
        v.check(
            (1..=3600).contains(&self.discovery.every_s),
            "discovery.every_s",
            self.discovery.every_s,
            "must be between 1 and 3600 seconds",
        );
        self.peers.check(&mut v);
        self.cost.check(&mut v);
        self.batch.check(&mut v);
        self.drift.check(&mut v, &self.access_log.path);
        self.check_models(&mut v);
        let d = &self.downstream;
        for (field, value, min) in [
            ("downstream.header_timeout_ms", d.header_timeout_ms, 100),
            ("downstream.body_timeout_ms", d.body_timeout_ms, 100),
            (
                "downstream.tokenize_queue_max",
                d.tokenize_queue_max as u64,
                1,
            ),
            (
                "downstream.tokenize_queue_max_mib",
                d.tokenize_queue_max_mib as u64,
                1,
            ),
        ] {
            v.check(
                value >= min,
                field,
                value,
                &format!("must be at least {min}"),
            );
        }
        v.check(
            (1024..=1 << 20).contains(&d.max_header_bytes),
            "downstream.max_header_bytes",
            d.max_header_bytes,
            "must be between 1024 and 1048576",
        );
        v.check(
            (8..=256).contains(&d.max_headers),
            "downstream.max_headers",
            d.max_headers,
            "must be between 8 and 256",
        );
        v.check(
            d.max_connections >= 1,
            "downstream.max_connections",
            d.max_connections,
            "must be at least 1",
        );
        v.check(
            d.max_request_prompt_tokens >= 1,
            "downstream.max_request_prompt_tokens",
            d.max_request_prompt_tokens,
            "must be at least 1",
        );
        v.check(
            (0.0..=1.0).contains(&self.access_log.sample),
            "access_log.sample",
            self.access_log.sample,
            "must be between 0 and 1",
        );
        v.check(
            self.health.interval_ms >= 10,
            "health.interval_ms",
            self.health.interval_ms,
            "must be at least 10",
        );
        v.check(
            self.health.failures_to_eject >= 1,
            "health.failures_to_eject",
            self.health.failures_to_eject,
            "must be at least 1",
        );
        v.check(
            self.health.successes_to_readmit >= 1,
            "health.successes_to_readmit",
            self.health.successes_to_readmit,
            "must be at least 1",
        );
        v.check(
            self.upstream.max_body_bytes >= 1024,
            "upstream.max_body_bytes",
            self.upstream.max_body_bytes,
            "must be at least 1024",
        );
        v.check(
            self.upstream.retries <= 8,
            "upstream.retries",
            self.upstream.retries,
            "must be at most 8",
        );
        v.check(
            self.health.outlier_consecutive_errors >= 1,
            "health.outlier_consecutive_errors",
            self.health.outlier_consecutive_errors,
            "must be at least 1",
        );
        v.check(
            self.health.outlier_ejection_ms >= 100
                && self.health.outlier_max_ejection_ms >= self.health.outlier_ejection_ms,
            "health.outlier_ejection_ms",
            self.health.outlier_ejection_ms,
            "must be at least 100 and at most health.outlier_max_ejection_ms",
        );
        v.check(
            self.health.outlier_max_ejected_percent <= 100,
            "health.outlier_max_ejected_percent",
            self.health.outlier_max_ejected_percent,
            "must be at most 100",
        );
        v.check(
            self.upstream.body_idle_timeout_ms >= 100,
            "upstream.body_idle_timeout_ms",
            self.upstream.body_idle_timeout_ms,
            "must be at least 100",
        );
        v.check(
            self.upstream.max_response_bytes >= 4096,
            "upstream.max_response_bytes",
            self.upstream.max_response_bytes,
            "must be at least 4096",
        );
        v.check(
            self.upstream.max_stream_bytes >= 4096,
            "upstream.max_stream_bytes",
            self.upstream.max_stream_bytes,
            "must be at least 4096",
        );
        v.check(
            self.index.max_blocks_per_replica >= 1024,
            "index.max_blocks_per_replica",
            self.index.max_blocks_per_replica,
            "must be at least 1024",
        );
        v.check(
            self.upstream.load_poll_ms >= 10,
            "upstream.load_poll_ms",
            self.upstream.load_poll_ms,
            "must be at least 10",
        );
        v.finish()?;
        self.policy.validate("policy")
    }
}
