//! The engine loop: owns the scheduler and the backend, takes requests from HTTP handlers over
//! a channel, runs one step after another, waits each step's time, then delivers the step's
//! tokens, publishes its KV events and updates metrics and load signals. Tokens are delivered
//! after the wait, so clients observe the modelled TTFT and inter-token gaps.
//!
//! A request is answered through its own channel; dropping the [`RequestStream`] (a client that
//! disconnected, a stop string that matched) aborts the sequence and frees its blocks at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::ApiError;
use tokio::sync::mpsc;

use crate::backend::EngineBackend;
use crate::kv_hub::KvEventHub;
use crate::metrics::ReplicaMetrics;
use crate::sampling::{SamplingParams, TokenLogprobs};
use crate::scheduler::{FinishReason, Scheduler, SeqId, SeqRequest};

/// One event on a request's channel.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Token {
        token: u32,
        finish: Option<FinishReason>,
        prompt_tokens: usize,
        cached_tokens: usize,
        /// The token's log-probabilities, when the request asked for them.
        logprobs: Option<Arc<TokenLogprobs>>,
    },
    /// The engine could not run the request (it never fits the cache, or the engine stopped).
    Failed(String),
}

enum Command {
    Add(SeqRequest, mpsc::UnboundedSender<EngineEvent>),
    Abort(SeqId),
    /// Drop every cached block no sequence holds; answers how many.
    FlushCache(tokio::sync::oneshot::Sender<usize>),
}

/// Load signals shared with HTTP handlers (`/get_load`, `/server_info`).
#[derive(Debug, Default)]
pub struct EngineStats {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub running_tokens: AtomicUsize,
    kv_usage_bits: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    /// Tokens generated since start (on `/get_load`, so a gateway measures the replica's
    /// throughput whatever share of its traffic it sent).
    pub generated: AtomicU64,
    /// Microseconds spent in steps since start: time with work in the batch (on `/get_load`
    /// as `busy_seconds`, the gateway's utilisation gauge).
    pub busy_us: AtomicU64,
    /// Model FLOPs of the steps run since start, in millions, where the backend models a
    /// step's cost (the sim); with [`EngineStats::peak_flops`], model FLOPs utilisation: the
    /// runbook's measure of useful work, where `busy_us` is a duty cycle.
    pub model_mflop: AtomicU64,
    peak_flops_bits: AtomicU64,
}

impl EngineStats {
    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed))
    }

    /// The backend's peak model FLOP/s on the wall clock; `None` where it does not know it.
    pub fn peak_flops(&self) -> Option<f64> {
        Some(f64::from_bits(self.peak_flops_bits.load(Ordering::Relaxed))).filter(|p| *p > 0.0)
    }
}

/// Limits a request is checked against before it reaches the engine.
#[derive(Debug, Clone)]
pub struct EngineLimits {
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

/// Cloneable front of the engine used by HTTP handlers.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    stats: Arc<EngineStats>,
    limits: EngineLimits,
}

/// What a handler submits.
#[derive(Debug, Clone)]
pub struct Submit {
    pub prompt: Vec<u32>,
    /// `None`: up to the context limit.
    pub max_tokens: Option<usize>,
    pub priority: i32,
    pub hash_root: u64,
    pub seed: Option<u64>,
    /// Tokens that end generation (the model's EOS and end-of-turn ids).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Temperature, top-p, top-k, logprobs (its `seed` is replaced by the resolved seed).
    pub sampling: SamplingParams,
}

/// The token stream of one submitted request; dropping it cancels the request.
pub struct RequestStream {
    pub id: SeqId,
    rx: mpsc::UnboundedReceiver<EngineEvent>,
    tx: mpsc::UnboundedSender<Command>,
    finished: bool,
}

