//! The active policy and its hot reload. A [`PolicyStore`] holds the validated policy file
//! turned into routes (each with its built routing policy, pool and runtime), behind an
//! `ArcSwap`: a request loads the current `Arc` once and keeps it to the end, so a reload never
//! changes the rules under a request in flight. A reload reads the file, validates all of it,
//! builds every policy, and only then swaps; a rejected file leaves the old policy in place and
//! is reported in the log, the metrics and `GET /admin/policy`.
//!
//! A route's runtime (queue, in-flight counts, goodput window) is kept across reloads by route
//! name, so limits stay exact while the file changes.
//!
//! With several models (`[[models]]`), every route of the file exists once per model, over the
//! replicas of its pool that serve the model, with its own runtime keyed `model/route`: each
//! model's queue, limits and promise are its own, and the fleet-wide checks (the strictest
//! inter-token promise on a replica) see every model's routes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use config::routes::PoolEntry;
use config::{ConfigError, PolicyFile, RouteConfig};
use parking_lot::Mutex;
use policies::RoutingPolicy;
use protocol::slo::Slo;
use protocol::time::unix_now;

use crate::metrics::{GatewayMetrics, ModelTokens};

mod describe;
use crate::routes::model_scope::ModelScope;
use crate::routes::runtime::RouteRuntime;

/// One route of the active policy (for one model).
pub struct ActiveRoute {
    pub cfg: RouteConfig,
    /// The model's position among the served models.
    pub model: usize,
    /// The model's prompt and predicted-hit token counters.
    pub model_tokens: ModelTokens,
    pub policy: Box<dyn RoutingPolicy>,
    /// Replica slots of the pool.
    pub pool: Vec<usize>,
    pub slo: Slo,
    pub rt: Arc<RouteRuntime>,
}

impl ActiveRoute {
    /// Its requests are background work at the replica: the batch class sent with an
    /// `engine_priority` above 0, served after interactive work (`fleet/guards.rs`).
    pub fn background(&self) -> bool {
        self.cfg.priority == Some(config::Priority::Batch) && self.cfg.engine_priority > 0
    }
}

pub struct ActivePolicy {
    pub file: PolicyFile,
    /// The file's `version`, or a hash of its text.
    pub version: String,
    /// 1 for the first accepted file, +1 per accepted reload.
    pub generation: u64,
    pub loaded_at_unix: u64,
    /// The file's routes for each served model (those whose `models` rule takes it), model
    /// by model; `spans` says where each model's run starts and how long it is.
    pub routes: Vec<ActiveRoute>,
    spans: Vec<(usize, usize)>,
    /// Per served model: its name and the replica slots serving it.
    pub models: Vec<(String, Vec<usize>)>,
}

impl ActivePolicy {
    /// The route a request for `model` takes: the first whose rules hold.
    pub fn route(
        &self,
        model: usize,
        prompt_tokens: usize,
        priority: config::Priority,
    ) -> &ActiveRoute {
        let m = model.min(self.spans.len().saturating_sub(1));
        let (start, len) = match self.spans.get(m) {
            Some(&(s, n)) if n > 0 => (s, n),
            _ => (0, self.routes.len()),
        };
        let run = &self.routes[start..start + len];
        // (`check_models` keeps a catch-all last in every model's run.)
        run.iter()
            .find(|r| r.cfg.matches(prompt_tokens, priority))
            .unwrap_or(&run[len - 1])
    }

    /// The position of the model named `name` (its canonical name).
    pub fn model_index(&self, name: &str) -> Option<usize> {
        self.models.iter().position(|(n, _)| n == name)
    }

    /// The replica slots serving `model`.
    pub fn model_pool(&self, model: usize) -> &[usize] {
        self.models.get(model).map_or(&[], |(_, p)| p.as_slice())
    }

    /// The tightest inter-token promise among routes whose pool shares a replica with `pool`.
    pub fn strictest_itl(&self, pool: &[usize]) -> Option<Duration> {
        self.routes
            .iter()
            .filter(|r| r.pool.iter().any(|i| pool.contains(i)))
            .filter_map(|r| r.slo.itl)
            .min()
    }

