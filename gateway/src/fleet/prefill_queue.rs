//! The prefill this gateway has sent to one replica and not yet seen answered: the work in
//! front of the next request there. Counted in uncached prompt tokens from the moment a
//! request is sent until its first byte comes back.
//!
//! What is still *to do* is a little less than what is outstanding: the replica works on the
//! oldest unanswered request, and has been doing so since it was sent or since the last answer
//! came back, whichever is later. A burst's followers, arriving while the first request's cold
//! prefill is half done, see half of it in front of them, not all of it: counting all of it
//! made a holder look slower than a cold replica and spread bursts over replicas that then paid
//! for the whole prefix (BENCHMARKS, issue 11, bursty traffic on A100-sized caches). Only the
//! oldest request is credited, and never beyond its own size, so an optimistic rate cannot
//! pile up credit over a long busy period (crediting the whole busy period did: on agent
//! traffic at 24/s the queues looked empty and four replicas took everything).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::fleet::ttft_fit::TtftCoefficients;

/// One unanswered request.
#[derive(Debug)]
struct Entry {
    id: u64,
    tokens: u64,
    sent: Instant,
    /// Its prompt's block hashes (chained: the hash at `k` names the whole prefix up to block
    /// `k`), so placement can ask whether a prefix is still being computed here. Shared with
    /// the request, not copied.
    blocks: Arc<[u64]>,
    /// The prefill in front of it when it was sent.
    ahead: u64,
    /// An unstreamed request's first byte is its whole answer, a decode later: its prefill is
    /// taken as done from here on.
    settles: Option<Instant>,
}

impl Entry {
    fn live(&self, now: Instant) -> bool {
        self.settles.is_none_or(|t| now < t)
    }
}

#[derive(Debug, Default)]
struct Queue {
    /// Unanswered requests, oldest first.
    waiting: VecDeque<Entry>,
    next_id: u64,
    /// When the last answer came back.
    last_answer: Option<Instant>,
}

/// The step a replica is running, as the gateway knows it: when it started (the last step end
/// seen), how many prompt tokens a step takes at most, and its decode step (s).
#[derive(Debug, Clone, Copy)]
pub struct Running {
    pub started: Instant,
    pub chunk_tokens: u64,
    pub step_s: f64,
}

/// The unanswered prefill in front of a request: `ahead` of its own step, and `in_step`, in
/// the step the replica is running.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Split {
    pub ahead: u64,
    pub in_step: u64,
}

impl Split {
    fn ahead(ahead: u64) -> Self {
        Split { ahead, in_step: 0 }
    }
}

#[derive(Debug, Default)]
pub struct PrefillQueue {
    outstanding: AtomicU64,
    queue: parking_lot::Mutex<Queue>,
}

impl PrefillQueue {
    /// Prefill sent and not answered, whatever was done of it.
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// The outstanding prefill the replica has not done yet at `now`: the oldest request is
    /// credited with the work since it was sent or since the last answer (the later), after
    /// `overhead_s`, at `seconds_per_token`.
    pub fn remaining(&self, now: Instant, overhead_s: f64, seconds_per_token: f64) -> u64 {
        self.split(now, overhead_s, seconds_per_token, None).ahead
    }

    /// What a request sent at `now` finds in front of it. Without `running` (the replica's
    /// step is not known) it is [`Self::remaining`], all ahead. With it, the requests sent
    /// before the running step started were planned into that step, up to its chunk budget:
    /// they finish when it ends, before the new request's own step starts, so they are
    /// `in_step` and not ahead (a 344-token prefill sent behind 300 such tokens was predicted
    /// at 213 ms and took 110 ms, one step: BENCHMARKS, issue 28). The oldest request is then
    /// credited only with the work of the steps before the running one that it could have
    /// joined: not the step that was running when it was sent (one decode step is taken off).
    /// A prefill that fits one step gets no credit, and one of several chunks the chunks done.
    pub fn split(
        &self,
        now: Instant,
        overhead_s: f64,
        seconds_per_token: f64,
        running: Option<Running>,
    ) -> Split {
        let q = self.queue.lock();
        let settled: u64 = q
            .waiting
            .iter()
            .filter(|e| !e.live(now))
            .map(|e| e.tokens)
            .sum();
        let outstanding = self.outstanding().saturating_sub(settled);
        let Some(&Entry {
            tokens: head_tokens,
            sent,
            ..
        }) = q.waiting.iter().find(|e| e.live(now))
        else {
            return Split::ahead(outstanding);
        };
        if seconds_per_token <= 0.0 {
            return Split::ahead(outstanding);
        }
        let (until, joined_late) = running.map_or((now, 0.0), |r| (r.started.min(now), r.step_s));
        let start = q.last_answer.map_or(sent, |a| a.max(sent));
        let working =
            (until.saturating_duration_since(start).as_secs_f64() - overhead_s - joined_late)
                .max(0.0);
        let done = ((working / seconds_per_token) as u64).min(head_tokens);
        let rest = outstanding.saturating_sub(done);
        let Some(r) = running else {
            return Split::ahead(rest);
        };
        let planned: u64 = q
            .waiting
            .iter()
            .filter(|e| e.live(now) && e.sent < r.started)
            .map(|e| e.tokens)
            .sum();
        let in_step = planned.saturating_sub(done).min(r.chunk_tokens).min(rest);
        Split {
            ahead: rest - in_step,
            in_step,
        }
    }

