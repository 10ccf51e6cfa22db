//! One replica as the gateway knows it ([`ReplicaHandle`]): its resolved address (re-resolved
//! on every health check, so DNS names follow their records), health (ejected after
//! consecutive failures, readmitted after consecutive passes), load (polled from `/get_load`,
//! plus the gateway's own in-flight count), the latency model learnt from its streams, its
//! metric handles and whether its KV event stream is live. Policies see it through
//! [`ReplicaHandle::load`] and [`ReplicaHandle::speed`]; the health checks, probes and event
//! followers (`health.rs`, `probes.rs`, `events.rs`) write into it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use parking_lot::RwLock;
use policies::{LoadSignal, SpeedView};

use crate::access_log::AccessRecord;
use crate::fleet::client::FleetClient;
use crate::fleet::latency_model::LatencyModel;
use crate::fleet::prefill_queue::{PrefillQueue, Running};
use crate::fleet::prompt_check::{PromptCheck, Verdict};
use crate::fleet::reuse_rate::ReuseRate;
use crate::fleet::throughput::{BusyClock, Throughput};
use crate::metrics::{GatewayMetrics, ReplicaMetrics};

pub struct ReplicaHandle {
    pub slot: usize,
    pub name: String,
    /// What the gateway has learnt about this replica's speed from the streams it relays.
    pub model: parking_lot::Mutex<LatencyModel>,
    /// Its series, registered once its label is settled (see [`ReplicaHandle::label`]).
    pub(super) metrics: OnceLock<ReplicaMetrics>,
    pub(super) factory: Arc<GatewayMetrics>,
    /// Its identity in metrics, explain, the access log and the admin API: the `replica_id` its
    /// `/server_info` reports (the label its own metrics carry), or its address. Settled at the
    /// first health check.
    pub(super) label: OnceLock<String>,
    /// Removed from the list: no new requests; the ones it has finish.
    pub(super) retired: AtomicBool,
    /// Health, load and event tasks, stopped on retirement.
    pub(super) tasks: parking_lot::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    pub(super) addr: RwLock<Option<SocketAddr>>,
    pub(super) healthy: AtomicBool,
    pub(super) fails: AtomicU32,
    pub(super) oks: AtomicU32,
    pub in_flight: AtomicU32,
    /// Of those, background requests (the batch class on a route with an `engine_priority`):
    /// the trough's per-replica cap on batch lines.
    pub background_in_flight: AtomicU32,
    /// Prompt tokens of this gateway's requests in flight there: the context its decode steps
    /// read (`fleet/step_fit.rs`).
    pub context_in_flight: AtomicU64,
    pub(super) waiting: AtomicU32,
    pub(super) running: AtomicU32,
    pub(super) kv_usage_bits: AtomicU64,
    pub(super) events_live: AtomicBool,
    /// Why an engine's events cannot be indexed (a block size the gateway does not hash with).
    pub(super) events_error: parking_lot::Mutex<Option<String>>,
    /// Recognised as a vLLM engine by its `/metrics` (no engine table names it).
    pub(super) detected_vllm: AtomicBool,
    /// The event stream was refused for want of a token (warned once).
    pub(super) events_refused: AtomicBool,
    /// Requests this gateway saw finish at the replica, and how many had finished when the
    /// last load report was requested: a report taken before one of our requests finished
    /// still counts it, so it is ignored until the next poll.
    pub(super) finished: AtomicU64,
    pub(super) finished_at_poll: AtomicU64,
    /// Uncached prompt tokens of our requests sent here that have not shown a first byte, and
    /// how much of them the replica has likely done: the prefill ahead of the next one.
    pub(super) prefill: PrefillQueue,
    /// The same for background requests (a route with an `engine_priority` above 0, such as
    /// the batch class): kept apart because the replica prefills them after, and in small
    /// chunks beside, the foreground work, so they are not in front of an interactive request.
    pub(super) background_prefill: PrefillQueue,
    /// Prefill the peer gateways sent here and have not seen done, as last heard
    /// (`peers.rs`): admission counts it ahead of a new request.
    pub peer_prefill: AtomicU64,
    /// The replica's preemption counter at the last poll (`u64::MAX` before the first).
    pub(super) preemptions: AtomicU64,
    /// Registry-clock milliseconds + 1 of the last poll that saw preemptions rise (0: never).
    pub(super) preempted_at_ms: AtomicU64,
    /// KV cache capacity in tokens (`max_total_num_tokens`; 0 when the replica does not say).
    pub(super) capacity_tokens: AtomicU64,
    /// Prompt tokens this gateway sent there since the last load report: the KV the report
    /// does not show yet.
    pub(super) since_poll_tokens: AtomicU64,
    /// Registry-clock ms + 1 of the last "not admitted" warning (0: never).
    pub(super) warned_at_ms: AtomicU64,
    /// `max_model_len` from the replica's `/v1/models` (0: not known yet).
    pub(super) max_model_len: AtomicU64,
    /// Prompt tokens the replica prefills per step (`chunked_prefill_size` in `/server_info`,
    /// as kvgate and SGLang report it; 0: not known).
    pub(super) chunk_tokens: AtomicU64,
    /// The engine admits a prompt whose prefix another request is computing only once it is
    /// computed (`waits_for_prefix_in_flight` in a kvgate replica's `/server_info`): the
    /// gateway need not hold such a prompt back itself.
    pub(super) waits_for_prefix: AtomicBool,
    /// Requests a second sent here to use what it holds.
    pub(super) reuse: ReuseRate,
    /// Reported blocks dropped from the prefix index past its cap, in all.
    pub(super) evicted: AtomicU64,
    /// Unusable answers in a row (outlier detection, `outlier.rs`).
    pub(super) upstream_fails: AtomicU32,
    /// Times outlier detection ejected it, and (registry-clock ms) until when it stays out.
    pub(super) outlier_ejections: AtomicU32,
    pub(super) outlier_until_ms: AtomicU64,
    /// Bumped each time the replica is ejected: requests waiting on it give up at once (and
    /// are retried elsewhere when nothing reached the client yet).
    pub(super) ejections: tokio::sync::watch::Sender<u64>,
    /// Its prompt token counts against the gateway's (tokenizer / chat template drift).
    pub prompt_check: PromptCheck,
    /// Its generated-token counter as polled: measured tokens per second.
    pub throughput: Throughput,
    /// Its busy microseconds counter, sampled like `throughput`: the utilisation gauge.
    pub busy: Throughput,
    /// The busy counter made from polls, for engines that report none (vLLM).
    pub busy_clock: BusyClock,
    /// Its model-FLOPs counter in millions (kvgate sim replicas' `model_flops`), sampled like
    /// `throughput`; with `peak_flops`, model FLOPs utilisation.
    pub flops: Throughput,
    /// Its peak model FLOP/s as it reports it (`f64` bits; 0: not reported).
    pub peak_flops_bits: AtomicU64,
}

