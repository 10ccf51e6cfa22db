//! The policy file (`config/policy.toml`): what the operator tunes while the gateway runs —
//! routes with their match rules, replica pools, routing policy, limits, queue and latency
//! promise (SLO), plus the admission thresholds. The gateway reloads it on SIGHUP and when the
//! file changes; [`PolicyFile::from_toml`] validates everything first, so a bad edit is
//! rejected whole with `field / value / reason` errors and the running policy stays.
//!
//! ```toml
//! [policy]
//! kind = "prefix_aware"
//!
//! [[routes]]
//! name = "long"
//! min_prompt_tokens = 8192
//! max_concurrency = 2
//! slo = { ttft_ms = 10000, itl_ms = 80 }
//!
//! [[routes]]
//! name = "interactive"
//! slo = { ttft_ms = 1000, itl_ms = 50 }
//! ```
//!
//! A request takes the first route whose rules all hold; the last route must have no rules, so
//! every request has one.

use std::fmt;

use serde::Deserialize;

use crate::error::{ConfigError, Validator};
use crate::policy::PolicyConfig;

/// `config/policy.toml`, the default `kvgate up` runs with.
pub const DEFAULT_POLICY: &str = include_str!("../policy.toml");

/// The policy `kvgate up --backend cpu` embeds: the same routes with promises a CPU keeps.
pub const CPU_POLICY: &str = include_str!("../policy-cpu.toml");

/// The `x-kvgate-priority` classes; interactive when the header is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    #[default]
    Interactive,
    Batch,
}

impl Priority {
    pub const HEADER: &'static str = "x-kvgate-priority";

    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "interactive" => Some(Priority::Interactive),
            "batch" => Some(Priority::Batch),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }

    /// Queue order: lower first.
    pub fn rank(self) -> i32 {
        match self {
            Priority::Interactive => 0,
            Priority::Batch => 1,
        }
    }
}

/// A replica in a route's pool: its `host:port` as listed in the gateway file, or its index
/// in that list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum PoolEntry {
    Index(usize),
    Name(String),
}

impl fmt::Display for PoolEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolEntry::Index(i) => write!(f, "{i}"),
            PoolEntry::Name(n) => write!(f, "{n:?}"),
        }
    }
}