    /// Adds a request's `tokens` (its prompt's block hashes: `blocks`) sent at `now` with
    /// `ahead` tokens of prefill in front of it ([`Self::split`]); returns its id.
    pub fn add(&self, tokens: u64, blocks: Arc<[u64]>, now: Instant, ahead: u64) -> u64 {
        let mut q = self.queue.lock();
        let id = q.next_id;
        q.next_id += 1;
        q.waiting.push_back(Entry {
            id,
            tokens,
            sent: now,
            blocks,
            ahead,
            settles: None,
        });
        self.outstanding.fetch_add(tokens, Ordering::Relaxed);
        id
    }

    /// Request `id` (its prompt's `cached` tokens before its own) will not be answered by a
    /// first byte of its own (it is unstreamed): its prefill is taken as done once twice its
    /// predicted time to first token by `fit` has passed since it was sent. Without it an
    /// unstreamed request stayed in the queue through its whole decode, and the requests
    /// after it were priced behind prefill long done (in front of vLLM, predictions of 1.8 s
    /// for TTFTs of 0.65 s: BENCHMARKS, issue 29).
    pub fn unstreamed(&self, id: u64, cached: u64, fit: &TtftCoefficients) {
        let mut q = self.queue.lock();
        if let Some(e) = q.waiting.iter_mut().find(|e| e.id == id) {
            let predicted = fit.predict(e.ahead, e.tokens, cached).max(0.0);
            e.settles = Some(e.sent + std::time::Duration::from_secs_f64(2.0 * predicted));
        }
    }

    /// Whether an unanswered request's prompt has `hash` as its block `k`: the prefix up to
    /// that block is still being prefilled here (or waits to be).
    pub fn computing(&self, k: usize, hash: u64) -> bool {
        let now = Instant::now();
        self.queue
            .lock()
            .waiting
            .iter()
            .any(|e| e.live(now) && e.blocks.get(k) == Some(&hash))
    }

