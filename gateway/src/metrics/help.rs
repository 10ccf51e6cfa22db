//! What each `kvgate_gateway_*` and `kvgate_batch_*` series means, as `# HELP` says it on `/metrics`: one table per
//! kind, described on the recorder when it is built.

use metrics::{KeyName, SharedString, Unit};
use metrics_exporter_prometheus::PrometheusRecorder;

const COUNTERS: &[(&str, &str)] = &[
    (
        "kvgate_batch_lines_total",
        "Batch API lines finished (completed: in the output file; failed: in the error file) or put back to run again (retried: a 429/503, or a failure inside the gateway)",
    ),
    (
        "kvgate_batch_generated_tokens_total",
        "Completion tokens the Batch API's lines generated (its rate is the batch work's tokens per second)",
    ),
    (
        "kvgate_gateway_requests_total",
        "Requests answered, by endpoint and status",
    ),
    (
        "kvgate_gateway_decisions_total",
        "Routing decisions, by policy and reason",
    ),
    (
        "kvgate_gateway_prompt_tokens_total",
        "Prompt tokens routed, by replica",
    ),
    (
        "kvgate_gateway_predicted_hit_tokens_total",
        "Prompt tokens the prefix index expected cached at the chosen replica, by replica",
    ),
    (
        "kvgate_gateway_model_prompt_tokens_total",
        "Prompt tokens routed, by served model",
    ),
    (
        "kvgate_gateway_model_predicted_hit_tokens_total",
        "Prompt tokens the prefix index expected cached at the chosen replica, by served model",
    ),
    (
        "kvgate_gateway_retries_total",
        "Requests re-sent to another replica",
    ),
    (
        "kvgate_gateway_prompt_token_checks_total",
        "Answers whose usage.prompt_tokens was compared with the gateway's own count, by replica and result (match, mismatch: the gateway's tokenizer or chat template is not the engine's)",
    ),
    (
        "kvgate_gateway_prompt_token_id_checks_total",
        "Sampled prompts ([drift] token_id_share) whose token ids were compared with the engine's /tokenize of the same input, by replica and result (match, mismatch: the gateway's tokenizer or chat template is not the engine's)",
    ),
    (
        "kvgate_gateway_replica_busy_share",
        "Share of the last minute the replica had work in its batch (kvgate replicas: their step time; vLLM and SGLang: polls that found requests running)",
    ),
    (
        "kvgate_gateway_replica_mfu",
        "Model FLOPs utilisation of the replica over the last minute: the model FLOPs its steps did per second over its peak (replicas that report both: kvgate's sim)",
    ),
    (
        "kvgate_gateway_fleet_mfu",
        "Model FLOPs utilisation of the healthy replicas that report it, over the window (1m, 10m): their FLOPs per second over their summed peak. The runbook's measure of useful work; busy share is a duty cycle",
    ),
    (
        "kvgate_gateway_fleet_busy_share",
        "Mean busy share of the healthy replicas over the window (1m, 10m): the runbook's average utilisation, the largest lever on cost per token",
    ),
    (
        "kvgate_gateway_prompt_samples_total",
        "Rendered prompts sampled to [drift] prompt_sample_path: written, or dropped because the file's queue was full",
    ),
    (
        "kvgate_gateway_upstream_errors_total",
        "Unusable answers from a replica, by reason (5xx, not JSON, not SSE, bad event, past max_tokens or a size cap, stall)",
    ),
    (
        "kvgate_gateway_outlier_ejections_total",
        "Replicas ejected by outlier detection (unusable answers in a row)",
    ),
    (
        "kvgate_gateway_prefix_index_evicted_total",
        "Blocks dropped from the prefix index because a replica reported more than it can hold",
    ),
    (
        "kvgate_gateway_route_requests_total",
        "Admitted requests that finished, by route",
    ),
    (
        "kvgate_gateway_route_errors_total",
        "Admitted requests that ended in an error (no answer, or a stream cut short), by route",
    ),
    (
        "kvgate_gateway_good_requests_total",
        "Finished requests that met both latency targets, by route",
    ),
    (
        "kvgate_gateway_route_output_tokens_total",
        "Output tokens of finished requests, by route",
    ),
    (
        "kvgate_gateway_good_output_tokens_total",
        "Output tokens of requests that met both targets, by route",
    ),
    (
        "kvgate_gateway_slo_violations_total",
        "Finished requests that missed a target, by route and kind (ttft, itl)",
    ),
    (
        "kvgate_gateway_shed_total",
        "Requests answered 429, by route and reason (queue_full, deadline, timeout)",
    ),
    (
        "kvgate_gateway_admission_holds_total",
        "Requests that had to wait, by route and the first reason (ttft, itl, stalls, kv_high_water, preempting, concurrency, token_budget, queue_order, prefix_in_flight)",
    ),
    (
        "kvgate_gateway_policy_reloads_total",
        "Policy file loads, by result (ok, rejected)",
    ),
    (
        "kvgate_gateway_prompts_refused_total",
        "Prompts refused as too long, by the stage that decided (bytes: from the size alone; pieces: after counting part of it; exact: after tokenising it)",
    ),
    (
        "kvgate_gateway_connections_refused_total",
        "Client connections closed at once because the connection limit was reached",
    ),
    (
        "kvgate_gateway_connections_closed_total",
        "Client connections the gateway cut, by reason (header_timeout, header_too_large, body_timeout)",
    ),
    (
        "kvgate_gateway_accept_errors_total",
        "Failed accept() calls (e.g. out of file descriptors), by listener",
    ),
    (
        "kvgate_gateway_auth_failures_total",
        "Requests refused for a missing or wrong credential, by port (api, admin)",
    ),
    (
        "kvgate_gateway_stream_errors_total",
        "Responses cut after their first byte, by reason (upstream_error, idle_timeout, replica_ejected, drain)",
    ),
    (
        "kvgate_gateway_holds_lost_total",
        "Requests that waited for one replica and were then sent to another (the wait did not pay), by route",
    ),
    (
        "kvgate_gateway_prefix_warms_total",
        "Prompts sent for one token to add a holder of a hot prefix before its holders break a promise, by route, reason (inter_token, queue) and outcome (ok, failed)",
    ),
    (
        "kvgate_gateway_tokenizer_refused_total",
        "Requests refused for want of a tokeniser, by reason (queue_full, queue_timeout)",
    ),
];