/// Indices into `replicas` of the entries of a pool (entries naming no replica are left out).
pub fn resolve_pool(entries: &[PoolEntry], replicas: &[String]) -> Vec<usize> {
    let mut out: Vec<usize> = entries
        .iter()
        .filter_map(|e| match e {
            PoolEntry::Index(i) => (*i < replicas.len()).then_some(*i),
            PoolEntry::Name(n) => replicas.iter().position(|x| x == n),
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// p95 latency targets; an absent field is no promise on that timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SloConfig {
    pub ttft_ms: Option<u64>,
    pub itl_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Metrics label and `x-kvgate-route` value.
    pub name: String,
    /// Rule: the prompt has at least this many tokens.
    #[serde(default)]
    pub min_prompt_tokens: Option<usize>,
    /// Rule: the request's `x-kvgate-priority` class.
    #[serde(default)]
    pub priority: Option<Priority>,
    /// The served models this route is for (their names in the gateway file; empty: every
    /// model). Each model's routes are the file's routes for it, in order, and the last of
    /// them must have no other rule.
    #[serde(default)]
    pub models: Vec<String>,
    /// Replicas this route may use (empty: all). Pools may overlap.
    #[serde(default)]
    pub pool: Vec<PoolEntry>,
    /// Routing policy among the pool's admissible replicas (default: the file's `[policy]`).
    #[serde(default)]
    pub policy: Option<PolicyConfig>,
    /// Requests of this route in flight at once (none: unlimited).
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// Prompt tokens of this route's in-flight requests (none: unlimited).
    #[serde(default)]
    pub max_prompt_tokens_in_flight: Option<u64>,
    /// Requests waiting for admission; beyond it they are shed at once.
    #[serde(default = "default_queue_size")]
    pub queue_size: usize,
    /// Longest wait in the queue (a TTFT promise may shed sooner).
    #[serde(default = "default_queue_timeout")]
    pub queue_timeout_ms: u64,
    #[serde(default)]
    pub slo: SloConfig,
    /// false: dispatch at once without SLO, queue or leading-indicator checks (limits still
    /// apply). For comparisons; production routes keep it on.
    #[serde(default = "default_true")]
    pub admission: bool,
    /// Longest prompt this route accepts, in tokens (400 beyond; none: the model's limit).
    #[serde(default)]
    pub max_prompt_tokens: Option<usize>,
    /// The `priority` the gateway writes into the body for the replica's scheduler (vLLM's
    /// convention: lower first). 0 leaves the field out, which engines without priority
    /// scheduling require. A client's own `priority` is never forwarded.
    #[serde(default)]
    pub engine_priority: i32,
    /// A stream with no chunk for this long is cut with an error event. Default: 40 × the
    /// route's inter-token target, between 2 s and 60 s (60 s without a target).
    #[serde(default)]
    pub stream_idle_timeout_ms: Option<u64>,
}

impl RouteConfig {
    /// A route with no rules, limits or promise over every replica.
    pub fn catch_all(name: &str) -> Self {
        RouteConfig {
            name: name.into(),
            min_prompt_tokens: None,
            priority: None,
            models: Vec::new(),
            pool: Vec::new(),
            policy: None,
            max_concurrency: None,
            max_prompt_tokens_in_flight: None,
            queue_size: default_queue_size(),
            queue_timeout_ms: default_queue_timeout(),
            slo: SloConfig::default(),
            admission: true,
            max_prompt_tokens: None,
            engine_priority: 0,
            stream_idle_timeout_ms: None,
        }
    }

    /// The per-chunk deadline of a stream on this route.
    pub fn stream_idle_timeout(&self) -> std::time::Duration {
        let ms = self
            .stream_idle_timeout_ms
            .unwrap_or_else(|| match self.slo.itl_ms {
                Some(itl) => (itl * 40).clamp(2_000, 60_000),
                None => 60_000,
            });
        std::time::Duration::from_millis(ms)
    }

    /// Whether a request with `prompt_tokens` tokens and `priority` takes this route.
    pub fn matches(&self, prompt_tokens: usize, priority: Priority) -> bool {
        self.min_prompt_tokens.is_none_or(|m| prompt_tokens >= m)
            && self.priority.is_none_or(|p| p == priority)
    }

    fn has_rules(&self) -> bool {
        self.min_prompt_tokens.is_some() || self.priority.is_some()
    }

    /// Whether every request that reaches this route (of a model it applies to) takes it: it
    /// has no rule but `models`. The routes after it never see that model's requests.
    pub fn takes_every_request(&self) -> bool {
        !self.has_rules()
    }

    /// Whether the route is for requests to `model`.
    pub fn applies_to(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    /// Whether this route and `o` can take requests to the same model.
    fn shares_a_model(&self, o: &RouteConfig) -> bool {
        self.models.is_empty()
            || o.models.is_empty()
            || self.models.iter().any(|m| o.models.contains(m))
    }
}

/// What clients are told about prefix-cache hits (`usage.prompt_tokens_details.cached_tokens`
/// and the `x-kvgate-matched-blocks` header). Exact block counts let a client test guesses
/// about prompts that share its cache (a right guess matches one block more); rounding makes
/// a guess cost a whole rounding unit, and `off` removes the signal. Time to first token still
/// leaks a hit; only separate caches (per-tenant `cache_salt`) close the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HitSignals {
    Exact,
    /// Rounded down to `hit_signal_round_tokens`.
    #[default]
    Rounded,
    Off,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    /// Shown by `GET /admin/policy`; a hash of the text when absent.
    #[serde(default)]
    pub version: Option<String>,
    /// A busy replica whose KV usage — as last reported, plus the prompts sent since and this
    /// one — would exceed this gets no new request: past it, requests wait at the replica for
    /// memory or push others out (preemption). The rest leaves room for decode growth.
    #[serde(default = "default_kv_high_water")]
    pub kv_high_water: f64,
    /// After a replica reports new preemptions, it gets no new request for this long.
    #[serde(default = "default_preemption_holdoff")]
    pub preemption_holdoff_ms: u64,
    /// Share of each latency target admission plans to use; the rest absorbs prediction
    /// error (the model learns from the past, the promise is about the future).
    #[serde(default = "default_headroom")]
    pub admission_headroom: f64,
    /// A request whose cached prefix at its chosen replica is still being prefilled there by
    /// an earlier request (blocks sent there that the replica's KV events have not confirmed
    /// yet) waits at the gateway until they are confirmed, for at most this long, instead of
    /// prefilling the unfinished part a second time beside the first. 0: off. Only replicas
    /// with live KV events are waited for.
    #[serde(default = "default_prefix_in_flight_wait")]
    pub prefix_in_flight_wait_ms: u64,
    /// What clients learn about cache hits.
    #[serde(default)]
    pub hit_signals: HitSignals,
    /// The rounding unit of `hit_signals = "rounded"`, in tokens.
    #[serde(default = "default_round_tokens")]
    pub hit_signal_round_tokens: u32,
    /// Tenants (from API keys) listed together share one prefix cache; every other tenant has
    /// its own (`cache_salt`). Without API keys there is one anonymous tenant.
    #[serde(default)]
    pub cache_groups: Vec<Vec<String>>,
    /// The routing policy of routes that name none.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// In match order; none: one catch-all route `default`.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
}

fn default_queue_size() -> usize {
    256
}
fn default_queue_timeout() -> u64 {
    5_000
}
fn default_true() -> bool {
    true
}
fn default_kv_high_water() -> f64 {
    0.9
}
fn default_headroom() -> f64 {
    0.9
}
fn default_prefix_in_flight_wait() -> u64 {
    1_000
}
fn default_preemption_holdoff() -> u64 {
    2_000
}
fn default_round_tokens() -> u32 {
    256
}

impl PolicyFile {
    /// A file with one catch-all route using `policy` and no promise.
    pub fn single(policy: PolicyConfig) -> Self {
        PolicyFile {
            version: None,
            kv_high_water: default_kv_high_water(),
            preemption_holdoff_ms: default_preemption_holdoff(),
            admission_headroom: default_headroom(),
            prefix_in_flight_wait_ms: default_prefix_in_flight_wait(),
            hit_signals: HitSignals::default(),
            hit_signal_round_tokens: default_round_tokens(),
            cache_groups: Vec::new(),
            policy,
            routes: vec![RouteConfig::catch_all("default")],
        }
    }

    /// Parses and validates; `replicas` is the gateway's replica list, which pools name.
    /// A file must name its routes or a `[policy]`: an empty or cut-short file would otherwise
    /// silently become one catch-all route without any promise or limit.
    pub fn from_toml(text: &str, replicas: &[String]) -> Result<Self, ConfigError> {
        let table: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        if !table.contains_key("routes") && !table.contains_key("policy") {
            return Err(ConfigError::Invalid(vec![crate::FieldError {
                field: "routes".into(),
                value: if text.trim().is_empty() {
                    "(empty file)".into()
                } else {
                    "(absent)".into()
                },
                reason: "a policy file must list its [[routes]] or name a [policy]; an empty or truncated file is refused".into(),
            }]));
        }
        let mut f: PolicyFile =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        if f.routes.is_empty() {
            f.routes.push(RouteConfig::catch_all("default"));
        }
        f.validate(replicas)?;
        Ok(f)
    }

    /// The tenant whose salt `tenant` uses: the first member of its cache group, or itself.
    pub fn cache_owner<'a>(&'a self, tenant: &'a str) -> &'a str {
        self.cache_groups
            .iter()
            .find(|g| g.iter().any(|t| t == tenant))
            .and_then(|g| g.first())
            .map_or(tenant, String::as_str)
    }

    /// Whether the routes fit the served `models`: each model has a route with no rule but
    /// `models` (so every request to it has a route: its routes end at the first such one),
    /// and every model a route names is served (by its name; aliases are not names here).
    pub fn check_models(&self, models: &[&str]) -> Result<(), ConfigError> {
        let mut v = Validator::new();
        for m in models {
            v.check(
                self.routes
                    .iter()
                    .any(|r| r.applies_to(m) && r.takes_every_request()),
                "routes",
                format!("{m:?}"),
                "this model has no route without rules (min_prompt_tokens, priority), so some of its requests would have no route; add a catch-all for it",
            );
        }
        for (i, r) in self.routes.iter().enumerate() {
            for name in &r.models {
                v.check(
                    models.contains(&name.as_str()),
                    &format!("routes[{i}].models"),
                    format!("{name:?}"),
                    &format!("not a served model (served: {})", models.join(", ")),
                );
            }
        }
        v.finish()
    }

    /// The route a request takes (validation guarantees one matches).
    pub fn classify(&self, prompt_tokens: usize, priority: Priority) -> usize {
        self.routes
            .iter()
            .position(|r| r.matches(prompt_tokens, priority))
            .unwrap_or(self.routes.len() - 1)
    }

    /// Indices into `replicas` of route `i`'s pool.
    pub fn pool(&self, i: usize, replicas: &[String]) -> Vec<usize> {
        let r = &self.routes[i];
        if r.pool.is_empty() {
            return (0..replicas.len()).collect();
        }
        resolve_pool(&r.pool, replicas)
    }

    pub fn validate(&self, replicas: &[String]) -> Result<(), ConfigError> {
        let mut v = Validator::new();
        v.check(
            self.kv_high_water.is_finite() && self.kv_high_water > 0.0 && self.kv_high_water <= 1.0,
            "kv_high_water",
            self.kv_high_water,
            "must be in (0, 1]",
        );
        v.check(
            self.admission_headroom.is_finite()
                && self.admission_headroom > 0.0
                && self.admission_headroom <= 1.0,
            "admission_headroom",
            self.admission_headroom,
            "must be in (0, 1]",
        );
        v.check(
            self.prefix_in_flight_wait_ms <= 60_000,
            "prefix_in_flight_wait_ms",
            self.prefix_in_flight_wait_ms,
            "must be at most 60000 (a prefill that takes longer is not in flight, it is stuck)",
        );
        v.check(
            !self.routes.is_empty(),
            "routes",
            "[]",
            "list at least one route",
        );
        v.check(
            self.hit_signal_round_tokens >= 1,
            "hit_signal_round_tokens",
            self.hit_signal_round_tokens,
            "must be at least 1",
        );
        for (i, g) in self.cache_groups.iter().enumerate() {
            v.check(
                g.len() >= 2,
                &format!("cache_groups[{i}]"),
                format!("{g:?}"),
                "a cache group lists at least two tenants",
            );
            for t in g {
                v.check(
                    self.cache_groups[..i].iter().all(|o| !o.contains(t)),
                    &format!("cache_groups[{i}]"),
                    format!("{t:?}"),
                    "a tenant belongs to at most one cache group",
                );
            }
        }
        if let Some(last) = self.routes.last() {
            v.check(
                !last.has_rules(),
                &format!("routes[{}]", self.routes.len() - 1),
                format!("{:?}", last.name),
                "the last route must have no rules (min_prompt_tokens, priority) so every request has a route",
            );
        }
        for (i, r) in self.routes.iter().enumerate() {
            let f = |name: &str| format!("routes[{i}].{name}");
            v.check(
                !r.name.is_empty()
                    && r.name.len() <= 64
                    && r.name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'),
                &f("name"),
                format!("{:?}", r.name),
                "must be 1-64 letters, digits, '_' or '-'",
            );
            v.check(
                !self.routes[..i]
                    .iter()
                    .any(|o| o.name == r.name && o.shares_a_model(r)),
                &f("name"),
                format!("{:?}", r.name),
                "route names must be unique (among the routes of one model)",
            );
            for (j, e) in r.pool.iter().enumerate() {
                let known = match e {
                    PoolEntry::Index(x) => *x < replicas.len(),
                    PoolEntry::Name(n) => replicas.contains(n),
                };
                v.check(
                    known,
                    &format!("routes[{i}].pool[{j}]"),
                    e,
                    "not one of the gateway's replicas (give host:port as listed there, or its index)",
                );
            }
            v.check(
                r.max_concurrency != Some(0),
                &f("max_concurrency"),
                0,
                "must be at least 1 (omit it for no limit)",
            );
            v.check(
                r.max_prompt_tokens != Some(0),
                &f("max_prompt_tokens"),
                0,
                "must be at least 1 (omit it for the model's limit)",
            );
            v.check(
                r.stream_idle_timeout_ms.is_none_or(|t| t >= 100),
                &f("stream_idle_timeout_ms"),
                r.stream_idle_timeout_ms.unwrap_or(0),
                "must be at least 100",
            );
            v.check(
                r.max_prompt_tokens_in_flight != Some(0),
                &f("max_prompt_tokens_in_flight"),
                0,
                "must be at least 1 (omit it for no limit)",
            );
            v.check(
                r.queue_size <= 1_000_000,
                &f("queue_size"),
                r.queue_size,
                "must be at most 1000000",
            );
            v.check(
                r.queue_timeout_ms <= 3_600_000,
                &f("queue_timeout_ms"),
                r.queue_timeout_ms,
                "must be at most 3600000 (one hour)",
            );
            for (name, x) in [("slo.ttft_ms", r.slo.ttft_ms), ("slo.itl_ms", r.slo.itl_ms)] {
                v.check(
                    x != Some(0),
                    &f(name),
                    0,
                    "must be at least 1 (omit it for no promise)",
                );
            }
            if let Some(p) = &r.policy {
                if let Err(ConfigError::Invalid(errs)) = p.validate(&f("policy")) {
                    for e in errs {
                        v.check(false, &e.field, e.value, &e.reason);
                    }
                }
            }
        }
        if let Err(ConfigError::Invalid(errs)) = self.policy.validate("policy") {
            for e in errs {
                v.check(false, &e.field, e.value, &e.reason);
            }
        }
        v.finish()
    }
}

#[cfg(test)]
mod tests;
