//! The gateway's Prometheus metrics (`kvgate_gateway_*`): requests by endpoint and status, the
//! timers as the gateway sees them (queue, TTFT, inter-token and end-to-end per policy route —
//! see `routes/goodput.rs` — plus tokenise and routing decision), policy reloads,
//! decisions by policy and reason, the *predicted* prefix hit ratio per replica (prompt tokens
//! routed and tokens the index expected cached there, beside the replicas' actual counters),
//! replica health and the prefix index's size. Like the replica, the gateway owns its recorder.

mod help;

use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Label, Level, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

static META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

const TIMER_BUCKETS: [f64; 22] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// One served model's prompt-token counters ([`GatewayMetrics::model_tokens`]).
#[derive(Clone)]
pub struct ModelTokens {
    pub prompt: Counter,
    pub predicted_hit: Counter,
}

pub struct ReplicaMetrics {
    pub healthy: Gauge,
    pub prompt_tokens: Counter,
    pub predicted_hit_tokens: Counter,
    pub in_flight: Gauge,
    /// 0 while the replica should publish KV events and they do not keep the index exact
    /// (not connected, or an error keeps them out); 1 otherwise.
    pub kv_events_live: Gauge,
    /// Observed ÷ predicted time to first token of the requests placed there.
    pub ttft_prediction_ratio: Histogram,
    /// Answers whose `usage.prompt_tokens` matched the gateway's count, and those that did not.
    pub prompt_checks: [Counter; 2],
    /// Sampled prompts whose token ids matched the engine's `/tokenize`, and those that did not.
    pub prompt_id_checks: [Counter; 2],
    /// Share of the last minute with work in its batch.
    pub busy_share: Gauge,
    /// Model FLOPs utilisation over the last minute (replicas that report their FLOPs).
    pub mfu: Gauge,
}

/// Buckets of observed ÷ predicted TTFT: 1 is a perfect prediction.
const RATIO_BUCKETS: [f64; 13] = [
    0.125, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0,
];