impl ReplicaHandle {
    pub(super) fn new(slot: usize, name: String, factory: Arc<GatewayMetrics>) -> Self {
        ReplicaHandle {
            slot,
            name,
            model: parking_lot::Mutex::new(LatencyModel::default()),
            metrics: OnceLock::new(),
            factory,
            label: OnceLock::new(),
            retired: AtomicBool::new(false),
            tasks: parking_lot::Mutex::new(Vec::new()),
            addr: RwLock::new(None),
            healthy: AtomicBool::new(false),
            fails: AtomicU32::new(0),
            oks: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            background_in_flight: AtomicU32::new(0),
            context_in_flight: AtomicU64::new(0),
            waiting: AtomicU32::new(0),
            running: AtomicU32::new(0),
            kv_usage_bits: AtomicU64::new(0f64.to_bits()),
            events_live: AtomicBool::new(false),
            events_error: parking_lot::Mutex::new(None),
            detected_vllm: AtomicBool::new(false),
            events_refused: AtomicBool::new(false),
            finished: AtomicU64::new(0),
            finished_at_poll: AtomicU64::new(0),
            prefill: PrefillQueue::default(),
            background_prefill: PrefillQueue::default(),
            peer_prefill: AtomicU64::new(0),
            preemptions: AtomicU64::new(u64::MAX),
            preempted_at_ms: AtomicU64::new(0),
            capacity_tokens: AtomicU64::new(0),
            since_poll_tokens: AtomicU64::new(0),
            max_model_len: AtomicU64::new(0),
            chunk_tokens: AtomicU64::new(0),
            waits_for_prefix: AtomicBool::new(false),
            reuse: ReuseRate::default(),
            warned_at_ms: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            upstream_fails: AtomicU32::new(0),
            outlier_ejections: AtomicU32::new(0),
            outlier_until_ms: AtomicU64::new(0),
            ejections: tokio::sync::watch::Sender::new(0),
            prompt_check: PromptCheck::default(),
            throughput: Throughput::default(),
            busy: Throughput::default(),
            busy_clock: BusyClock::default(),
            flops: Throughput::default(),
            peak_flops_bits: AtomicU64::new(0),
        }
    }

