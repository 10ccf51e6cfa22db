//! The feeding loop. It keeps, for each unfinished batch, the lines with no result yet (read
//! from the database at start and when a batch is created) and, once per look at the trough
//! (`trough.rs`: about one decode step), starts at most one line per spare replica, up to the
//! in-flight cap, taking lines from the batches in turn, oldest first. Each line runs through
//! the request pipeline (`line.rs`) and its result is written before it is counted:
//!
//! - a 2xx answer goes to the output file, a 4xx (or a 5xx a third time) to the error file;
//! - a 429 or 503 (the fleet had no room after all) or a broken pipe puts the line back, and
//!   the batch waits a second before its next line; a 503 `no_spare_replica` (the spare
//!   replicas it was scoped to filled up before it was placed) puts it first for the next
//!   look, the batch not slowed;
//! - a cancelled or expired batch starts nothing more; once its running lines finish it is
//!   finalised, the lines never run written to the error file with `batch_cancelled` or
//!   `batch_expired`, as OpenAI does. A batch whose lines all have results is `completed`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use config::{Grant, Priority};
use tokio::sync::mpsc;

use crate::batch::attempt::{run_line, Again, Outcome, Report, Started};
use crate::batch::objects::{now_s, BatchRow, Status};
use crate::batch::store::{Ending, StoreError};
use crate::batch::{trough, Batches};
use crate::state::GatewayState;

/// A batch whose line was put back waits this long before its next one.
const COOLDOWN: Duration = Duration::from_secs(1);
/// Tries at writing a batch's files before it is marked failed.
const MAX_FINALIZE: u32 = 5;
/// How often finished batches and old files are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(600);
/// How often the database's size is read for its gauge.
const SIZE_EVERY: Duration = Duration::from_secs(10);

struct Job {
    row: BatchRow,
    pending: VecDeque<i64>,
    running: usize,
    attempts: HashMap<i64, u32>,
    cooldown_until: Option<Instant>,
    /// Failed attempts to finalise, and when the next may be made.
    finalize_failures: u32,
    finalize_after: Option<Instant>,
}

impl Job {
    fn grant(&self) -> Option<Grant> {
        (!self.row.tenant.is_empty()).then(|| Grant {
            tenant: self.row.tenant.clone(),
            priorities: vec![Priority::Batch],
        })
    }

    /// Why no more of its lines start: a cancel, or its window passed (a batch with every
    /// line done is completed, whatever the clock says).
    fn stopping(&self, now: i64) -> Option<Ending> {
        if self.pending.is_empty() {
            None
        } else if self.row.status == Status::Cancelling {
            Some(Ending::Cancelled)
        } else if now >= self.row.expires_at {
            Some(Ending::Expired)
        } else {
            None
        }
    }
}

/// Starts the runner when the Batch API is on.
pub fn spawn(state: &Arc<GatewayState>) {
    let Some(batches) = state.batch.clone() else {
        return;
    };
    let weak = Arc::downgrade(state);
    tokio::spawn(async move { run(weak, batches).await });
}

