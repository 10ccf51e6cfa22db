//! The seam every policy implements, and the values that cross it.

use std::fmt;

/// Load as the gateway sees it: its own in-flight count plus what the replica last reported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadSignal {
    /// Requests this gateway has sent and not yet seen finish.
    pub in_flight: u32,
    /// The replica's own queue and batch (polled; includes other gateways' traffic).
    pub waiting: u32,
    pub running: u32,
    /// Fraction of the replica's KV blocks in use.
    pub kv_usage: f64,
}

impl LoadSignal {
    /// Requests at the replica: the larger of our exact count and its (slightly stale) report.
    pub fn requests(&self) -> u32 {
        self.in_flight.max(self.waiting + self.running)
    }
}

/// What the gateway has learnt about a replica's speed, for policies that price in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedView {
    /// Fixed part of time to first token (s).
    pub overhead_s: f64,
    /// Prefill seconds per uncached prompt token (the learnt fit's slope).
    pub seconds_per_token: f64,
    /// Seconds per unit of a request's own attention work: its uncached tokens times the
    /// context they attend to (`u · (cached + u / 2)`), over [`ATTENTION_UNIT`] tokens (the fit
    /// learns it; 0 where attention is cheap or not yet seen).
    pub seconds_per_attention: f64,
    /// Uncached prompt tokens already sent there that have not produced a first token: the
    /// prefill queued ahead of a new request.
    pub queued_prefill_tokens: u64,
    /// The decode step (median inter-token gap) with one more sequence in the batch, once
    /// learnt (s).
    pub decode_step_s: Option<f64>,
    /// The median inter-token gap its streams see now, whatever the batch (s); `None` before
    /// any was seen.
    pub current_step_s: Option<f64>,
    /// That step moved to the context now in flight there (requests dispatched since count,
    /// finished ones no longer do), along the learnt step-per-context-token line; `None`
    /// before any gap was seen.
    pub step_now_s: Option<f64>,
    /// Seconds of decode step per prompt token in flight there (0 until learnt): what one
    /// more stream of a long prompt adds to every stream's step.
    pub step_per_context_token_s: f64,
    /// How far its streams' 95th-percentile gap lies over their median (the steps carrying
    /// prefill; s, 0 until seen). Shown by explain; the inter-token check judges the median
    /// (BENCHMARKS, issue 28: judged on the p95, the check spread more and held worse).
    pub stall_margin_s: f64,
    /// Prompt tokens the replica prefills per step (its chunk budget).
    pub chunk_tokens: u64,
    /// Seconds until the step the replica runs now ends (0 when idle): a request sent now
    /// joins the next one. The learnt fit prices TTFT from there.
    pub step_wait_s: f64,
    /// The decode step a request sent now joins (s; 0 when idle). A step costs the larger of
    /// its memory time and its compute: a prefill that fits under a decode step still takes
    /// the whole step, and one that does not sets it.
    pub join_step_s: f64,
    /// Requests a second sent here to use what it holds (their match here was not empty),
    /// decayed over the last half-minute or so: how many would wait behind a long prefill here.
    pub reuse_rate: f64,
}

impl Default for SpeedView {
    /// A generic replica: 8k prefill tokens/s, 20 ms overhead, 2,048-token chunks.
    fn default() -> Self {
        SpeedView {
            overhead_s: 0.02,
            seconds_per_token: 1.0 / 8_000.0,
            seconds_per_attention: 0.0,
            queued_prefill_tokens: 0,
            decode_step_s: None,
            current_step_s: None,
            step_now_s: None,
            step_per_context_token_s: 0.0,
            stall_margin_s: 0.0,
            chunk_tokens: 2048,
            step_wait_s: 0.0,
            join_step_s: 0.0,
            reuse_rate: 0.0,
        }
    }
}

