//! The gateway's Prometheus metrics (`kvgate_gateway_*`): requests by route and status, the
//! timers as the gateway sees them (TTFT, inter-token, end-to-end, tokenise, routing decision),
//! decisions by policy and reason, the *predicted* prefix hit ratio per replica (prompt tokens
//! routed and tokens the index expected cached there, beside the replicas' actual counters),
//! replica health and the prefix index's size. Like the replica, the gateway owns its recorder.

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

pub struct ReplicaMetrics {
    pub healthy: Gauge,
    pub prompt_tokens: Counter,
    pub predicted_hit_tokens: Counter,
    pub in_flight: Gauge,
}

pub struct GatewayMetrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    pub ttft_seconds: Histogram,
    pub inter_token_seconds: Histogram,
    pub e2e_seconds: Histogram,
    pub tokenize_seconds: Histogram,
    pub route_seconds: Histogram,
    pub index_blocks: Gauge,
    pub index_bytes: Gauge,
    pub retries: Counter,
    pub replicas: Vec<ReplicaMetrics>,
}

impl GatewayMetrics {
    pub fn new(replica_names: &[String]) -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &TIMER_BUCKETS)
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
        let describe_counter = |name: &'static str, help: &'static str| {
            recorder.describe_counter(KeyName::from(name), None, SharedString::from(help));
        };
        let describe_gauge = |name: &'static str, help: &'static str| {
            recorder.describe_gauge(KeyName::from(name), None, SharedString::from(help));
        };
        describe_counter(
            "kvgate_gateway_requests_total",
            "Requests answered, by route and status",
        );
        describe_counter(
            "kvgate_gateway_decisions_total",
            "Routing decisions, by policy and reason",
        );
        describe_counter(
            "kvgate_gateway_prompt_tokens_total",
            "Prompt tokens routed, by replica",
        );
        describe_counter(
            "kvgate_gateway_predicted_hit_tokens_total",
            "Prompt tokens the prefix index expected cached at the chosen replica, by replica",
        );
        describe_counter(
            "kvgate_gateway_retries_total",
            "Requests re-sent to another replica",
        );
        describe_gauge(
            "kvgate_gateway_replica_healthy",
            "1 when the replica is admitted, 0 when ejected",
        );
        describe_gauge(
            "kvgate_gateway_replica_in_flight",
            "Requests the gateway has in flight at the replica",
        );
        describe_gauge(
            "kvgate_gateway_prefix_index_blocks",
            "Blocks in the prefix index",
        );
        describe_gauge(
            "kvgate_gateway_prefix_index_bytes",
            "Estimated memory of the prefix index",
        );
        let replicas = replica_names
            .iter()
            .map(|n| {
                let l = || vec![Label::new("replica", n.clone())];
                ReplicaMetrics {
                    healthy: recorder.register_gauge(
                        &Key::from_parts("kvgate_gateway_replica_healthy", l()),
                        &META,
                    ),
                    prompt_tokens: recorder.register_counter(
                        &Key::from_parts("kvgate_gateway_prompt_tokens_total", l()),
                        &META,
                    ),
                    predicted_hit_tokens: recorder.register_counter(
                        &Key::from_parts("kvgate_gateway_predicted_hit_tokens_total", l()),
                        &META,
                    ),
                    in_flight: recorder.register_gauge(
                        &Key::from_parts("kvgate_gateway_replica_in_flight", l()),
                        &META,
                    ),
                }
            })
            .collect();
        GatewayMetrics {
            ttft_seconds: h(
                "kvgate_gateway_ttft_seconds",
                "Request arrival to the first body byte forwarded",
            ),
            inter_token_seconds: h(
                "kvgate_gateway_inter_token_seconds",
                "Gap between consecutive streamed chunks",
            ),
            e2e_seconds: h(
                "kvgate_gateway_e2e_seconds",
                "Request arrival to the end of the response",
            ),
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
            retries: recorder
                .register_counter(&Key::from_name("kvgate_gateway_retries_total"), &META),
            replicas,
            recorder,
            handle,
        }
    }

    pub fn request(&self, route: &'static str, status: u16) {
        self.recorder
            .register_counter(
                &Key::from_parts(
                    "kvgate_gateway_requests_total",
                    vec![
                        Label::new("route", route),
                        Label::new("status", status.to_string()),
                    ],
                ),
                &META,
            )
            .increment(1);
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

    pub fn render(&self) -> String {
        self.handle.render()
    }

    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }
}