    /// Request `id` was answered (first byte) or abandoned at `now`. An unstreamed request
    /// answered after it settled says nothing of the prefill now in progress: the head's
    /// credit does not restart.
    pub fn done(&self, id: u64, now: Instant) {
        let mut q = self.queue.lock();
        if let Some(i) = q.waiting.iter().position(|e| e.id == id) {
            let e = q.waiting.remove(i).expect("position is in range");
            self.outstanding.fetch_sub(e.tokens, Ordering::Relaxed);
            if e.live(now) {
                q.last_answer = Some(now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const SPT: f64 = 1.0 / 2_000.0; // 2,000 tokens a second

    fn none() -> Arc<[u64]> {
        Arc::from(Vec::new())
    }

    /// Sends `tokens` at `t` with the fit's `overhead_s`, the replica's step unknown: (id,
    /// prefill ahead).
    fn push(
        q: &PrefillQueue,
        tokens: u64,
        blocks: Arc<[u64]>,
        t: Instant,
        overhead_s: f64,
    ) -> (u64, u64) {
        let ahead = q.remaining(t, overhead_s, SPT);
        (q.add(tokens, blocks, t, ahead), ahead)
    }

    /// The fit of a 2,000 tokens/s replica with no overhead and no attention cost.
    fn fit() -> TtftCoefficients {
        TtftCoefficients {
            overhead_s: 0.0,
            seconds_per_token: SPT,
            seconds_per_attention: 0.0,
        }
    }

    #[test]
    fn a_prefix_is_computing_until_the_request_carrying_it_is_answered() {
        let q = PrefillQueue::default();
        let t0 = Instant::now();
        let (a, _) = push(&q, 700, Arc::from(vec![11, 12, 13]), t0, 0.0);
        let (b, _) = push(&q, 300, Arc::from(vec![11, 22]), t0, 0.0);
        assert!(q.computing(2, 13) && q.computing(1, 22) && q.computing(0, 11));
        // A hash at another position is another prefix.
        assert!(!q.computing(0, 13) && !q.computing(3, 13));
        q.done(a, t0 + Duration::from_millis(350));
        assert!(!q.computing(2, 13) && !q.computing(1, 12));
        assert!(q.computing(0, 11), "b still carries block 0");
        q.done(b, t0 + Duration::from_millis(500));
        assert!(!q.computing(0, 11));
    }

    #[test]
    fn a_follower_sees_only_the_prefill_left_to_do() {
        let q = PrefillQueue::default();
        let t0 = Instant::now();
        assert_eq!(push(&q, 1_400, none(), t0, 0.02).1, 0);
        // 0.37 s later: 0.35 s of work done (700 tokens) of the 1,400.
        let (_, ahead) = push(&q, 50, none(), t0 + Duration::from_millis(370), 0.02);
        assert!((690..=710).contains(&ahead), "{ahead}");
        assert_eq!(q.outstanding(), 1_450);
        // Long after, the oldest is credited whole but no more: the follower's 50 remain.
        assert_eq!(q.remaining(t0 + Duration::from_secs(5), 0.02, SPT), 50);
    }

    #[test]
    fn credit_never_piles_up_over_a_long_busy_period() {
        let q = PrefillQueue::default();
        let mut t = Instant::now();
        let mut ids = Vec::new();
        for _ in 0..4 {
            ids.push(push(&q, 200, none(), t, 0.0).0);
        }
        // An hour of steady traffic: answers and new requests keep the queue non-empty.
        for _ in 0..1_000 {
            t += Duration::from_millis(3_600);
            q.done(ids.remove(0), t);
            ids.push(push(&q, 200, none(), t, 0.0).0);
        }
        // Just after an answer, the head has been worked on for no time: all 800 are ahead.
        assert_eq!(q.remaining(t, 0.0, SPT), 800);
        // 50 ms later, 100 tokens of the head are done, and only those.
        assert_eq!(q.remaining(t + Duration::from_millis(50), 0.0, SPT), 700);
    }

    #[test]
    fn unstreamed_requests_settle_after_twice_their_predicted_prefill() {
        // Two unstreamed 1,000-token requests sent together: their first bytes are their whole
        // answers, seconds of decode later. Predicted prefills: 0.5 s and 1 s, so they are
        // taken as done 1 s and 2 s after sending.
        let (marked, plain) = (PrefillQueue::default(), PrefillQueue::default());
        let t0 = Instant::now();
        for q in [&marked, &plain] {
            let (a, _) = push(q, 1_000, Arc::from(vec![7]), t0, 0.0);
            let (b, _) = push(q, 1_000, none(), t0, 0.0);
            if std::ptr::eq(q, &marked) {
                q.unstreamed(a, 0, &fit());
                q.unstreamed(b, 0, &fit());
            }
        }
        // At 1.5 s the replica has done both (2,000 tokens in 1 s); unmarked, the second stays
        // in front of every request until the first one's whole answer is back.
        let t = t0 + Duration::from_millis(1_500);
        assert_eq!(push(&marked, 400, none(), t, 0.0).1, 0);
        assert_eq!(push(&plain, 400, none(), t, 0.0).1, 1_000);
        // Settled or not, they are outstanding until answered; a settled one's answer does
        // not restart the head's credit.
        assert_eq!(marked.outstanding(), 2_400);
        let t9 = t0 + Duration::from_secs(9);
        marked.done(0, t9);
        assert_eq!(marked.outstanding(), 1_400);
        assert_eq!(
            marked.remaining(t9, 0.0, SPT),
            0,
            "the 400 were done long ago"
        );
    }

    #[test]
    fn answers_out_of_order_and_abandoned_requests_leave_the_queue() {
        let q = PrefillQueue::default();
        let t0 = Instant::now();
        let (a, _) = push(&q, 1_000, none(), t0, 0.0);
        let (b, _) = push(&q, 300, none(), t0, 0.0);
        q.done(b, t0 + Duration::from_millis(100));
        assert_eq!(q.outstanding(), 1_000);
        q.done(a, t0 + Duration::from_millis(200));
        q.done(a, t0 + Duration::from_millis(300)); // twice: no effect
        assert_eq!(q.outstanding(), 0);
        assert_eq!(q.remaining(t0 + Duration::from_secs(1), 0.0, SPT), 0);
    }

    #[test]
    fn requests_planned_into_the_running_step_are_not_ahead_of_the_next() {
        let q = PrefillQueue::default();
        let t0 = Instant::now();
        // 300 tokens sent at t0; the replica's running step started 10 ms later, so it carries
        // them; 200 more sent after that wait for the next step, with the new request.
        push(&q, 300, none(), t0, 0.0);
        let started = t0 + Duration::from_millis(10);
        push(&q, 200, none(), t0 + Duration::from_millis(20), 0.0);
        let now = t0 + Duration::from_millis(30);
        let running = |chunk_tokens| {
            Some(Running {
                started,
                chunk_tokens,
                step_s: 0.05,
            })
        };
        assert_eq!(
            q.split(now, 0.0, SPT, running(2_048)),
            Split {
                ahead: 200,
                in_step: 300
            }
        );
        // A step takes at most its chunk budget: the rest of the 300 stays ahead.
        assert_eq!(
            q.split(now, 0.0, SPT, running(256)),
            Split {
                ahead: 244,
                in_step: 256
            }
        );
        // The step unknown: the head is credited with the 30 ms since it was sent (60 tokens at
        // 2,000 a second) and the rest is ahead.
        assert_eq!(
            q.split(now, 0.0, SPT, None),
            Split {
                ahead: 440,
                in_step: 0
            }
        );
    }
}