/// A replica's predicted cost for one request, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftEstimate {
    /// Predicted time to first token: the rest of the running step, then the larger of the
    /// decode step it joins and overhead + (queued + own uncached tokens) × seconds per token. The decode work the replica's running streams add to each prefill step is in the
    /// learnt slope already: the fit learns from whole measured TTFTs, streams and all. Adding
    /// a decode step per prefill step on top counted it twice (mostly-cached requests were
    /// predicted ~1.6× their measured TTFT, BENCHMARKS issue 35).
    pub ttft_s: f64,
    /// This request's own prefill time (uncached tokens only): how long it stalls each
    /// running stream there.
    pub own_prefill_s: f64,
}

/// The scale of attention work (tokens): `u · (c + u / 2)` is divided by it.
pub const ATTENTION_UNIT: f64 = 4096.0;

impl SpeedView {
    /// The decode step (median inter-token gap) the replica's streams would see with one more
    /// stream of `prompt_tokens`: the step now, moved by that context (`None` before any gap
    /// was seen).
    pub fn step_with(&self, prompt_tokens: u64) -> Option<f64> {
        self.step_now_s
            .or(self.current_step_s)
            .map(|s| s + self.step_per_context_token_s * prompt_tokens as f64)
    }

    /// Predicts a request with `uncached` prompt tokens after `cached` cached ones here.
    pub fn estimate(&self, uncached: u64, cached: u64) -> TtftEstimate {
        let work = self.queued_prefill_tokens + uncached;
        let u = uncached as f64;
        let attention = u * (cached as f64 + u / 2.0) / ATTENTION_UNIT;
        let own_prefill_s = u * self.seconds_per_token + attention * self.seconds_per_attention;
        TtftEstimate {
            ttft_s: self.step_wait_s
                + (self.overhead_s
                    + (work - uncached) as f64 * self.seconds_per_token
                    + own_prefill_s)
                    .max(self.join_step_s),
            own_prefill_s,
        }
    }
}

/// One replica as a policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaView {
    pub name: String,
    pub healthy: bool,
    pub load: LoadSignal,
    pub speed: SpeedView,
}

/// A snapshot of the fleet. Indices into `replicas` are the replica ids policies return.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplicaSet {
    pub replicas: Vec<ReplicaView>,
}

impl ReplicaSet {
    pub fn healthy(&self) -> impl Iterator<Item = (usize, &ReplicaView)> {
        self.replicas.iter().enumerate().filter(|(_, r)| r.healthy)
    }
}

/// What a policy knows about the request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// Hashes of the prompt's full blocks, in order (`protocol::hashing`).
    pub block_hashes: &'a [u64],
    pub prompt_tokens: usize,
    pub block_size: usize,
    /// Per replica (same indices as the set): leading blocks of this prompt the prefix index
    /// believes are cached there, already capped to what the replica could reuse.
    pub matched_blocks: &'a [usize],
    /// Per replica: blocks after its match that sit in its offload tier (CPU memory); empty
    /// when no replica reports one.
    pub offloaded_blocks: &'a [usize],
    pub session_id: Option<&'a str>,
    /// The inter-token promise (p95 gap, s) the request's stream is held to: its route's, or
    /// the strictest of the routes sharing its replicas; `None` when there is none.
    pub itl_target_s: Option<f64>,
    /// Per replica: recent requests (decayed, the gateway's `prefix_reuse`) that reused the
    /// prefix of this prompt the replica holds — high for a shared system prompt, near zero
    /// for a conversation's own history. Empty when unknown: every prefix counts as shared.
    pub prefix_reuse: &'a [f64],
    /// A preview (`explain`): the policy must not advance any state of its own.
    pub dry_run: bool,
}

impl RouteRequest<'_> {
    pub fn matched(&self, replica: usize) -> usize {
        self.matched_blocks.get(replica).copied().unwrap_or(0)
    }

    pub fn offloaded(&self, replica: usize) -> usize {
        self.offloaded_blocks.get(replica).copied().unwrap_or(0)
    }

    /// Recent reuses of the prefix `replica` holds; infinite when the caller does not know.
    pub fn reuse(&self, replica: usize) -> f64 {
        if self.prefix_reuse.is_empty() {
            return f64::INFINITY;
        }
        self.prefix_reuse.get(replica).copied().unwrap_or(0.0)
    }
}