    /// The replica's identity: its reported id, or its address (`name`) when it reports none
    /// or another replica already uses that id.
    pub fn label(&self) -> &str {
        self.label.get().map_or(self.name.as_str(), String::as_str)
    }

    /// Whether the label is settled (the first health check has run).
    pub fn label_settled(&self) -> bool {
        self.label.get().is_some()
    }

    /// Its metric handles (registering them, and settling the label, on first use).
    pub fn metrics(&self) -> &ReplicaMetrics {
        self.metrics.get_or_init(|| {
            let _ = self.label.set(self.name.clone());
            self.factory.replica(self.label(), &self.name)
        })
    }

    /// Checks the engine's `usage.prompt_tokens` against the gateway's count for one answer
    /// (see [`PromptCheck`]); counts the verdict and warns at the replica's first mismatch.
    pub fn check_prompt(&self, rec: &AccessRecord, engine: Option<u64>) {
        let (gateway, route) = (rec.prompt_tokens, rec.route.as_deref().unwrap_or_default());
        let Some(v) = self.prompt_check.observe(gateway, engine, route) else {
            return;
        };
        self.metrics().prompt_checks[usize::from(v != Verdict::Match)].increment(1);
        if v == Verdict::FirstMismatch {
            tracing::warn!(
                replica = %self.label(),
                gateway_tokens = gateway,
                engine_tokens = engine,
                route,
                "the engine counts this prompt's tokens differently from the gateway: is the \
                 gateway's tokenizer folder (model.tokenizer_dir) and chat template the engine's? \
                 Prefix routing cannot match its cache until they agree"
            );
        }
    }

    /// Compares, off the request path, the token ids the gateway made of a sampled prompt
    /// with the engine's own (`body` is what its `/tokenize` is asked; see [`PromptCheck`]);
    /// counts the verdict and warns at the replica's first mismatch.
    pub fn spawn_id_check(
        self: &Arc<Self>,
        client: FleetClient,
        body: Bytes,
        ids: Arc<[u32]>,
        route: String,
    ) {
        let Some(addr) = self.addr() else {
            return;
        };
        let me = self.clone();
        tokio::spawn(async move {
            let check = &me.prompt_check;
            let Some(v) = check.compare_ids(&client, addr, body, &ids, &route).await else {
                return;
            };
            me.metrics().prompt_id_checks[usize::from(v != Verdict::Match)].increment(1);
            if v == Verdict::FirstMismatch {
                tracing::warn!(
                    replica = %me.label(),
                    route,
                    "the engine tokenises this prompt into other token ids than the gateway \
                     (same input, its /tokenize): is the gateway's tokenizer folder \
                     (model.tokenizer_dir) and chat template the engine's? See prompt_check on \
                     /admin/replicas"
                );
            }
        });
    }