    /// The longest prompt some route accepts (`None`: one has no limit of its own).
    pub fn max_prompt_tokens(&self) -> Option<usize> {
        self.routes
            .iter()
            .map(|r| r.cfg.max_prompt_tokens)
            .try_fold(0usize, |m, x| x.map(|x| m.max(x)))
    }
}

/// Why the last load failed.
#[derive(Debug, Clone)]
pub struct ReloadError {
    pub at_unix: u64,
    pub message: String,
    pub fields: Vec<config::FieldError>,
}

pub struct PolicyStore {
    active: ArcSwap<ActivePolicy>,
    path: Option<PathBuf>,
    /// The listed replicas, in the gateway file's order, with their registry slots: pools
    /// name replicas by `host:port` or list index, routes hold slots.
    replicas: Mutex<Vec<(usize, String)>>,
    /// The served models, in the gateway file's order (reloaded with the gateway file).
    models: Mutex<Vec<ModelScope>>,
    metrics: Arc<GatewayMetrics>,
    runtimes: Mutex<HashMap<String, Arc<RouteRuntime>>>,
    last_error: Mutex<Option<ReloadError>>,
    /// Hash of the text last tried (accepted or not), so the file watcher acts on changes only.
    last_seen: Mutex<Option<u64>>,
    /// The text hash each accepted `version` had: a file that keeps a version but changes
    /// its text (a truncated or half-written copy) is refused.
    versions: Mutex<HashMap<String, u64>>,
}

fn text_hash(text: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(text.as_bytes())
}

impl PolicyStore {
    /// The store for `file` (already validated), read from `path` when it came from one, for
    /// the served `models`.
    pub fn new(
        file: PolicyFile,
        text: Option<&str>,
        path: Option<PathBuf>,
        replicas: Vec<(usize, String)>,
        models: Vec<ModelScope>,
        metrics: Arc<GatewayMetrics>,
    ) -> Self {
        let runtimes = Mutex::new(HashMap::new());
        let version = file.version.clone().unwrap_or_else(|| match text {
            Some(t) => format!("{:012x}", text_hash(t) >> 16),
            None => "inline".into(),
        });
        let active = build(file, version, 1, &replicas, &models, &metrics, &runtimes);
        metrics.policy_generation.set(1.0);
        metrics.policy_reload(true);
        let mut versions = HashMap::new();
        if let (Some(v), Some(t)) = (&active.file.version, text) {
            versions.insert(v.clone(), text_hash(t));
        }
        PolicyStore {
            versions: Mutex::new(versions),
            active: ArcSwap::from_pointee(active),
            path,
            replicas: Mutex::new(replicas),
            models: Mutex::new(models),
            metrics,
            runtimes,
            last_error: Mutex::new(None),
            last_seen: Mutex::new(text.map(text_hash)),
        }
    }

    /// The replica list in force, in the gateway file's order.
    pub fn replica_names(&self) -> Vec<String> {
        self.names()
    }