async fn run(state: Weak<GatewayState>, b: Arc<Batches>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Report>();
    let mut jobs: Vec<Job> = Vec::new();
    let mut reload = true;
    let mut next = 0usize;
    let mut last_sweep: Option<Instant> = None;
    let mut last_size: Option<Instant> = None;
    let mut last_claim: Option<Instant> = None;
    let (lease, renew_every) = b.lease();
    let mut pace = Pace::default();
    if let Some(st) = state.upgrade() {
        // Exported from the start, so dashboards and alerts see the series at 0.
        for outcome in ["completed", "failed", "retried"] {
            st.metrics
                .counter("kvgate_batch_lines_total", &[("outcome", outcome)])
                .increment(0);
        }
        st.metrics
            .counter("kvgate_batch_generated_tokens_total", &[])
            .increment(0);
    }
    loop {
        let Some(st) = state.upgrade() else { return };
        let m = &st.metrics;
        if reload || last_claim.is_none_or(|t| t.elapsed() >= renew_every) {
            reload = false;
            last_claim = Some(Instant::now());
            if let Err(e) = sync(&b, lease, &mut jobs).await {
                tracing::warn!(error = %e, "batch runner: cannot read the database");
            }
        }
        while let Ok(r) = rx.try_recv() {
            apply(&mut jobs, r, m, &mut pace);
        }
        finish(&b, &mut jobs).await;
        if last_sweep.is_none_or(|t| t.elapsed() >= SWEEP_EVERY) {
            last_sweep = Some(Instant::now());
            sweep(&b);
        }
        let look = trough::look(
            &st.policies.load(),
            &st.fleet,
            b.cfg.headroom,
            b.cfg.max_per_replica,
        );
        let scope: Arc<[usize]> = look.spare.clone().into();
        let running: usize = jobs.iter().map(|j| j.running).sum();
        let mut budget = look
            .spare
            .len()
            .min(b.max_in_flight(look.healthy).saturating_sub(running));
        let now = now_s();
        while budget > 0 && !st.lifecycle.is_draining() {
            let runnable = |j: &Job| {
                !j.pending.is_empty()
                    && j.stopping(now).is_none()
                    && j.cooldown_until.is_none_or(|t| t <= Instant::now())
            };
            let Some(k) = (0..jobs.len())
                .map(|d| (next + d) % jobs.len())
                .find(|&k| runnable(&jobs[k]))
            else {
                break;
            };
            next = k + 1;
            let job = &mut jobs[k];
            let Some(idx) = job.pending.pop_front() else {
                break;
            };
            job.running += 1;
            budget -= 1;
            tokio::spawn(run_line(
                st.clone(),
                b.store.clone(),
                Started {
                    batch: job.row.id.clone(),
                    endpoint: job.row.endpoint.clone(),
                    grant: job.grant(),
                    scope: scope.clone(),
                    idx,
                    attempts: *job.attempts.get(&idx).unwrap_or(&0),
                },
                tx.clone(),
            ));
        }
        gauges(&jobs, m, &pace);
        if last_size.is_none_or(|t| t.elapsed() >= SIZE_EVERY) {
            last_size = Some(Instant::now());
            if let Ok(bytes) = b.store.call(|s| s.bytes_used()).await {
                m.gauge("kvgate_batch_store_bytes").set(bytes as f64);
            }
        }
        let tick = look.tick;
        drop(st);
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = b.wake.notified() => reload = true,
            Some(r) = rx.recv() => {
                if let Some(st) = state.upgrade() {
                    apply(&mut jobs, r, &st.metrics, &mut pace);
                }
            }
        }
    }
}

/// Claims (and renews the lease on) the batches this gateway may run: takes in those it
/// did not have, takes their status (a cancel) for those it has, and lets go of those another
/// gateway took over (their running lines finish; their results are kept once).
async fn sync(b: &Batches, lease: Duration, jobs: &mut Vec<Job>) -> Result<(), StoreError> {
    let now = now_s();
    let (me, until) = (b.node_id.clone(), now + lease.as_secs() as i64);
    let rows = b.store.call(move |s| s.claim(&me, now, until)).await?;
    jobs.retain(|j| {
        let kept = rows.iter().any(|r| r.id == j.row.id);
        if !kept {
            tracing::warn!(batch = %j.row.id, "batch runner: another gateway holds this batch now");
        }
        kept
    });
    for row in rows {
        if let Some(j) = jobs.iter_mut().find(|j| j.row.id == row.id) {
            j.row.status = row.status;
            continue;
        }
        let id = row.id.clone();
        let pending = b.store.call(move |s| s.pending(&id)).await?;
        tracing::info!(batch = %row.id, lines = pending.len(), "batch runner: took a batch");
        jobs.push(Job {
            row,
            pending: pending.into(),
            running: 0,
            attempts: HashMap::new(),
            cooldown_until: None,
            finalize_failures: 0,
            finalize_after: None,
        });
    }
    Ok(())
}

fn apply(jobs: &mut [Job], r: Report, m: &crate::metrics::GatewayMetrics, pace: &mut Pace) {
    let Some(job) = jobs.iter_mut().find(|j| j.row.id == r.batch) else {
        return;
    };
    job.running = job.running.saturating_sub(1);
    match r.outcome {
        Outcome::Done { ok, tokens } => {
            pace.note(Instant::now());
            let outcome = if ok { "completed" } else { "failed" };
            m.counter("kvgate_batch_lines_total", &[("outcome", outcome)])
                .increment(1);
            m.counter("kvgate_batch_generated_tokens_total", &[])
                .increment(tokens);
            if ok {
                job.row.completed += 1;
            } else {
                job.row.failed += 1;
            }
        }
        Outcome::Retry(Again::Rescoped) => job.pending.push_front(r.idx),
        Outcome::Retry(again) => {
            m.counter("kvgate_batch_lines_total", &[("outcome", "retried")])
                .increment(1);
            if again == Again::Failed {
                *job.attempts.entry(r.idx).or_insert(0) += 1;
            }
            job.pending.push_back(r.idx);
            job.cooldown_until = Some(Instant::now() + COOLDOWN);
        }
    }
}