/// Why a replica was chosen; its `label` is the bounded metrics label.
#[derive(Debug, Clone, PartialEq)]
pub enum DecisionReason {
    RoundRobin,
    LeastLoad,
    /// Consistent hashing; `hops` replicas were skipped because they were over their bound.
    ConsistentHash {
        hops: usize,
    },
    /// Sticky session.
    Session,
    /// No session id: the fallback policy decided.
    SessionFallback(Box<DecisionReason>),
    /// The replica with the longest cached prefix won on cost.
    PrefixMatch {
        blocks: usize,
    },
    /// No replica holds any of the prefix; the cheapest by load won.
    NoMatch,
    /// Affinity pointed at `preferred`, which was overloaded against the least-loaded replica.
    LoadGuard {
        preferred: usize,
        preferred_blocks: usize,
    },
    /// Every replica's streams would break the inter-token promise with this request: it went
    /// to the one furthest over (`gap_s`, its predicted decode step, against `limit_s`), whose
    /// streams are lost already, rather than push one more replica over.
    Overflow {
        gap_s: f64,
        limit_s: f64,
    },
    /// A hot prefix spread: `holder` has the longest cached run of this prompt, but its
    /// predicted TTFT (queued prefill, batch) was beyond this replica's, so this one prefills
    /// the prefix and becomes a holder too.
    Spread {
        holder: usize,
        holder_blocks: usize,
        holder_ttft_s: f64,
        chosen_ttft_s: f64,
        /// Set when the holder was passed over for the inter-token promise rather than for
        /// its predicted TTFT.
        holder_itl: Option<ItlOver>,
    },
}

/// A replica whose running streams would see a decode step over the inter-token limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ItlOver {
    /// The decode step its streams would see with this request (their median gap moved by the
    /// context in flight and this prompt; s).
    pub step_s: f64,
    /// The limit it was held to: the promise × the policy's `itl_headroom` (s).
    pub limit_s: f64,
    /// Recent requests that reused the prefix of this prompt it holds (why passing it over is
    /// worth a cold prefill elsewhere); `None` when it holds none, or the count is unknown.
    pub reuse: Option<f64>,
}

impl DecisionReason {
    pub fn label(&self) -> &'static str {
        match self {
            DecisionReason::RoundRobin => "round_robin",
            DecisionReason::LeastLoad => "least_load",
            DecisionReason::ConsistentHash { hops: 0 } => "hash",
            DecisionReason::ConsistentHash { .. } => "hash_overflow",
            DecisionReason::Session => "session",
            DecisionReason::SessionFallback(_) => "session_fallback",
            DecisionReason::PrefixMatch { .. } => "prefix_match",
            DecisionReason::NoMatch => "no_match",
            DecisionReason::LoadGuard { .. } => "load_guard",
            DecisionReason::Spread { .. } => "spread",
            DecisionReason::Overflow { .. } => "itl_overflow",
        }
    }
}

impl fmt::Display for DecisionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecisionReason::PrefixMatch { blocks } => write!(f, "prefix_match({blocks} blocks)"),
            DecisionReason::Overflow { gap_s, limit_s } => write!(
                f,
                "itl_overflow(every replica's streams would break the inter-token promise; this \
                 one's are furthest over, at a {:.0} ms step against the {:.0} ms limit)",
                gap_s * 1e3,
                limit_s * 1e3
            ),
            DecisionReason::ConsistentHash { hops } if *hops > 0 => {
                write!(f, "hash_overflow({hops} hops)")
            }
            DecisionReason::LoadGuard {
                preferred,
                preferred_blocks,
            } => write!(
                f,
                "load_guard(preferred replica {preferred} with {preferred_blocks} blocks was overloaded)"
            ),
            DecisionReason::Spread {
                holder,
                holder_blocks,
                holder_ttft_s,
                chosen_ttft_s,
                holder_itl,
            } => match holder_itl {
                Some(o) => {
                    write!(f, "spread(replica {holder} holds {holder_blocks} blocks")?;
                    if let Some(n) = o.reuse {
                        write!(f, " of a prefix {n:.1} recent requests reused")?;
                    }
                    write!(
                        f,
                        " but its streams would see a {:.0} ms decode step, over the {:.0} ms limit \
                         for the inter-token promise; predicted TTFT {holder_ttft_s:.3} s \
                         there, {chosen_ttft_s:.3} s here)",
                        o.step_s * 1e3,
                        o.limit_s * 1e3
                    )
                }
                None => write!(
                    f,
                    "spread(replica {holder} holds {holder_blocks} blocks but its predicted TTFT \
                     {holder_ttft_s:.3} s exceeds {chosen_ttft_s:.3} s here)"
                ),
            },
            DecisionReason::SessionFallback(inner) => write!(f, "session_fallback/{inner}"),
            other => f.write_str(other.label()),
        }
    }
}

