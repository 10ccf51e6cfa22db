//! The models this gateway serves ([`Catalog`]): per model, its names and the [`Preparer`] that
//! tokenises and hashes its prompts (its tokenizer, chat template and block size; the root of
//! its block hashes is its name, so one prefix index keeps the models apart). A request's
//! `model` field picks the model before anything else is done with it ([`Catalog::pick`]):
//! the prompt limits, the tokenizer and the routes all depend on it. Which replicas serve a
//! model, and its routes, are the policy store's (`routes/store.rs`).

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use config::{GatewayConfig, ModelConfig};
use protocol::tokenizer::TextTokenizer;
use protocol::ApiError;
use serde::Deserialize;

use crate::metrics::GatewayMetrics;
use crate::request::drift_sample::DriftSampler;
use crate::request::prepare::Preparer;

#[derive(Debug, thiserror::Error)]
pub enum ModelLoadError {
    #[error("model {0}: cannot load the tokenizer from {1}: {2}")]
    Tokenizer(String, String, String),
    #[error("model {0}: no tokenizer folder configured or found (tokenizer_dir)")]
    NoTokenizer(String),
}

/// One served model.
pub struct ServedModel {
    /// Its entry in the gateway file.
    pub cfg: ModelConfig,
    pub preparer: Arc<Preparer>,
}

/// The served models, in the gateway file's order.
pub struct Catalog {
    models: Vec<ServedModel>,
    /// When the catalog was first loaded (unix seconds): the `created` of the gateway's own
    /// cards.
    pub created: u64,
    metrics: Arc<GatewayMetrics>,
    drift: Arc<DriftSampler>,
    cache_bytes: usize,
}

/// The one field of a body read before it is prepared.
#[derive(Deserialize)]
struct ModelField<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
}

/// Whether a preparer made for `a` serves `b` as well (what it hashes and rewrites with).
fn same_preparer(a: &ModelConfig, b: &ModelConfig) -> bool {
    a.name == b.name
        && a.base == b.base
        && a.aliases == b.aliases
        && a.tokenizer_dir == b.tokenizer_dir
        && a.block_size == b.block_size
}

impl Catalog {
    /// Loads every model's tokenizer (one load per folder, shared by the models naming it).
    pub async fn load(
        cfg: &GatewayConfig,
        metrics: &Arc<GatewayMetrics>,
        drift: Arc<DriftSampler>,
    ) -> Result<Self, ModelLoadError> {
        let empty = Catalog {
            models: Vec::new(),
            created: protocol::time::unix_now(),
            metrics: metrics.clone(),
            drift,
            cache_bytes: cfg.downstream.tokenizer_cache_mib << 20,
        };
        empty.reloaded(cfg.served_models()).await
    }

    /// The catalog for `models` (a reloaded gateway file's): a model whose name, aliases,
    /// tokenizer and block size did not change keeps its preparer (and its segment cache); a
    /// tokenizer folder already loaded is not loaded again. Any model that cannot be loaded
    /// fails the whole.
    pub async fn reloaded(&self, models: &[ModelConfig]) -> Result<Self, ModelLoadError> {
        let mut loaded: Vec<(String, Arc<TextTokenizer>)> = Vec::new();
        let mut out = Vec::new();
        for m in models {
            if let Some(kept) = self.models.iter().find(|x| same_preparer(&x.cfg, m)) {
                out.push(ServedModel {
                    cfg: m.clone(),
                    preparer: kept.preparer.clone(),
                });
                continue;
            }
            let dir = match &m.tokenizer_dir {
                Some(d) => Path::new(d).to_path_buf(),
                None => protocol::tokenizer::default_tokenizer_dir()
                    .ok_or_else(|| ModelLoadError::NoTokenizer(m.name.clone()))?,
            };
            let shown = dir.display().to_string();
            let known = self
                .models
                .iter()
                .find(|x| x.cfg.tokenizer_dir == m.tokenizer_dir)
                .map(|x| x.preparer.tokenizer.clone())
                .or_else(|| {
                    loaded
                        .iter()
                        .find(|(d, _)| *d == shown)
                        .map(|(_, t)| t.clone())
                });
            let tokenizer = match known {
                Some(t) => t,
                None => {
                    let fail =
                        |e: String| ModelLoadError::Tokenizer(m.name.clone(), shown.clone(), e);
                    let t = tokio::task::spawn_blocking(move || TextTokenizer::from_path(&dir))
                        .await
                        .map_err(|e| fail(e.to_string()))?
                        .map_err(|e| fail(e.to_string()))?;
                    let t = Arc::new(t);
                    loaded.push((shown.clone(), t.clone()));
                    t
                }
            };
            let preparer = Preparer::with_cache(
                tokenizer,
                m.name.clone(),
                m.block_size,
                self.metrics.clone(),
                self.cache_bytes,
            )
            .with_drift(self.drift.clone())
            .with_aliases(m.aliases.clone())
            .with_base(m.base.clone());
            report_chunking(&m.name, &preparer);
            out.push(ServedModel {
                cfg: m.clone(),
                preparer: Arc::new(preparer),
            });
        }
        Ok(Catalog {
            models: out,
            created: self.created,
            metrics: self.metrics.clone(),
            drift: self.drift.clone(),
            cache_bytes: self.cache_bytes,
        })
    }

    pub fn all(&self) -> &[ServedModel] {
        &self.models
    }

    /// The model at `i` (the first when out of range).
    pub fn get(&self, i: usize) -> &ServedModel {
        self.models.get(i).unwrap_or(&self.models[0])
    }

