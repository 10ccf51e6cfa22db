//! The replica's Prometheus metrics: the four timers (queue, prefill, TTFT, inter-token) as
//! histograms, the four gauges (KV cache usage, requests waiting and running, preemptions,
//! prefix-cache queries and hits in tokens), batch size, token throughput and the engine's own
//! CPU time per step. Each replica owns its recorder (through the `metrics` facade's `Recorder`
//! trait) rather than the process-global one, so several replicas in one process — tests, `kvgate
//! up` in-process — never mix their numbers. Handles are registered once; recording on the hot
//! path is an atomic update.

use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Label, Level, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

const TIMER_BUCKETS: [f64; 20] = [
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
];
const CPU_BUCKETS: [f64; 12] = [
    1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
];
const BATCH_BUCKETS: [f64; 12] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0,
];

pub struct ReplicaMetrics {
    handle: PrometheusHandle,
    pub queue_seconds: Histogram,
    pub prefill_seconds: Histogram,
    pub ttft_seconds: Histogram,
    pub inter_token_seconds: Histogram,
    pub e2e_seconds: Histogram,
    pub step_seconds: Histogram,
    pub step_cpu_seconds: Histogram,
    pub batch_size: Histogram,
    pub kv_cache_usage: Gauge,
    pub cached_blocks: Gauge,
    pub requests_waiting: Gauge,
    pub requests_running: Gauge,
    pub tokens_per_second: Gauge,
    pub preemptions: Counter,
    pub prefix_waits: Counter,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub finished_stop: Counter,
    pub finished_length: Counter,
    pub finished_abort: Counter,
}

static META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

impl ReplicaMetrics {
    pub fn new(replica_id: &str) -> Self {
        let recorder = PrometheusBuilder::new()
            .add_global_label("replica", replica_id)
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &TIMER_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full("kvgate_replica_step_cpu_seconds".into()),
                    &CPU_BUCKETS,
                )
            })
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full("kvgate_replica_batch_size".into()),
                    &BATCH_BUCKETS,
                )
            })
            .expect("bucket lists are non-empty")
            .build_recorder();
        let handle = recorder.handle();
        let h = |name: &'static str, unit: Unit, help: &'static str| -> Histogram {
            recorder.describe_histogram(KeyName::from(name), Some(unit), SharedString::from(help));
            recorder.register_histogram(&Key::from_name(name), &META)
        };
        let g = |name: &'static str, help: &'static str| -> Gauge {
            recorder.describe_gauge(KeyName::from(name), None, SharedString::from(help));
            recorder.register_gauge(&Key::from_name(name), &META)
        };
        let c = |name: &'static str, help: &'static str| -> Counter {
            recorder.describe_counter(KeyName::from(name), None, SharedString::from(help));
            recorder.register_counter(&Key::from_name(name), &META)
        };
        let finished = |reason: &'static str| -> Counter {
            recorder.register_counter(
                &Key::from_parts(
                    "kvgate_replica_requests_finished_total",
                    vec![Label::new("reason", reason)],
                ),
                &META,
            )
        };
        recorder.describe_counter(
            KeyName::from("kvgate_replica_requests_finished_total"),
            None,
            SharedString::from("Requests finished, by reason (stop, length, abort)"),
        );
        ReplicaMetrics {
            queue_seconds: h(
                "kvgate_replica_queue_seconds",
                Unit::Seconds,
                "Arrival to first scheduled step",
            ),
            prefill_seconds: h(
                "kvgate_replica_prefill_seconds",
                Unit::Seconds,
                "First scheduled step to first token",
            ),
            ttft_seconds: h(
                "kvgate_replica_ttft_seconds",
                Unit::Seconds,
                "Arrival to first token",
            ),
            inter_token_seconds: h(
                "kvgate_replica_inter_token_seconds",
                Unit::Seconds,
                "Gap between consecutive tokens of a sequence",
            ),
            e2e_seconds: h(
                "kvgate_replica_e2e_seconds",
                Unit::Seconds,
                "Arrival to last token",
            ),
            step_seconds: h(
                "kvgate_replica_step_seconds",
                Unit::Seconds,
                "Engine step duration (modelled for sim)",
            ),
            step_cpu_seconds: h(
                "kvgate_replica_step_cpu_seconds",
                Unit::Seconds,
                "Scheduler and bookkeeping CPU time per step",
            ),
            batch_size: h(
                "kvgate_replica_batch_size",
                Unit::Count,
                "Sequences per engine step",
            ),
            kv_cache_usage: g(
                "kvgate_replica_kv_cache_usage_ratio",
                "Fraction of KV blocks in use by running sequences",
            ),
            cached_blocks: g(
                "kvgate_replica_prefix_cache_blocks",
                "KV blocks holding a cached prefix block",
            ),
            requests_waiting: g(
                "kvgate_replica_requests_waiting",
                "Requests queued for their first step",
            ),
            requests_running: g(
                "kvgate_replica_requests_running",
                "Requests in the running batch",
            ),
            tokens_per_second: g(
                "kvgate_replica_generation_tokens_per_second",
                "Generated tokens per second over the last second",
            ),
            preemptions: c(
                "kvgate_replica_preemptions_total",
                "Sequences preempted (recompute) for lack of KV blocks",
            ),
            prefix_waits: c(
                "kvgate_replica_prefix_waits_total",
                "Requests that waited for a prompt prefix another request was computing, instead of computing it again beside it",
            ),
            prefix_queries: c(
                "kvgate_replica_prefix_cache_queries_tokens_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_hits: c(
                "kvgate_replica_prefix_cache_hits_tokens_total",
                "Prompt tokens found in the prefix cache",
            ),
            prompt_tokens: c(
                "kvgate_replica_prompt_tokens_total",
                "Prompt tokens of admitted requests",
            ),
            generation_tokens: c("kvgate_replica_generation_tokens_total", "Generated tokens"),
            finished_stop: finished("stop"),
            finished_length: finished("length"),
            finished_abort: finished("abort"),
            handle,
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Drains histogram samples into their buckets; called periodically so memory stays bounded
    /// between scrapes.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    pub fn observe(h: &Histogram, d: Duration) {
        h.record(d.as_secs_f64());
    }
}