/// Finalises the batches that are done: every line has a result, or a cancel or the window
/// stopped them and their running lines came back. A batch whose files cannot be written is
/// tried again later, and marked `failed` after [`MAX_FINALIZE`] tries.
async fn finish(b: &Batches, jobs: &mut Vec<Job>) {
    let now = now_s();
    let files_expire = now + (b.cfg.retention_h * 3600) as i64;
    let mut k = 0;
    while k < jobs.len() {
        let j = &mut jobs[k];
        let ending = match j.stopping(now) {
            Some(e) if j.running == 0 => Some(e),
            None if j.running == 0 && j.pending.is_empty() => Some(Ending::Completed),
            _ => None,
        };
        let Some(ending) = ending.filter(|_| j.finalize_after.is_none_or(|t| t <= Instant::now()))
        else {
            k += 1;
            continue;
        };
        let id = j.row.id.clone();
        let result = if j.finalize_failures >= MAX_FINALIZE {
            b.store.call(move |s| s.fail(&id, now)).await
        } else {
            b.store
                .call(move |s| s.finalize(&id, ending, now, files_expire))
                .await
        };
        match result {
            Ok(()) => {
                tracing::info!(batch = %j.row.id, ?ending, completed = j.row.completed,
                    failed = j.row.failed, "batch finished");
                jobs.remove(k);
            }
            Err(e) => {
                j.finalize_failures += 1;
                j.finalize_after = Some(Instant::now() + COOLDOWN * 10);
                tracing::warn!(batch = %j.row.id, error = %e, tries = j.finalize_failures,
                    "cannot finalise a batch; trying again in 10 s");
                k += 1;
            }
        }
    }
}

/// Deletes what is past its retention, off the runner's loop (it may take a while).
fn sweep(b: &Arc<Batches>) {
    let before = now_s() - (b.cfg.retention_h * 3600) as i64;
    let store = b.store.clone();
    tokio::spawn(async move {
        match store.call(move |s| s.expire(before)).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(rows = n, "batch retention: deleted what expired"),
            Err(e) => tracing::warn!(error = %e, "batch retention sweep failed"),
        }
    });
}

/// Lines finished over the last [`PACE_WINDOW`]: the pace the queue's completion is
/// predicted at.
#[derive(Default)]
struct Pace {
    done: VecDeque<Instant>,
    since: Option<Instant>,
}

/// How far back the pace looks.
const PACE_WINDOW: Duration = Duration::from_secs(60);

impl Pace {
    fn note(&mut self, now: Instant) {
        self.since.get_or_insert(now);
        self.done.push_back(now);
        while self
            .done
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > PACE_WINDOW)
        {
            self.done.pop_front();
        }
    }

    /// Lines a second, over the window or since the first line finished.
    fn per_s(&self, now: Instant) -> Option<f64> {
        let span = now
            .saturating_duration_since(self.since?)
            .min(PACE_WINDOW)
            .as_secs_f64()
            .max(1.0);
        let recent = self
            .done
            .iter()
            .filter(|t| now.saturating_duration_since(**t) <= PACE_WINDOW)
            .count();
        (recent > 0).then(|| recent as f64 / span)
    }
}

/// The queue's gauges, and its completion predicted at the recent pace against the earliest
/// window of the batches it holds (`kvgate_batch_window_margin_seconds` below 0: at this
/// pace a batch will expire with lines not run; -inf while no line finished in the last
/// minute and some wait; NaN with no batch to run).
fn gauges(jobs: &[Job], m: &crate::metrics::GatewayMetrics, pace: &Pace) {
    let queued: usize = jobs.iter().map(|j| j.pending.len()).sum();
    let running: usize = jobs.iter().map(|j| j.running).sum();
    m.gauge_with("kvgate_batch_lines", &[("state", "queued")])
        .set(queued as f64);
    m.gauge_with("kvgate_batch_lines", &[("state", "running")])
        .set(running as f64);
    m.gauge("kvgate_batch_jobs_unfinished")
        .set(jobs.len() as f64);
    // The lines still to run (not those of cancelled or expired batches), at the pace of the
    // last minute: none finished in it means no pace, an unbounded finish.
    let now = now_s();
    let live = jobs.iter().filter(|j| j.stopping(now).is_none());
    let left: usize = live.clone().map(|j| j.pending.len() + j.running).sum();
    let eta = match pace.per_s(Instant::now()) {
        _ if left == 0 => 0.0,
        Some(rate) => left as f64 / rate,
        None => f64::INFINITY,
    };
    m.gauge("kvgate_batch_predicted_completion_seconds")
        .set(eta);
    let margin = match live.map(|j| j.row.expires_at).min() {
        Some(end) => (end - now) as f64 - eta,
        None => f64::NAN,
    };
    m.gauge("kvgate_batch_window_margin_seconds").set(margin);
}