    /// Resolves when the replica is ejected after this call.
    pub fn ejected(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.ejections.subscribe();
        async move {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// The replica's context limit, once it said.
    pub fn max_model_len(&self) -> Option<u64> {
        Some(self.max_model_len.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    pub fn addr(&self) -> Option<SocketAddr> {
        *self.addr.read()
    }

    /// Admitted by its health checks and still listed.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.is_retired()
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Whether a request this gateway sent here, not yet answered, has `hash` as its prompt's
    /// block `k`: that prefix is still being prefilled here.
    pub fn computing(&self, k: usize, hash: u64) -> bool {
        self.prefill.computing(k, hash) || self.background_prefill.computing(k, hash)
    }

    /// Whether the engine itself holds a prompt back while another request computes its prefix.
    pub fn waits_for_prefix_in_flight(&self) -> bool {
        self.waits_for_prefix.load(Ordering::Relaxed)
    }

    /// Whether the KV event stream is connected and indexed (index exact for this replica):
    /// not while an error (a block size that differs) keeps its events out.
    pub fn events_live(&self) -> bool {
        self.events_live.load(Ordering::Relaxed) && self.events_error.lock().is_none()
    }

    /// Why its KV events cannot be indexed, if they cannot.
    pub fn events_error(&self) -> Option<String> {
        self.events_error.lock().clone()
    }

    pub fn load(&self) -> LoadSignal {
        let stale =
            self.finished.load(Ordering::Relaxed) != self.finished_at_poll.load(Ordering::Relaxed);
        let reported = |a: &AtomicU32| if stale { 0 } else { a.load(Ordering::Relaxed) };
        LoadSignal {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            waiting: reported(&self.waiting),
            running: reported(&self.running),
            kv_usage: f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed)),
        }
    }

    /// The load a request of this class weighs here. A foreground request leaves out this
    /// gateway's background requests: the replica admits it before them, they hold little KV
    /// and finish within seconds, and the trough stops feeding a replica once foreground work
    /// wants it (`batch/trough.rs`). Counted as whole requests they made foreground traffic
    /// avoid the replicas filling the trough, and the trough then filled the ones it left: at
    /// night a fleet's conversations crowded onto one or two replicas and lost their cache
    /// (BENCHMARKS, issue 33). The step they lengthen stays in [`ReplicaHandle::speed`].
    pub fn load_for(&self, background: bool) -> LoadSignal {
        let mut l = self.load();
        if !background {
            let lines = self.background_in_flight.load(Ordering::Relaxed);
            l.in_flight = l.in_flight.saturating_sub(lines);
            let from_waiting = lines.min(l.waiting);
            l.waiting -= from_waiting;
            l.running = l.running.saturating_sub(lines - from_waiting);
        }
        l
    }
}

impl ReplicaHandle {
    /// Prefill this gateway sent here that the replica has likely not done yet (what its peers
    /// are told, `peers.rs`).
    pub fn own_prefill_remaining(&self) -> u64 {
        let (overhead_s, seconds_per_token) = self.model.lock().ttft_coefficients();
        self.prefill
            .remaining(Instant::now(), overhead_s, seconds_per_token)
    }

    /// Background prompt tokens sent here whose first byte has not come back (nor, for an
    /// unstreamed answer, its predicted prefill passed).
    pub fn background_prefill_outstanding(&self) -> u64 {
        let (overhead_s, seconds_per_token) = self.model.lock().ttft_coefficients();
        self.background_prefill
            .remaining(Instant::now(), overhead_s, seconds_per_token)
    }

    /// What a request sent here at `now` finds in front of it: the prefill ahead of its own
    /// step, the rest of the step running (lengthened by the prefill planned into it), and
    /// the decode step it then joins (0 when idle). Where the running step's start is known
    /// (the last step end seen, less than that step's length ago) the requests sent before it
    /// are in it, not ahead ([`PrefillQueue::split`]); otherwise all unanswered prefill is
    /// ahead and the step's rest is its mean, half a step ([`LatencyModel::step_wait`]).
    pub fn joined(&self, now: Instant) -> Joined {
        let busy = self.load().requests() > 0;
        let context = self.context_in_flight.load(Ordering::Relaxed);
        let chunk_tokens = self.chunk_tokens();
        let m = self.model.lock();
        let plane = m.ttft_plane();
        let (overhead_s, seconds_per_token) = (plane.overhead_s, plane.seconds_per_token);
        let step_s = if busy {
            m.step_at(context).unwrap_or(0.0)
        } else {
            0.0
        };
        let running = m.running_step(busy);
        let mean_wait_s = m.step_wait(now, busy);
        let lag_s = m.step_lag();
        drop(m);
        if let Some((started, step)) = running {
            let r = Running {
                started,
                chunk_tokens,
                step_s: step,
            };
            let split = self
                .prefill
                .split(now, overhead_s, seconds_per_token, Some(r));
            let length = step.max(split.in_step as f64 * seconds_per_token);
            let since = now.saturating_duration_since(started).as_secs_f64();
            if since < length {
                // Too late for the next step: it joins the one after (`StepPhase::lag`).
                let left = length - since;
                let missed = if left < lag_s { step_s } else { 0.0 };
                return Joined {
                    ahead: split.ahead,
                    step_wait_s: left + missed,
                    step_left_s: Some(left),
                    step_s,
                };
            }
        }
        Joined {
            ahead: self.prefill.remaining(now, overhead_s, seconds_per_token),
            step_wait_s: mean_wait_s,
            step_left_s: None,
            step_s,
        }
    }

    /// The most prompt tokens one of its steps takes (its `/get_load`; the policies' default
    /// until it reports).
    fn chunk_tokens(&self) -> u64 {
        match self.chunk_tokens.load(Ordering::Relaxed) {
            0 => SpeedView::default().chunk_tokens,
            chunk => chunk,
        }
    }

    /// What placement knows of this replica's speed now: the learnt TTFT fit, the prefill
    /// queued ahead, the decode step with one more sequence and the one its streams see now,
    /// the chunk budget.
    pub fn speed(&self) -> SpeedView {
        let batch = self.load().requests() + 1;
        let now = Instant::now();
        let joined = self.joined(now);
        let m = self.model.lock();
        let step_now_s = m.step_at(self.context_in_flight.load(Ordering::Relaxed));
        let plane = m.ttft_plane();
        SpeedView {
            overhead_s: plane.overhead_s,
            seconds_per_token: plane.seconds_per_token,
            seconds_per_attention: plane.seconds_per_attention,
            queued_prefill_tokens: joined.ahead + self.peer_prefill.load(Ordering::Relaxed),
            decode_step_s: m.predict_itl(batch).map(|d| d.as_secs_f64()),
            current_step_s: m.current_step().map(|d| d.as_secs_f64()),
            step_now_s,
            step_per_context_token_s: m.step_per_context_token(),
            stall_margin_s: m.stall_margin(),
            chunk_tokens: self.chunk_tokens(),
            step_wait_s: joined.step_wait_s,
            join_step_s: joined.step_s,
            reuse_rate: self.reuse.rate(now),
        }
    }
}

/// What a request sent to a replica finds in front of it ([`ReplicaHandle::joined`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Joined {
    /// Unanswered prefill (tokens) ahead of its own step.
    pub ahead: u64,
    /// Seconds until the step it joins starts (0 when idle): the rest of the running step, and
    /// one decode step more when it is sent too late to join the next.
    pub step_wait_s: f64,
    /// The rest of the running step when its start was known (s).
    pub step_left_s: Option<f64>,
    /// The decode step it joins (s; 0 when idle).
    pub step_s: f64,
}