/// A replica's standing in a cost-based decision (for `explain`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaScore {
    pub replica: usize,
    pub matched_blocks: usize,
    pub load: u32,
    /// Lower wins: seconds under the `ttft` cost, token-equivalents under `tokens`.
    pub cost: f64,
    /// The prediction behind a `ttft` cost.
    pub estimate: Option<TtftEstimate>,
    /// Under `ttft`: what the cost adds for prefilling again what another replica holds of
    /// the prompt while this one has prefill queued (`recompute_weight`; s, 0 when none).
    pub recompute_s: f64,
    /// Under `ttft`: what the cost adds for the waiting this request's own prefill would
    /// impose on the requests expected to arrive for what the replica holds
    /// (`displace_weight`; s, 0 when none).
    pub displace_s: f64,
    /// Under `ttft` with `itl_headroom`: its streams see a decode step over the limit and what
    /// it holds of the prompt is shared (or nothing), so it is passed over while another
    /// replica keeps the limit.
    pub itl_over: Option<ItlOver>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RouteDecision {
    pub replica: usize,
    pub reason: DecisionReason,
    /// Blocks of the prompt the index believes the chosen replica holds.
    pub matched_blocks: usize,
    /// Every healthy replica's score, where the policy scores (prefix_aware).
    pub scores: Vec<ReplicaScore>,
    /// A replica to send this prompt to as well, for one token, so that it holds the prefix
    /// before the chosen holder breaks a promise (prefix_aware's warming).
    pub warm: Option<Warm>,
}

/// A second (third, ...) holder added ahead of the burst: the gateway sends the prompt there
/// for one token, so later requests of a hot prefix find it cached.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Warm {
    pub replica: usize,
    pub reason: WarmReason,
}

/// What pressed every holder of the prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmReason {
    /// Its streams would see a decode step over the warming share of the inter-token promise.
    InterToken,
    /// Its queued prefill put its predicted TTFT over the warming share of a cold replica's.
    Queue,
}

impl WarmReason {
    /// The bounded metrics label.
    pub fn label(self) -> &'static str {
        match self {
            WarmReason::InterToken => "inter_token",
            WarmReason::Queue => "queue",
        }
    }
}

impl RouteDecision {
    /// The predicted time to first token at the chosen replica, where the policy predicts.
    pub fn predicted_ttft_s(&self) -> Option<f64> {
        self.scores
            .iter()
            .find(|s| s.replica == self.replica)?
            .estimate
            .map(|e| e.ttft_s)
    }

    pub fn new(replica: usize, reason: DecisionReason, req: &RouteRequest<'_>) -> Self {
        RouteDecision {
            replica,
            reason,
            matched_blocks: req.matched(replica),
            scores: Vec::new(),
            warm: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    NoHealthyReplica,
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteError::NoHealthyReplica => f.write_str("no healthy replica is available"),
        }
    }
}

impl std::error::Error for RouteError {}

/// Something a policy may want to learn from (replica churn, completions, cache events).
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyEvent {
    ReplicaAdded(String),
    ReplicaRemoved(String),
    RequestDone { replica: usize },
}