    fn names(&self) -> Vec<String> {
        self.replicas
            .lock()
            .iter()
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// Whether the active policy and the models' pools still hold with `names` as the replica
    /// list (a pool may name a replica the new list drops).
    pub fn check_replicas(&self, names: &[String]) -> Result<(), ConfigError> {
        let models = self.models.lock().clone();
        self.check_fleet(names, &models)
    }

    /// Whether the active policy holds with `names` as the replica list and `models` (their
    /// pools naming replicas of `names`) as the served models.
    pub fn check_fleet(&self, names: &[String], models: &[ModelScope]) -> Result<(), ConfigError> {
        let file = &self.load().file;
        file.validate(names)?;
        file.check_models(&scope_names(models))?;
        let mut v = config::error::Validator::new();
        for m in models {
            for e in &m.pool {
                let known = match e {
                    PoolEntry::Index(x) => *x < names.len(),
                    PoolEntry::Name(n) => names.contains(n),
                };
                v.check(
                    known,
                    &format!("models[{}].replicas", m.name),
                    e,
                    "names a replica the new list drops",
                );
            }
        }
        v.finish()
    }

    /// Rebuilds the active policy over a new replica list (checked with
    /// [`PolicyStore::check_replicas`] first).
    pub fn set_replicas(&self, listed: Vec<(usize, String)>) {
        self.set_fleet(listed, None);
    }

    /// Rebuilds the active policy over a new replica list and, when given, new served models
    /// (checked with [`PolicyStore::check_fleet`] first). The routes of a model that stays
    /// keep their runtimes; a removed model's drain.
    pub fn set_fleet(&self, listed: Vec<(usize, String)>, models: Option<Vec<ModelScope>>) {
        let active = self.load();
        let mut scopes = self.models.lock();
        if let Some(m) = models {
            *scopes = m;
        }
        let next = build(
            active.file.clone(),
            active.version.clone(),
            active.generation + 1,
            &listed,
            &scopes,
            &self.metrics,
            &self.runtimes,
        );
        drop(scopes);
        *self.replicas.lock() = listed;
        self.metrics.policy_generation.set(next.generation as f64);
        self.active.store(Arc::new(next));
    }

    pub fn load(&self) -> Arc<ActivePolicy> {
        self.active.load_full()
    }

    pub fn path(&self) -> Option<&PathBuf> {
        self.path.as_ref()
    }

    /// Every route runtime ever created (routes dropped by a reload keep draining).
    pub fn runtimes(&self) -> Vec<Arc<RouteRuntime>> {
        self.runtimes.lock().values().cloned().collect()
    }

    /// Reads the file and swaps it in if valid. `force`: even when the text did not change
    /// (SIGHUP, `POST /admin/policy/reload`). `Ok(false)`: nothing to do.
    pub fn reload(&self, force: bool) -> Result<bool, ReloadError> {
        let Some(path) = &self.path else {
            return Err(ReloadError {
                at_unix: unix_now(),
                message: "the policy is not read from a file (the gateway file's [policy], or kvgate up's embedded policy): set policy_file in the gateway file, or pass --policy-file to kvgate up, to reload it"
                    .into(),
                fields: Vec::new(),
            });
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                return Err(self.reject(
                    Some(None),
                    format!("cannot read {}: {e}", path.display()),
                    Vec::new(),
                ))
            }
        };
        let h = text_hash(&text);
        if !force && *self.last_seen.lock() == Some(h) {
            return Ok(false);
        }
        let names = self.names();
        let scopes = self.models.lock().clone();
        let served = scope_names(&scopes);
        let file = match PolicyFile::from_toml(&text, &names)
            .and_then(|f| f.check_models(&served).map(|()| f))
        {
            Ok(f) => f,
            Err(e) => {
                let fields = match &e {
                    ConfigError::Invalid(f) => f.clone(),
                    ConfigError::Parse(_) => Vec::new(),
                };
                return Err(self.reject(
                    Some(Some(h)),
                    format!("{} rejected: {e}", path.display()),
                    fields,
                ));
            }
        };
        if let Some(v) = &file.version {
            if self.versions.lock().get(v).is_some_and(|&seen| seen != h) {
                return Err(self.reject(
                    Some(Some(h)),
                    format!(
                        "{} rejected: version {v:?} was loaded before with different content; \
                         change `version` whenever the file changes (a truncated or half-written \
                         file keeps the old version)",
                        path.display()
                    ),
                    vec![config::FieldError {
                        field: "version".into(),
                        value: format!("{v:?}"),
                        reason: "already loaded with different content".into(),
                    }],
                ));
            }
        }
        let generation = self.active.load().generation + 1;
        let version = file
            .version
            .clone()
            .unwrap_or_else(|| format!("{:012x}", h >> 16));
        let next = build(
            file,
            version,
            generation,
            &self.replicas.lock(),
            &self.models.lock(),
            &self.metrics,
            &self.runtimes,
        );
        tracing::info!(version = %next.version, generation, routes = next.routes.len(), "policy loaded");
        if let Some(v) = &next.file.version {
            self.versions.lock().insert(v.clone(), h);
        }
        self.active.store(Arc::new(next));
        *self.last_seen.lock() = Some(h);
        *self.last_error.lock() = None;
        self.metrics.policy_generation.set(generation as f64);
        self.metrics.policy_reload(true);
        Ok(true)
    }