pub struct GatewayMetrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    pub tokenize_seconds: Histogram,
    pub route_seconds: Histogram,
    pub index_blocks: Gauge,
    pub index_bytes: Gauge,
    /// Token ids the tokeniser's segment cache holds (its byte budget's measure).
    pub tokenizer_cache_bytes: Gauge,
    pub retries: Counter,
    pub policy_generation: Gauge,
    pub policy_last_reload_ok: Gauge,
    /// Accepted, rejected.
    policy_reloads: [Counter; 2],
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl GatewayMetrics {
    pub fn new() -> Self {
        let m = Self::unregistered();
        // Every bounded label set exists at 0 from the start, so alerts and dashboards see the
        // series before the first incident.
        for (name, key, values) in [
            (
                "kvgate_gateway_stream_errors_total",
                "reason",
                &["upstream_error", "idle_timeout", "replica_ejected", "drain"][..],
            ),
            (
                "kvgate_gateway_auth_failures_total",
                "port",
                &["api", "admin"][..],
            ),
            (
                "kvgate_gateway_prompts_refused_total",
                "stage",
                &["bytes", "pieces", "exact"][..],
            ),
            (
                "kvgate_gateway_connections_closed_total",
                "reason",
                &["header_timeout", "header_too_large", "body_timeout"][..],
            ),
            (
                "kvgate_gateway_prompt_samples_total",
                "result",
                &["written", "dropped"][..],
            ),
        ] {
            for v in values {
                let _ = m.counter(name, &[(key, *v)]);
            }
        }
        m
    }

    fn unregistered() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &TIMER_BUCKETS)
            .expect("bucket list is non-empty")
            .set_buckets_for_metric(Matcher::Suffix("_ratio".into()), &RATIO_BUCKETS)
            .expect("bucket list is non-empty")
            .build_recorder();
        let handle = recorder.handle();
        let h = |name: &'static str, help: &'static str| -> Histogram {
            recorder.describe_histogram(
                KeyName::from(name),
                Some(Unit::Seconds),
                SharedString::from(help),
            );
            recorder.register_histogram(&Key::from_name(name), &META)
        };
        help::describe(&recorder);
        GatewayMetrics {
            tokenize_seconds: h(
                "kvgate_gateway_tokenize_seconds",
                "Render and tokenise the prompt",
            ),
            route_seconds: h(
                "kvgate_gateway_route_seconds",
                "Whole routing decision: parse, tokenise, hash, match, score",
            ),
            index_blocks: recorder
                .register_gauge(&Key::from_name("kvgate_gateway_prefix_index_blocks"), &META),
            index_bytes: recorder
                .register_gauge(&Key::from_name("kvgate_gateway_prefix_index_bytes"), &META),
            tokenizer_cache_bytes: recorder.register_gauge(
                &Key::from_name("kvgate_gateway_tokenizer_cache_bytes"),
                &META,
            ),
            retries: recorder
                .register_counter(&Key::from_name("kvgate_gateway_retries_total"), &META),
            policy_generation: recorder
                .register_gauge(&Key::from_name("kvgate_gateway_policy_generation"), &META),
            policy_reloads: [true, false].map(|ok| {
                recorder.register_counter(
                    &Key::from_parts(
                        "kvgate_gateway_policy_reloads_total",
                        vec![Label::new("result", if ok { "ok" } else { "rejected" })],
                    ),
                    &META,
                )
            }),
            policy_last_reload_ok: recorder.register_gauge(
                &Key::from_name("kvgate_gateway_policy_last_reload_ok"),
                &META,
            ),
            recorder,
            handle,
        }
    }

    /// The handles of one replica's series: `replica` is its identity (the id it reports, the
    /// same label its own metrics carry, or its address when it reports none), `address` the
    /// `host:port` the gateway knows it by.
    pub fn replica(&self, label: &str, address: &str) -> ReplicaMetrics {
        let r = &self.recorder;
        let l = || {
            vec![
                Label::new("replica", label.to_string()),
                Label::new("address", address.to_string()),
            ]
        };
        // A check's counters by result: match, mismatch.
        let results = |name: &'static str| {
            ["match", "mismatch"].map(|result| {
                let mut labels = l();
                labels.push(Label::new("result", result));
                r.register_counter(&Key::from_parts(name, labels), &META)
            })
        };
        ReplicaMetrics {
            healthy: r.register_gauge(
                &Key::from_parts("kvgate_gateway_replica_healthy", l()),
                &META,
            ),
            prompt_tokens: r.register_counter(
                &Key::from_parts("kvgate_gateway_prompt_tokens_total", l()),
                &META,
            ),
            ttft_prediction_ratio: r.register_histogram(
                &Key::from_parts("kvgate_gateway_ttft_prediction_ratio", l()),
                &META,
            ),
            predicted_hit_tokens: r.register_counter(
                &Key::from_parts("kvgate_gateway_predicted_hit_tokens_total", l()),
                &META,
            ),
            in_flight: r.register_gauge(
                &Key::from_parts("kvgate_gateway_replica_in_flight", l()),
                &META,
            ),
            kv_events_live: r.register_gauge(
                &Key::from_parts("kvgate_gateway_replica_kv_events_live", l()),
                &META,
            ),
            prompt_checks: results("kvgate_gateway_prompt_token_checks_total"),
            busy_share: r.register_gauge(
                &Key::from_parts("kvgate_gateway_replica_busy_share", l()),
                &META,
            ),
            mfu: r.register_gauge(&Key::from_parts("kvgate_gateway_replica_mfu", l()), &META),
            prompt_id_checks: results("kvgate_gateway_prompt_token_id_checks_total"),
        }
    }

    /// A counter of one replica (its label and address, as its other series carry them).
    pub fn replica_counter(
        &self,
        name: &'static str,
        label: &str,
        address: &str,
        extra: &[(&'static str, &'static str)],
    ) -> Counter {
        let mut labels = vec![
            Label::new("replica", label.to_string()),
            Label::new("address", address.to_string()),
        ];
        labels.extend(extra.iter().map(|(k, v)| Label::new(*k, *v)));
        self.recorder
            .register_counter(&Key::from_parts(name, labels), &META)
    }

    pub fn request(&self, endpoint: &'static str, status: u16) {
        self.recorder
            .register_counter(
                &Key::from_parts(
                    "kvgate_gateway_requests_total",
                    vec![
                        Label::new("endpoint", endpoint),
                        Label::new("status", status.to_string()),
                    ],
                ),
                &META,
            )
            .increment(1);
    }

    /// Counts a request refused for its credentials on `port` (`api` or `admin`).
    pub fn auth_failed(&self, port: &'static str) {
        self.counter("kvgate_gateway_auth_failures_total", &[("port", port)])
            .increment(1);
    }

    /// A counter with fixed, bounded labels.
    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &'static str)]) -> Counter {
        self.recorder.register_counter(
            &Key::from_parts(
                name,
                labels
                    .iter()
                    .map(|(k, v)| Label::new(*k, *v))
                    .collect::<Vec<_>>(),
            ),
            &META,
        )
    }

    pub fn gauge(&self, name: &'static str) -> Gauge {
        self.recorder.register_gauge(&Key::from_name(name), &META)
    }

    /// A gauge with fixed, bounded labels.
    pub fn gauge_with(&self, name: &'static str, labels: &[(&'static str, &'static str)]) -> Gauge {
        let labels: Vec<Label> = labels.iter().map(|(k, v)| Label::new(*k, *v)).collect();
        self.recorder
            .register_gauge(&Key::from_parts(name, labels), &META)
    }

    /// `kvgate_gateway_discovered_replicas{name}`: how many addresses a discovery name resolves
    /// to (names come from the gateway file, so the label is bounded).
    pub fn discovered(&self, name: &str) -> Gauge {
        let key = Key::from_parts(
            "kvgate_gateway_discovered_replicas",
            vec![Label::new("name", name.to_string())],
        );
        self.recorder.register_gauge(&key, &META)
    }

    pub fn decision(&self, policy: &'static str, reason: &'static str) {
        self.recorder
            .register_counter(
                &Key::from_parts(
                    "kvgate_gateway_decisions_total",
                    vec![Label::new("policy", policy), Label::new("reason", reason)],
                ),
                &META,
            )
            .increment(1);
    }

    /// A route's series: labelled `route`, and `model` too when the gateway serves several
    /// (their runtimes are keyed `model/route`; a route's own name has no `/`).
    fn route_key(name: &'static str, route: &str, extra: &[(&'static str, &'static str)]) -> Key {
        let mut labels = match route.rsplit_once('/') {
            Some((model, route)) => vec![
                Label::new("route", route.to_string()),
                Label::new("model", model.to_string()),
            ],
            None => vec![Label::new("route", route.to_string())],
        };
        labels.extend(extra.iter().map(|(k, v)| Label::new(*k, *v)));
        Key::from_parts(name, labels)
    }

    /// A counter labelled with a policy route (operator-defined, so bounded by the file).
    pub fn route_counter(
        &self,
        name: &'static str,
        route: &str,
        extra: &[(&'static str, &'static str)],
    ) -> Counter {
        self.recorder
            .register_counter(&Self::route_key(name, route, extra), &META)
    }

    /// A model's prompt-token counters: tokens routed, and those the prefix index expected
    /// cached where they went (the per-model hit ratio; `model` is a served model's name, so
    /// the label is bounded by the gateway file).
    pub fn model_tokens(&self, model: &str) -> ModelTokens {
        let key = |name: &'static str| {
            Key::from_parts(name, vec![Label::new("model", model.to_string())])
        };
        ModelTokens {
            prompt: self
                .recorder
                .register_counter(&key("kvgate_gateway_model_prompt_tokens_total"), &META),
            predicted_hit: self.recorder.register_counter(
                &key("kvgate_gateway_model_predicted_hit_tokens_total"),
                &META,
            ),
        }
    }

    /// A gauge labelled with a route and fixed, bounded labels.
    pub fn route_gauge_with(
        &self,
        name: &'static str,
        route: &str,
        extra: &[(&'static str, &'static str)],
    ) -> Gauge {
        self.recorder
            .register_gauge(&Self::route_key(name, route, extra), &META)
    }

    pub fn route_gauge(&self, name: &'static str, route: &str) -> Gauge {
        self.recorder
            .register_gauge(&Self::route_key(name, route, &[]), &META)
    }

    /// A histogram labelled with a route and fixed, bounded labels.
    pub fn route_histogram_with(
        &self,
        name: &'static str,
        route: &str,
        extra: &[(&'static str, &'static str)],
    ) -> Histogram {
        self.recorder
            .register_histogram(&Self::route_key(name, route, extra), &META)
    }

    pub fn route_histogram(&self, name: &'static str, route: &str) -> Histogram {
        self.recorder
            .register_histogram(&Self::route_key(name, route, &[]), &META)
    }

    pub fn policy_reload(&self, ok: bool) {
        self.policy_reloads[usize::from(!ok)].increment(1);
        self.policy_last_reload_ok.set(if ok { 1.0 } else { 0.0 });
    }

    pub fn render(&self) -> String {
        self.handle.render()
    }

    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }
}