    /// The model `requested` names (its name or an alias).
    pub fn find(&self, requested: &str) -> Option<usize> {
        self.models.iter().position(|m| m.cfg.answers_to(requested))
    }

    /// Every name a request may give, canonical names first in each model's entry.
    pub fn names(&self) -> Vec<&str> {
        self.models
            .iter()
            .flat_map(|m| std::iter::once(&m.cfg.name).chain(&m.cfg.aliases))
            .map(String::as_str)
            .collect()
    }

    /// The model a request body asks for. With one model the body is not read here: its
    /// preparer checks the name as it parses. With several, only the `model` field is read;
    /// a body that is not JSON, or has no `model`, goes to the first model's preparer, which
    /// refuses it with the usual error. A name no model answers to is a 404 naming them all.
    pub fn pick(&self, body: &[u8]) -> Result<&ServedModel, ApiError> {
        if self.models.len() == 1 {
            return Ok(&self.models[0]);
        }
        match serde_json::from_slice::<ModelField<'_>>(body) {
            Ok(ModelField { model: Some(m) }) => self
                .find(&m)
                .map(|i| &self.models[i])
                .ok_or_else(|| self.not_found(&m)),
            _ => Ok(&self.models[0]),
        }
    }

    /// The model a body asks for ([`Catalog::pick`]) and its position among the active
    /// policy's models, which `index` finds by name. A model a reload is adding or removing
    /// this instant is in only one of the two: a 404, as for a name nobody serves.
    pub fn pick_in(
        &self,
        body: &[u8],
        index: impl Fn(&str) -> Option<usize>,
    ) -> Result<(&ServedModel, usize), ApiError> {
        let m = self.pick(body)?;
        index(&m.cfg.name)
            .map(|i| (m, i))
            .ok_or_else(|| self.not_found(&m.cfg.name))
    }

    /// 404 for a model no entry answers to, naming every served name.
    pub fn not_found(&self, requested: &str) -> ApiError {
        ApiError::model_not_found_among(requested, &self.names())
    }
}

fn report_chunking(model: &str, preparer: &Preparer) {
    match preparer.chunk_support() {
        c if c.chunking && c.added_prefix.is_some() => tracing::info!(
            model,
            "tokeniser: long prompts are tokenised in pieces, a shared prefix once per tenant"
        ),
        c if c.chunking => tracing::info!(
            model,
            "tokeniser: long messages are tokenised in pieces; completions prompts whole (this \
             tokenizer adds special tokens that cannot be assembled from pieces)"
        ),
        _ => tracing::warn!(
            model,
            "tokeniser: this tokenizer does not tokenise cut text to the whole's ids, so every \
             long prompt is tokenised whole (a shared prefix costs its full tokenisation each time)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(names: &[(&str, &[&str])]) -> Catalog {
        let dir = protocol::tokenizer::default_tokenizer_dir()
            .filter(|d| d.join("tokenizer.json").exists())
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3"));
        let tok = Arc::new(TextTokenizer::from_dir(&dir).expect("models/qwen3"));
        let metrics = Arc::new(GatewayMetrics::new());
        Catalog {
            models: names
                .iter()
                .map(|(n, a)| {
                    let aliases: Vec<String> = a.iter().map(|s| s.to_string()).collect();
                    ServedModel {
                        cfg: ModelConfig {
                            name: n.to_string(),
                            aliases: aliases.clone(),
                            ..ModelConfig::default()
                        },
                        preparer: Arc::new(
                            Preparer::new(tok.clone(), n.to_string(), 16, metrics.clone())
                                .with_aliases(aliases),
                        ),
                    }
                })
                .collect(),
            created: 0,
            metrics,
            drift: Arc::default(),
            cache_bytes: 1 << 20,
        }
    }

    #[test]
    fn a_body_picks_its_model_by_name_or_alias_and_an_unknown_one_is_named() {
        let c = catalog(&[("big", &["default"]), ("small", &[])]);
        let pick = |b: &[u8]| c.pick(b).map(|m| m.cfg.name.clone());
        assert_eq!(
            pick(br#"{"model": "small", "prompt": "x"}"#).unwrap(),
            "small"
        );
        assert_eq!(
            pick(br#"{"prompt": "x", "model": "default"}"#).unwrap(),
            "big"
        );
        let e = pick(br#"{"model": "tiny"}"#).unwrap_err();
        assert_eq!(e.status, 404);
        let msg = &e.body.error.message;
        assert!(msg.contains("`big`, `default` or `small`"), "{msg}");
        // Not JSON, or no model: the first model's preparer refuses it as usual.
        assert_eq!(pick(b"{not json").unwrap(), "big");
        assert_eq!(pick(br#"{"prompt": "x"}"#).unwrap(), "big");
    }

    #[tokio::test]
    async fn a_reload_keeps_the_preparers_of_unchanged_models() {
        let c = catalog(&[("big", &["default"]), ("small", &[])]);
        let mut big = c.get(0).cfg.clone();
        big.max_model_len = Some(4096);
        let mut small = c.get(1).cfg.clone();
        small.aliases = vec!["tiny".into()];
        let next = c.reloaded(&[small, big]).await.unwrap();
        assert!(Arc::ptr_eq(&next.get(1).preparer, &c.get(0).preparer));
        assert_eq!(next.get(1).cfg.max_model_len, Some(4096));
        // A changed alias makes a new preparer (it rewrites the alias), on the same tokenizer.
        assert!(!Arc::ptr_eq(&next.get(0).preparer, &c.get(1).preparer));
        assert!(Arc::ptr_eq(
            &next.get(0).preparer.tokenizer,
            &c.get(1).preparer.tokenizer
        ));
        assert_eq!(next.find("tiny"), Some(0));
    }
}
