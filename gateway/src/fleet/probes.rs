//! What the gateway learns by asking a replica: its id, prefill rate and chunk budget
//! (`/server_info`), its context limit (`/v1/models`), its engine when no table names it
//! (vLLM's `/metrics`), and its load — `/get_load` for kvgate and SGLang, `/metrics` for vLLM.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use config::gateway::Backend;

use crate::fleet::engine_metrics::parse_vllm;
use crate::fleet::registry::Registry;
use crate::fleet::replica::ReplicaHandle;

impl Registry {
    /// Learns from `/server_info` (kvgate and SGLang replicas): the prefill-rate prior of the
    /// TTFT model (`prefill_tokens_per_s`), the chunk budget (`chunked_prefill_size`), whether
    /// the engine holds back a prompt whose prefix is being computed (`waits_for_prefix_in_flight`); returns
    /// the replica's own id (`replica_id`) when it reports one.
    pub(super) async fn learn_server_info(
        &self,
        r: &ReplicaHandle,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Option<String> {
        let Some(body) = self.get(addr, "/server_info", timeout).await else {
            self.detect_engine(r, addr, timeout).await;
            return None;
        };
        let v = serde_json::from_slice::<serde_json::Value>(&body).ok()?;
        if let Some(chunk) = v["chunked_prefill_size"].as_u64().filter(|&c| c > 0) {
            r.chunk_tokens.store(chunk, Ordering::Relaxed);
        }
        r.waits_for_prefix.store(
            v["waits_for_prefix_in_flight"].as_bool().unwrap_or(false),
            Ordering::Relaxed,
        );
        if let Some(rate) = v["prefill_tokens_per_s"].as_f64() {
            r.model
                .lock()
                .set_prior(rate, crate::fleet::latency_model::GENERIC_OVERHEAD_S);
        }
        v["replica_id"]
            .as_str()
            .filter(|s| !s.is_empty() && s.len() <= 128)
            .map(str::to_string)
    }

    /// A replica without `/server_info` and without an engine table: a vLLM engine is
    /// recognised by its scheduler gauges on `/metrics`, and its load is read there from then on.
    pub(super) async fn detect_engine(
        &self,
        r: &ReplicaHandle,
        addr: SocketAddr,
        timeout: Duration,
    ) {
        if self.engine(&r.name).is_some() || r.detected_vllm.load(Ordering::Relaxed) {
            return;
        }
        let is_vllm = self
            .get(addr, "/metrics", timeout)
            .await
            .is_some_and(|b| parse_vllm(&String::from_utf8_lossy(&b)).is_some());
        if is_vllm {
            r.detected_vllm.store(true, Ordering::Relaxed);
            tracing::info!(replica = %r.name, "detected a vLLM engine: reading its load from /metrics");
        }
    }

    /// The engine behind `r`: the file's table, else what was detected, else kvgate.
    pub fn backend(&self, r: &ReplicaHandle) -> Backend {
        match self.engine(&r.name) {
            Some(e) => e.backend,
            None if r.detected_vllm.load(Ordering::Relaxed) => Backend::Vllm,
            None => Backend::Kvgate,
        }
    }

    /// Reads the replica's context limit from `/v1/models` (vLLM and kvgate report
    /// `max_model_len` there).
    pub(super) async fn learn_model_len(
        &self,
        r: &ReplicaHandle,
        addr: SocketAddr,
        timeout: Duration,
    ) {
        let Some(body) = self.get(addr, "/v1/models", timeout).await else {
            return;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
            return;
        };
        let found = v["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["max_model_len"].as_u64())
            .min();
        if let Some(n) = found {
            r.max_model_len.store(n, Ordering::Relaxed);
        }
    }

    pub(super) async fn poll_load(&self, r: &ReplicaHandle) {
        let Some(addr) = r.addr() else { return };
        let timeout = Duration::from_millis(self.cfg.health.timeout_ms);
        let finished_before = r.finished.load(Ordering::Relaxed);
        if self.backend(r) == Backend::Vllm {
            // vLLM has no /get_load: its scheduler gauges are on /metrics.
            let Some(l) = self
                .get(addr, "/metrics", timeout)
                .await
                .and_then(|b| parse_vllm(&String::from_utf8_lossy(&b)))
            else {
                return;
            };
            r.waiting.store(l.waiting, Ordering::Relaxed);
            r.running.store(l.running, Ordering::Relaxed);
            r.kv_usage_bits
                .store(l.kv_usage.to_bits(), Ordering::Relaxed);
            r.since_poll_tokens.store(0, Ordering::Relaxed);
            if let Some(blocks) = l.num_gpu_blocks {
                self.learn_capacity(r, blocks * self.block_size_of(&r.name) as u64);
            }
            if let Some(p) = l.preemptions {
                self.note_preemptions(r, p);
            }
            let now = std::time::Instant::now();
            if let Some(t) = l.generation_tokens {
                r.throughput.sample(now, t);
            }
            r.busy.sample(now, r.busy_clock.tick(now, l.running > 0));
            r.finished_at_poll.store(finished_before, Ordering::Relaxed);
            return;
        }
        let Some(body) = self.get(addr, "/get_load", timeout).await else {
            return;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
            return;
        };
        let first = v.get(0).unwrap_or(&v);
        let field = |k: &str| first.get(k).and_then(|x| x.as_u64()).unwrap_or(0) as u32;
        let waiting = field("num_waiting_reqs");
        let total = field("num_reqs");
        r.waiting.store(waiting, Ordering::Relaxed);
        r.running
            .store(total.saturating_sub(waiting), Ordering::Relaxed);
        let kv = first
            .get("kv_cache_usage")
            .and_then(|x| x.as_f64())
            .unwrap_or(0.0);
        r.kv_usage_bits.store(kv.to_bits(), Ordering::Relaxed);
        r.since_poll_tokens.store(0, Ordering::Relaxed);
        if let Some(c) = first.get("max_total_num_tokens").and_then(|x| x.as_u64()) {
            self.learn_capacity(r, c);
        }
        if let Some(p) = first.get("preemptions").and_then(|x| x.as_u64()) {
            self.note_preemptions(r, p);
        }
        let now = std::time::Instant::now();
        if let Some(t) = first.get("generation_tokens").and_then(|x| x.as_u64()) {
            r.throughput.sample(now, t);
        }
        // kvgate's own busy time; an engine without it (SGLang) is estimated from the polls.
        let busy = match first.get("busy_seconds").and_then(|x| x.as_f64()) {
            Some(s) => (s * 1e6) as u64,
            None => r.busy_clock.tick(now, total > waiting),
        };
        r.busy.sample(now, busy);
        // Model FLOPs and the peak they are a share of, where the replica models them (sim).
        let number = |k: &str| first.get(k).and_then(|x| x.as_f64());
        if let (Some(f), Some(p)) = (number("model_flops"), number("peak_flops")) {
            r.flops.sample(now, (f / 1e6) as u64);
            r.peak_flops_bits.store(p.to_bits(), Ordering::Relaxed);
        }
        r.finished_at_poll.store(finished_before, Ordering::Relaxed);
    }

    /// A replica's KV cache holds `tokens`: admission projects its usage against it, and the
    /// prefix index holds at most that many of its blocks (plus a margin).
    pub(super) fn learn_capacity(&self, r: &ReplicaHandle, tokens: u64) {
        if r.capacity_tokens.swap(tokens, Ordering::Relaxed) != tokens && tokens > 0 {
            let blocks = tokens / self.block_size_of(&r.name).max(1) as u64;
            self.index.set_capacity(r.slot, Some(blocks as usize));
        }
    }

    /// A replica's preemption counter read `p`: a rise marks it as preempting now.
    pub(super) fn note_preemptions(&self, r: &ReplicaHandle, p: u64) {
        let before = r.preemptions.swap(p, Ordering::Relaxed);
        if before != u64::MAX && p > before {
            r.preempted_at_ms
                .store(self.now_ms() + 1, Ordering::Relaxed);
        }
    }
}