/// What a policy's scores are measured in (`explain` prints it next to the costs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostUnit {
    /// Predicted time to first token plus the stall imposed on running streams.
    Seconds,
    /// Uncached prompt tokens, with load and KV usage in token equivalents.
    TokenEquivalents,
    /// The policy does not score replicas.
    None,
}

impl CostUnit {
    pub fn describe(self) -> &'static str {
        match self {
            CostUnit::Seconds => {
                "seconds: predicted TTFT, with the fleet's smallest fixed overhead in place of the replica's own, plus stall_weight x the stall imposed on running streams, plus recompute_charge_s for repeating behind a queue what another replica holds, plus displace_charge_s for the wait its own prefill would impose on the requests expected for that replica's cache; lower wins"
            }
            CostUnit::TokenEquivalents => {
                "token equivalents: uncached prompt tokens + load and KV usage weights; lower wins"
            }
            CostUnit::None => "this policy does not score replicas",
        }
    }
}

pub trait RoutingPolicy: Send + Sync + 'static {
    /// The config `kind` and the metrics label.
    fn name(&self) -> &'static str;
    /// What the `cost` of its scores is measured in.
    fn cost_unit(&self) -> CostUnit {
        CostUnit::None
    }
    fn route(
        &self,
        req: &RouteRequest<'_>,
        replicas: &ReplicaSet,
    ) -> Result<RouteDecision, RouteError>;
    fn observe(&self, _event: &PolicyEvent) {}
}

/// A fabricated fleet for tests: `loads[i]` requests in flight at replica i, all healthy.
#[cfg(test)]
pub(crate) fn fleet(loads: &[u32]) -> ReplicaSet {
    ReplicaSet {
        replicas: loads
            .iter()
            .enumerate()
            .map(|(i, &l)| ReplicaView {
                name: format!("r{i}"),
                healthy: true,
                load: LoadSignal {
                    in_flight: l,
                    ..LoadSignal::default()
                },
                speed: SpeedView::default(),
            })
            .collect(),
    }
}

#[cfg(test)]
pub(crate) fn request<'a>(hashes: &'a [u64], matched: &'a [usize]) -> RouteRequest<'a> {
    RouteRequest {
        block_hashes: hashes,
        prompt_tokens: hashes.len() * 16 + 5,
        block_size: 16,
        matched_blocks: matched,
        offloaded_blocks: &[],
        session_id: None,
        itl_target_s: None,
        prefix_reuse: &[],
        dry_run: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_cached_context_makes_new_tokens_dearer_only_where_attention_is_learnt() {
        let s = SpeedView {
            seconds_per_attention: 0.001,
            ..SpeedView::default()
        };
        let (cold, warm) = (s.estimate(100, 0), s.estimate(100, 4096));
        // 100 new tokens attending to 4,096 more: 100 × 4,096 / 4,096 = 100 units more.
        assert!(
            (warm.ttft_s - cold.ttft_s - 0.1).abs() < 1e-9,
            "{cold:?} {warm:?}"
        );
        assert!((warm.own_prefill_s - cold.own_prefill_s - 0.1).abs() < 1e-9);
        let flat = SpeedView::default();
        assert_eq!(flat.estimate(100, 4096), flat.estimate(100, 0));
    }

    #[test]
    fn the_rest_of_the_running_step_comes_first_and_stalls_nobody() {
        let idle = SpeedView::default();
        let busy = SpeedView {
            step_wait_s: 0.07,
            ..idle
        };
        let (a, b) = (idle.estimate(50, 1000), busy.estimate(50, 1000));
        assert!((b.ttft_s - a.ttft_s - 0.07).abs() < 1e-12, "{a:?} {b:?}");
        assert_eq!(a.own_prefill_s, b.own_prefill_s);
        // Joining a 100 ms decode step: 50 tokens (26 ms of prefill) take the whole step, 2,000
        // (270 ms) set it.
        let joined = SpeedView {
            join_step_s: 0.1,
            ..busy
        };
        let small = joined.estimate(50, 1000).ttft_s;
        assert!((small - 0.17).abs() < 1e-12, "{small}");
        assert_eq!(joined.estimate(2000, 0), busy.estimate(2000, 0));
    }
}