    fn reject(
        &self,
        seen: Option<Option<u64>>,
        message: String,
        fields: Vec<config::FieldError>,
    ) -> ReloadError {
        tracing::error!(%message, "policy reload rejected; the active policy stays");
        if let Some(s) = seen {
            *self.last_seen.lock() = s;
        }
        let e = ReloadError {
            at_unix: unix_now(),
            message,
            fields,
        };
        *self.last_error.lock() = Some(e.clone());
        self.metrics.policy_reload(false);
        e
    }
}

/// The served models' names, as the policy file's `models` rules name them.
fn scope_names(models: &[ModelScope]) -> Vec<&str> {
    models.iter().map(|m| m.name.as_str()).collect()
}

/// The runtime key of route `route` of model `model`: the route's name when one model is
/// served (names and metric labels as before models came), `model/route` otherwise.
fn runtime_key(models: &[ModelScope], model: &str, route: &str) -> String {
    if models.len() <= 1 {
        route.to_string()
    } else {
        format!("{model}/{route}")
    }
}

fn build(
    file: PolicyFile,
    version: String,
    generation: u64,
    replicas: &[(usize, String)],
    models: &[ModelScope],
    metrics: &Arc<GatewayMetrics>,
    runtimes: &Mutex<HashMap<String, Arc<RouteRuntime>>>,
) -> ActivePolicy {
    let names: Vec<String> = replicas.iter().map(|(_, n)| n.clone()).collect();
    let fallback = [ModelScope::every_replica("")];
    let models = if models.is_empty() {
        &fallback[..]
    } else {
        models
    };
    let mut rts = runtimes.lock();
    let mut routes = Vec::with_capacity(models.len() * file.routes.len());
    let mut served = Vec::with_capacity(models.len());
    let mut spans = Vec::with_capacity(models.len());
    for (m, scope) in models.iter().enumerate() {
        let serving = scope.resolve(&names);
        let model_tokens = metrics.model_tokens(&scope.name);
        let start = routes.len();
        for (i, cfg) in file.routes.iter().enumerate() {
            // (The unnamed fallback scope takes every route.)
            if !scope.name.is_empty() && !cfg.applies_to(&scope.name) {
                continue;
            }
            // A model's routes end at its first catch-all: later ones never see its requests.
            if routes[start..]
                .last()
                .is_some_and(|r: &ActiveRoute| r.cfg.takes_every_request())
            {
                tracing::debug!(model = %scope.name, route = %cfg.name, "route never reached for this model (a catch-all comes first)");
                break;
            }
            let key = runtime_key(models, &scope.name, &cfg.name);
            let rt = rts
                .entry(key.clone())
                .or_insert_with(|| Arc::new(RouteRuntime::new(&key, metrics.clone())))
                .clone();
            rt.queue.set_capacity(cfg.queue_size);
            let pool: Vec<usize> = file
                .pool(i, &names)
                .into_iter()
                .filter(|k| serving.contains(k))
                .map(|k| replicas[k].0)
                .collect();
            if pool.is_empty() && !names.is_empty() {
                tracing::warn!(
                    model = %scope.name,
                    route = %cfg.name,
                    "no replica of this route's pool serves the model; its requests on this route \
                     will be refused"
                );
            }
            routes.push(ActiveRoute {
                policy: policies::build(cfg.policy.as_ref().unwrap_or(&file.policy)),
                model: m,
                model_tokens: model_tokens.clone(),
                pool,
                slo: Slo::from_ms(cfg.slo.ttft_ms, cfg.slo.itl_ms),
                cfg: cfg.clone(),
                rt,
            });
        }
        spans.push((start, routes.len() - start));
        served.push((
            scope.name.clone(),
            serving.into_iter().map(|k| replicas[k].0).collect(),
        ));
    }
    ActivePolicy {
        file,
        version,
        generation,
        loaded_at_unix: unix_now(),
        routes,
        spans,
        models: served,
    }
}
