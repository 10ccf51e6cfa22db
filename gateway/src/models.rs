//! The models this gateway serves ([`Catalog`]): per model, its names and the [`Preparer`] that
//! tokenises and hashes its prompts (its tokenizer, chat template and block size; the root of
//! its block hashes is its name, so one prefix index keeps the models apart). A request's
//! `model` field picks the model before anything else is done with it ([`Catalog::pick`]):
//! the prompt limits, the tokenizer and the routes all depend on it. Which replicas serve a
//! model, and its routes, are the policy store's (`routes/store.rs`).

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use config::GatewayConfig;
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
    pub name: String,
    pub aliases: Vec<String>,
    /// `max_model_len` from the gateway file.
    pub max_model_len: Option<usize>,
    pub preparer: Arc<Preparer>,
}

/// The served models, in the gateway file's order.
pub struct Catalog {
    models: Vec<ServedModel>,
    /// When the catalog was loaded (unix seconds): the `created` of the gateway's own cards.
    pub created: u64,
}

/// The one field of a body read before it is prepared.
#[derive(Deserialize)]
struct ModelField<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
}

impl Catalog {
    /// Loads every model's tokenizer (one load per folder, shared by the models naming it).
    pub async fn load(
        cfg: &GatewayConfig,
        metrics: &Arc<GatewayMetrics>,
        drift: Arc<DriftSampler>,
    ) -> Result<Self, ModelLoadError> {
        let mut loaded: Vec<(String, Arc<TextTokenizer>)> = Vec::new();
        let mut models = Vec::new();
        for (i, m) in cfg.served_models().iter().enumerate() {
            let dir = match &m.tokenizer_dir {
                Some(d) => Path::new(d).to_path_buf(),
                None => protocol::tokenizer::default_tokenizer_dir()
                    .ok_or_else(|| ModelLoadError::NoTokenizer(m.name.clone()))?,
            };
            let shown = dir.display().to_string();
            let tokenizer = match loaded.iter().find(|(d, _)| *d == shown) {
                Some((_, t)) => t.clone(),
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
                metrics.clone(),
                cfg.downstream.tokenizer_cache_mib << 20,
            )
            .with_drift(drift.clone())
            .serving(i, m.aliases.clone());
            report_chunking(&m.name, &preparer);
            models.push(ServedModel {
                name: m.name.clone(),
                aliases: m.aliases.clone(),
                max_model_len: m.max_model_len,
                preparer: Arc::new(preparer),
            });
        }
        Ok(Catalog {
            models,
            created: protocol::time::unix_now(),
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
        self.models
            .iter()
            .position(|m| m.name == requested || m.aliases.iter().any(|a| a == requested))
    }

    /// Every name a request may give, canonical names first in each model's entry.
    pub fn names(&self) -> Vec<&str> {
        self.models
            .iter()
            .flat_map(|m| std::iter::once(&m.name).chain(&m.aliases))
            .map(String::as_str)
            .collect()
    }

    /// The model a request body asks for. With one model the body is not read here: its
    /// preparer checks the name as it parses. With several, only the `model` field is read;
    /// a body that is not JSON, or has no `model`, goes to the first model's preparer, which
    /// refuses it with the usual error. A name no model answers to is a 404 naming them all.
    pub fn pick(&self, body: &[u8]) -> Result<usize, ApiError> {
        if self.models.len() == 1 {
            return Ok(0);
        }
        match serde_json::from_slice::<ModelField<'_>>(body) {
            Ok(ModelField { model: Some(m) }) => self
                .find(&m)
                .ok_or_else(|| ApiError::model_not_found_among(&m, &self.names())),
            _ => Ok(0),
        }
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
                .enumerate()
                .map(|(i, (n, a))| {
                    let aliases: Vec<String> = a.iter().map(|s| s.to_string()).collect();
                    ServedModel {
                        name: n.to_string(),
                        aliases: aliases.clone(),
                        max_model_len: None,
                        preparer: Arc::new(
                            Preparer::new(tok.clone(), n.to_string(), 16, metrics.clone())
                                .serving(i, aliases),
                        ),
                    }
                })
                .collect(),
            created: 0,
        }
    }

    #[test]
    fn a_body_picks_its_model_by_name_or_alias_and_an_unknown_one_is_named() {
        let c = catalog(&[("big", &["default"]), ("small", &[])]);
        assert_eq!(c.pick(br#"{"model": "small", "prompt": "x"}"#).unwrap(), 1);
        assert_eq!(
            c.pick(br#"{"prompt": "x", "model": "default"}"#).unwrap(),
            0
        );
        let e = c.pick(br#"{"model": "tiny"}"#).unwrap_err();
        assert_eq!(e.status, 404);
        let msg = &e.body.error.message;
        assert!(msg.contains("`big`, `default` or `small`"), "{msg}");
        // Not JSON, or no model: the first model's preparer refuses it as usual.
        assert_eq!(c.pick(b"{not json").unwrap(), 0);
        assert_eq!(c.pick(br#"{"prompt": "x"}"#).unwrap(), 0);
    }
}