const GAUGES: &[(&str, &str)] = &[
    (
        "kvgate_batch_lines",
        "Batch API lines of this gateway's batches: queued (not started) and running",
    ),
    (
        "kvgate_batch_jobs_unfinished",
        "Batches this gateway holds and has not finished",
    ),
    (
        "kvgate_batch_store_bytes",
        "Bytes the Batch API's database holds (pages in use), bounded by batch.max_disk_mib",
    ),
    (
        "kvgate_batch_predicted_completion_seconds",
        "Seconds until this gateway's batch lines are all done at the last minute's pace (+Inf when none finished in it)",
    ),
    (
        "kvgate_batch_window_margin_seconds",
        "The earliest running batch's time left minus the predicted completion: below 0, a batch will expire with lines not run at this pace",
    ),
    (
        "kvgate_gateway_goodput_ratio",
        "Requests served within the route's targets over all asked (finished or shed) in the last minute",
    ),
    (
        "kvgate_gateway_route_in_flight",
        "Admitted requests of the route not yet finished",
    ),
    (
        "kvgate_gateway_route_queue_depth",
        "Requests waiting for admission, by route",
    ),
    (
        "kvgate_gateway_policy_generation",
        "Policy files accepted since start (1 = the first)",
    ),
    (
        "kvgate_gateway_policy_last_reload_ok",
        "1 when the last policy load was accepted, 0 when it was rejected",
    ),
    (
        "kvgate_gateway_replica_healthy",
        "1 when the replica is admitted, 0 when ejected",
    ),
    (
        "kvgate_gateway_replica_in_flight",
        "Requests the gateway has in flight at the replica",
    ),
    (
        "kvgate_gateway_connections_open",
        "Open client connections on the API port",
    ),
    (
        "kvgate_gateway_draining",
        "1 while the gateway drains after SIGTERM",
    ),
    (
        "kvgate_gateway_scale_signal",
        "Autoscaling signal from leading indicators (the largest route's; the 90th percentile of the last minute's per-second readings): scale out above 1.0",
    ),
    (
        "kvgate_gateway_route_scale_signal",
        "A route's autoscaling signal by part: queue (requests waiting in the gateways per healthy replica of the pool), kv (mean KV usage ÷ kv_high_water), ttft (mean predicted wait for a first token ÷ the promise), itl (mean predicted decode step with one more stream ÷ the promise); 1.0 is the knee. Instantaneous, unlike the fleet signal",
    ),
    (
        "kvgate_gateway_cost_per_mtok",
        "USD per million generated tokens over a route's pool: the replica-hours' price ([cost]) ÷ the tokens the replicas' own counters measured over cost.window_s",
    ),
    (
        "kvgate_gateway_fleet_cost_per_mtok",
        "USD per million generated tokens over every priced, measured replica",
    ),
    (
        "kvgate_gateway_managed_cost_per_mtok",
        "A managed API's price per million output tokens ([cost] managed_usd_per_mtok), for comparison",
    ),
    (
        "kvgate_gateway_peers",
        "Peer gateways sharing the admission budget, by state (live: heard within peers.stale_ms; stale: not, and no longer counted)",
    ),
    (
        "kvgate_gateway_prefix_index_blocks",
        "Blocks in the prefix index",
    ),
    (
        "kvgate_gateway_prefix_index_bytes",
        "Estimated memory of the prefix index",
    ),
    (
        "kvgate_gateway_tokenizer_cache_bytes",
        "Bytes the tokeniser's segment cache holds (token ids and entry overhead)",
    ),
];

/// Histograms in seconds.
const TIMERS: &[(&str, &str)] = &[
    (
        "kvgate_gateway_ttft_seconds",
        "Request arrival (queue included) to the first body byte forwarded, by route",
    ),
    (
        "kvgate_gateway_inter_token_seconds",
        "Gap between consecutive streamed chunks, by route",
    ),
    (
        "kvgate_gateway_e2e_seconds",
        "Request arrival to the end of the response, by route",
    ),
    (
        "kvgate_gateway_queue_seconds",
        "Time a request waited for admission, by route",
    ),
    (
        "kvgate_gateway_hold_seconds",
        "Time requests spent held before dispatch, by route and reason",
    ),
];

/// Describes every series on `recorder`.
pub fn describe(recorder: &PrometheusRecorder) {
    use metrics::Recorder;
    for (name, help) in COUNTERS {
        recorder.describe_counter(KeyName::from(*name), None, SharedString::from(*help));
    }
    for (name, help) in GAUGES {
        recorder.describe_gauge(KeyName::from(*name), None, SharedString::from(*help));
    }
    for (name, help) in TIMERS {
        recorder.describe_histogram(
            KeyName::from(*name),
            Some(Unit::Seconds),
            SharedString::from(*help),
        );
    }
    recorder.describe_histogram(
        KeyName::from("kvgate_gateway_ttft_prediction_ratio"),
        None,
        SharedString::from("Observed ÷ predicted time to first token (at the replica, from sending) of the requests placed there, by replica; for an unstreamed answer the observed time is estimated (the whole answer less its decode at the learnt step)"),
    );
}
