//! `GET /admin/policy`: the active policy as the operator reads it — every route with its
//! model, rules, pool, knobs in force, limits, promise and live use — and the last reload's
//! error.

use std::time::Duration;

use config::PolicyConfig;
use serde_json::{json, Value};

use super::PolicyStore;

impl PolicyStore {
    /// `GET /admin/policy`.
    pub fn describe(&self, replica_names: &[String]) -> Value {
        let a = self.load();
        let routes: Vec<Value> = a
            .routes
            .iter()
            .map(|r| {
                let ms = |d: Option<Duration>| d.map(|d| d.as_millis() as u64);
                json!({
                    "name": r.cfg.name,
                    "model": a.models.get(r.model).map(|(n, _)| n.clone()),
                    "rules": {
                        "min_prompt_tokens": r.cfg.min_prompt_tokens,
                        "priority": r.cfg.priority.map(|p| p.label()),
                    },
                    "pool": r.pool.iter().map(|&i| replica_names[i].clone()).collect::<Vec<_>>(),
                    "policy": r.policy.name(),
                    "policy_knobs": knobs(r.cfg.policy.as_ref().unwrap_or(&a.file.policy)),
                    "admission": r.cfg.admission,
                    "max_concurrency": r.cfg.max_concurrency,
                    "max_prompt_tokens_in_flight": r.cfg.max_prompt_tokens_in_flight,
                    "max_prompt_tokens": r.cfg.max_prompt_tokens,
                    "engine_priority": r.cfg.engine_priority,
                    "stream_idle_timeout_ms": r.cfg.stream_idle_timeout().as_millis() as u64,
                    "queue_size": r.cfg.queue_size,
                    "queue_timeout_ms": r.cfg.queue_timeout_ms,
                    "slo": {"ttft_ms": ms(r.slo.ttft), "itl_ms": ms(r.slo.itl)},
                    "in_flight": r.rt.in_flight(),
                    "in_flight_prompt_tokens": r.rt.in_flight_tokens(),
                    "queued": r.rt.queue.len(),
                    "goodput_ratio": r.rt.stats.tick(r.rt.now_s()),
                })
            })
            .collect();
        let err = self.last_error.lock().clone();
        json!({
            "version": a.version,
            "generation": a.generation,
            "loaded_at_unix": a.loaded_at_unix,
            "source": self.path.as_ref().map(|p| p.display().to_string()),
            "kv_high_water": a.file.kv_high_water,
            "preemption_holdoff_ms": a.file.preemption_holdoff_ms,
            "admission_headroom": a.file.admission_headroom,
            "prefix_in_flight_wait_ms": a.file.prefix_in_flight_wait_ms,
            "hit_signals": format!("{:?}", a.file.hit_signals).to_lowercase(),
            "cache_groups": a.file.cache_groups,
            "default_policy": a.file.policy.kind(),
            "default_policy_knobs": knobs(&a.file.policy),
            "routes": routes,
            "last_error": err.map(|e| json!({
                "at_unix": e.at_unix,
                "message": e.message,
                "fields": e.fields.iter().map(|f| json!({"field": f.field, "value": f.value, "reason": f.reason})).collect::<Vec<_>>(),
            })),
        })
    }
}

/// A policy's every parameter as in force — the file's values with the defaults filled in, and
/// `prefix_aware`'s count guard as it applies under its cost — for `GET /admin/policy`.
fn knobs(p: &PolicyConfig) -> Value {
    let mut v = serde_json::to_value(p).unwrap_or_default();
    if let (PolicyConfig::PrefixAware(c), Some(o)) = (p, v.as_object_mut()) {
        o.insert("balance_abs_threshold".into(), json!(c.abs_threshold()));
    }
    v
}
