//! Warming: a hot prefix gets another holder before its holders break a promise.
//!
//! Spreading by price (the cost, and the inter-token check) moves a request off its holder
//! only once the holder is already slow, and that request then pays the cold prefill — a
//! 3,000-token system prompt costs about a second on an L4 — with the rest of its burst
//! waiting behind it. Warming acts a step earlier: when a request of a prefix that at least
//! `warm_min_reuse` recent requests reused goes to a holder, and every replica holding as much
//! of it is *pressed* — its streams would see a decode step over `warm_headroom` × the
//! inter-token promise, or its queued prefill puts its predicted TTFT over `warm_queue_share` ×
//! the best cold replica's — the decision names a replica to warm: the cheapest of those holding
//! less that would keep within the inter-token limit and is not pressed itself. The gateway
//! sends it the prompt for one token (`gateway/src/request/warm.rs`); the next requests of
//! the prefix find a second holder, priced like any other. Once it holds the prefix it is a
//! holder too, so a third is warmed only when both are pressed.

use config::policy::CostModel;

use crate::types::*;

use super::PrefixAware;

impl PrefixAware {
    /// The replica to warm with this prompt, when `chosen` is a pressed holder of a hot
    /// prefix and every replica holding as much is pressed too.
    pub(super) fn warm(
        &self,
        req: &RouteRequest<'_>,
        set: &ReplicaSet,
        scores: &[ReplicaScore],
        chosen: &ReplicaScore,
    ) -> Option<Warm> {
        let reuse = req.reuse(chosen.replica);
        if self.cfg.cost != CostModel::Ttft
            || chosen.matched_blocks == 0
            || !reuse.is_finite()
            || reuse < self.cfg.warm_min_reuse
        {
            return None;
        }
        let ttft = |s: &ReplicaScore| s.estimate.map(|e| e.ttft_s);
        let cold = scores
            .iter()
            .filter(|s| s.matched_blocks == 0)
            .filter_map(ttft)
            .min_by(f64::total_cmp);
        let pressed = |s: &ReplicaScore| {
            if self.steps_near_promise(req, set, s.replica) {
                return Some(WarmReason::InterToken);
            }
            let share = self.cfg.warm_queue_share;
            let queued = ttft(s).zip(cold).is_some_and(|(t, c)| t > share * c);
            (share > 0.0 && queued).then_some(WarmReason::Queue)
        };
        let reason = pressed(chosen)?;
        let mut holders = scores
            .iter()
            .filter(|s| s.matched_blocks >= chosen.matched_blocks);
        if !holders.all(|s| pressed(s).is_some()) {
            return None;
        }
        let target = scores
            .iter()
            .filter(|s| s.matched_blocks < chosen.matched_blocks && s.itl_over.is_none())
            .filter(|s| !self.steps_near_promise(req, set, s.replica))
            .min_by(|a, b| a.cost.total_cmp(&b.cost))?;
        Some(Warm {
            replica: target.replica,
            reason,
        })
    }
}