impl RequestStream {
    pub async fn next(&mut self) -> Option<EngineEvent> {
        let ev = self.rx.recv().await;
        match &ev {
            Some(EngineEvent::Token {
                finish: Some(_), ..
            })
            | Some(EngineEvent::Failed(_))
            | None => self.finished = true,
            _ => {}
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

impl EngineHandle {
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// Drops every cached prefix block no running request holds (benchmarks start each run
    /// cold with it); returns how many blocks were dropped.
    pub async fn flush_cache(&self) -> Result<usize, ApiError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Command::FlushCache(tx))
            .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
        rx.await
            .map_err(|_| ApiError::unavailable("the engine has stopped"))
    }

    /// Checks the request against the context and cache limits and queues it.
    pub fn submit(&self, s: Submit) -> Result<RequestStream, ApiError> {
        let l = &self.limits;
        let prompt = s.prompt.len();
        if prompt >= l.max_model_len {
            return Err(ApiError::context_length_exceeded(
                prompt + s.max_tokens.unwrap_or(1),
                prompt,
                l.max_model_len,
            ));
        }
        if let Some(m) = s.max_tokens {
            if prompt + m > l.max_model_len {
                return Err(ApiError::context_length_exceeded(
                    prompt + m,
                    prompt,
                    l.max_model_len,
                ));
            }
        }
        let cache_tokens = l.num_blocks * l.block_size;
        if prompt + 1 > cache_tokens {
            return Err(ApiError::invalid_request(format!(
                "The prompt has {prompt} tokens but this replica's KV cache holds only {cache_tokens}."
            ))
            .with_code("context_length_exceeded"));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let seed = s
            .seed
            .unwrap_or_else(|| crate::rng::splitmix64(id ^ 0x5eed));
        let req = SeqRequest {
            id,
            prompt: s.prompt,
            priority: s.priority,
            hash_root: s.hash_root,
            max_tokens: s.max_tokens.unwrap_or(l.max_model_len - prompt),
            seed,
            stop_token_ids: s.stop_token_ids,
            ignore_eos: s.ignore_eos,
            sampling: Arc::new(SamplingParams { seed, ..s.sampling }),
        };
        self.tx
            .send(Command::Add(req, tx))
            .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
        Ok(RequestStream {
            id,
            rx,
            tx: self.tx.clone(),
            finished: false,
        })
    }
}

struct Live {
    tx: mpsc::UnboundedSender<EngineEvent>,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    last_token: Option<Instant>,
}

pub struct Engine {
    scheduler: Scheduler,
    /// Taken out while a computing backend runs on a blocking thread.
    backend: Option<Box<dyn EngineBackend>>,
    hub: Arc<KvEventHub>,
    metrics: Arc<ReplicaMetrics>,
    stats: Arc<EngineStats>,
    rx: mpsc::UnboundedReceiver<Command>,
    live: HashMap<SeqId, Live>,
    reported_prefix: (u64, u64),
    reported_preemptions: u64,
    reported_prefix_waits: u64,
    window_start: Instant,
    window_tokens: u64,
    virtual_end: Option<Instant>,
}

/// Timer lateness carried into the next step's deadline.
const CATCH_UP: Duration = Duration::from_millis(3);

impl Engine {
    pub fn new(
        scheduler: Scheduler,
        backend: Box<dyn EngineBackend>,
        hub: Arc<KvEventHub>,
        metrics: Arc<ReplicaMetrics>,
    ) -> (Engine, EngineHandle) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(EngineStats::default());
        if let Some(p) = backend.peak_flops() {
            stats.peak_flops_bits.store(p.to_bits(), Ordering::Relaxed);
        }
        let c = scheduler.config();
        let limits = EngineLimits {
            max_model_len: c.max_model_len,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
        };
        let handle = EngineHandle {
            tx,
            next_id: Arc::new(AtomicU64::new(1)),
            stats: stats.clone(),
            limits,
        };
        let engine = Engine {
            scheduler,
            backend: Some(backend),
            hub,
            metrics,
            stats,
            rx,
            live: HashMap::new(),
            reported_prefix: (0, 0),
            reported_preemptions: 0,
            reported_prefix_waits: 0,
            window_start: Instant::now(),
            window_tokens: 0,
            virtual_end: None,
        };
        (engine, handle)
    }

    fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Add(req, tx) => {
                let id = req.id;
                let prompt_len = req.prompt.len();
                match self.scheduler.add(req) {
                    Ok(()) => {
                        self.metrics.prompt_tokens.increment(prompt_len as u64);
                        self.live.insert(
                            id,
                            Live {
                                tx,
                                arrival: Instant::now(),
                                first_scheduled: None,
                                last_token: None,
                            },
                        );
                    }
                    Err(e) => {
                        let _ = tx.send(EngineEvent::Failed(e.to_string()));
                    }
                }
            }
            Command::Abort(id) => {
                if self.scheduler.abort(id) {
                    self.metrics.finished_abort.increment(1);
                }
                self.live.remove(&id);
            }
            Command::FlushCache(reply) => {
                let (n, events) = {
                    let mut pool = self.scheduler.pool().lock();
                    let n = pool.flush_cached();
                    (n, pool.take_events())
                };
                self.hub.publish(events);
                let _ = reply.send(n);
            }
        }
    }

    /// Runs until every [`EngineHandle`] is gone.
    pub async fn run(mut self) {
        loop {
            if !self.scheduler.has_work() {
                self.publish_stats();
                self.metrics.tokens_per_second.set(0.0);
                self.virtual_end = None;
                match self.rx.recv().await {
                    Some(cmd) => self.apply(cmd),
                    None => return,
                }
                self.window_start = Instant::now();
                self.window_tokens = 0;
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.apply(cmd);
            }
            if !self.scheduler.has_work() {
                continue;
            }
            if !self.step().await {
                self.fail_all("the engine's backend failed; see the replica's log");
                return;
            }
        }
    }

    /// Fails every request in flight (the backend is gone).
    fn fail_all(&mut self, msg: &str) {
        for (id, l) in self.live.drain() {
            let _ = l.tx.send(EngineEvent::Failed(msg.to_string()));
            self.scheduler.abort(id);
        }
    }

    /// Runs one planned step on the backend: inline for the sim, on a blocking thread for a
    /// backend that computes. `None` when the backend panicked.
    async fn run_backend(
        &mut self,
        items: &[crate::scheduler::ScheduledItem],
    ) -> Option<crate::backend::StepResult> {
        let mut backend = self.backend.take()?;
        if !backend.computes() {
            let r = backend.execute(items);
            self.backend = Some(backend);
            return Some(r);
        }
        let items = items.to_vec();
        let joined = tokio::task::spawn_blocking(move || {
            let r = backend.execute(&items);
            (backend, r)
        })
        .await;
        match joined {
            Ok((backend, r)) => {
                self.backend = Some(backend);
                Some(r)
            }
            Err(e) => {
                tracing::error!(error = %e, "the engine backend panicked; the engine stops");
                None
            }
        }
    }

    /// One step; `false` when the backend is gone.
    async fn step(&mut self) -> bool {
        let start = Instant::now();
        let out = self.scheduler.schedule();
        if out.items.is_empty() {
            // Nothing fits and nothing runs (the head waits for blocks that only an abort or a
            // new arrival can change): wait for the next command rather than spin.
            self.publish_stats();
            self.virtual_end = None;
            if let Some(cmd) = self.rx.recv().await {
                self.apply(cmd);
            }
            return true;
        }
        let Some(result) = self.run_backend(&out.items).await else {
            return false;
        };
        let outputs = self.scheduler.update(&out, &result.sampled);
        let events = self.scheduler.pool().lock().take_events();
        let cpu = start.elapsed();
        ReplicaMetrics::observe(&self.metrics.step_cpu_seconds, cpu);
        self.metrics.batch_size.record(out.items.len() as f64);
        for (id, _) in &out.first_scheduled {
            if let Some(l) = self.live.get_mut(id) {
                l.first_scheduled = Some(start);
                ReplicaMetrics::observe(&self.metrics.queue_seconds, start - l.arrival);
            }
        }
        // Steps of a busy period are laid end to end on a virtual clock: the timer wakes up to a
        // millisecond late, and carrying that lateness into the next step's deadline keeps the
        // average step at the modelled time. Lateness beyond CATCH_UP (an overloaded host) is
        // not carried, so the sim slows down rather than bursting.
        let base = match self.virtual_end {
            Some(v) if start.saturating_duration_since(v) < CATCH_UP => v,
            _ => start,
        };
        let deadline = base + result.wait;
        if deadline > Instant::now() {
            tokio::time::sleep_until(deadline.into()).await;
        }
        self.virtual_end = Some(deadline);
        let now = Instant::now();
        ReplicaMetrics::observe(&self.metrics.step_seconds, now - start);
        self.stats
            .busy_us
            .fetch_add((now - start).as_micros() as u64, Ordering::Relaxed);
        if let Some(c) = &result.cost {
            self.stats
                .model_mflop
                .fetch_add((c.flops / 1e6).round() as u64, Ordering::Relaxed);
        }
        self.hub.publish(events);
        self.stats.steps.fetch_add(1, Ordering::Relaxed);

        let mut gone = Vec::new();
        let mut logprobs = result.logprobs.iter();
        for o in outputs {
            let lp = logprobs.next().cloned().flatten();
            let Some(l) = self.live.get_mut(&o.seq_id) else {
                continue;
            };
            match l.last_token {
                None => {
                    ReplicaMetrics::observe(&self.metrics.ttft_seconds, now - l.arrival);
                    if let Some(fs) = l.first_scheduled {
                        ReplicaMetrics::observe(&self.metrics.prefill_seconds, now - fs);
                    }
                }
                Some(prev) => {
                    ReplicaMetrics::observe(&self.metrics.inter_token_seconds, now - prev)
                }
            }
            l.last_token = Some(now);
            let ev = EngineEvent::Token {
                token: o.token,
                finish: o.finish,
                prompt_tokens: o.prompt_tokens,
                cached_tokens: o.cached_tokens,
                logprobs: lp,
            };
            let delivered = l.tx.send(ev).is_ok();
            if let Some(f) = o.finish {
                ReplicaMetrics::observe(&self.metrics.e2e_seconds, now - l.arrival);
                match f {
                    FinishReason::Stop => self.metrics.finished_stop.increment(1),
                    FinishReason::Length => self.metrics.finished_length.increment(1),
                }
                self.live.remove(&o.seq_id);
            } else if !delivered {
                gone.push(o.seq_id);
            }
        }
        for id in gone {
            // The client went away: free its blocks now.
            self.apply(Command::Abort(id));
        }
        let n_out = self.window_tokens;
        self.window_tokens = n_out + result.sampled.len() as u64;
        self.metrics
            .generation_tokens
            .increment(result.sampled.len() as u64);
        self.stats
            .generated
            .fetch_add(result.sampled.len() as u64, Ordering::Relaxed);
        let elapsed = now - self.window_start;
        if elapsed >= Duration::from_secs(1) {
            self.metrics
                .tokens_per_second
                .set(self.window_tokens as f64 / elapsed.as_secs_f64());
            self.window_start = now;
            self.window_tokens = 0;
        }
        self.publish_stats();
        true
    }

    fn publish_stats(&mut self) {
        let s = &self.scheduler;
        let (usage, cached, prefix) = {
            let pool = s.pool().lock();
            (pool.usage(), pool.num_cached(), pool.stats())
        };
        self.stats.waiting.store(s.num_waiting(), Ordering::Relaxed);
        self.stats.running.store(s.num_running(), Ordering::Relaxed);
        self.stats
            .running_tokens
            .store(s.num_running_tokens(), Ordering::Relaxed);
        self.stats
            .kv_usage_bits
            .store(usage.to_bits(), Ordering::Relaxed);
        self.stats
            .preemptions
            .store(s.preemptions(), Ordering::Relaxed);
        let m = &self.metrics;
        m.kv_cache_usage.set(usage);
        m.cached_blocks.set(cached as f64);
        m.requests_waiting.set(s.num_waiting() as f64);
        m.requests_running.set(s.num_running() as f64);
        m.preemptions
            .increment(s.preemptions() - self.reported_preemptions);
        self.reported_preemptions = s.preemptions();
        m.prefix_waits
            .increment(s.prefix_waits() - self.reported_prefix_waits);
        self.reported_prefix_waits = s.prefix_waits();
        m.prefix_queries
            .increment(prefix.query_tokens - self.reported_prefix.0);
        m.prefix_hits
            .increment(prefix.hit_tokens - self.reported_prefix.1);
        self.reported_prefix = (prefix.query_tokens, prefix.hit_tokens);
    }
}
