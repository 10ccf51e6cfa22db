//! The models a gateway serves. One `[model]` table serves one model over every replica; a
//! list of `[[models]]` tables serves several, each with its own name, aliases, tokenizer,
//! block size and replicas (its pool). A request's `model` field picks the entry; prefix
//! affinity, routes and admission are then per model (the gateway's `models.rs`).
//!
//! ```toml
//! replicas = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
//! [[models]]
//! name = "Qwen3-8B"
//! aliases = ["qwen", "default"]
//! tokenizer_dir = "models/qwen3"
//! replicas = ["10.0.0.1:8000", "10.0.0.2:8000"]
//! [[models]]
//! name = "SmolLM2-135M-Instruct"
//! tokenizer_dir = "models/smollm2"
//! replicas = [2]
//! [[models]]
//! name = "sql-adapter"             # a LoRA adapter the engines serve under this name
//! base = "Qwen3-8B"
//! ```
//!
//! An entry with `base` is a LoRA adapter of that model: its prompts are hashed from the
//! base's root with the adapter's name (as the engines key its KV blocks), so its prefix
//! affinity is its own; it takes the base's tokenizer and block size, and its replicas,
//! context limit and tokenizer default to the base's.

use serde::Deserialize;

use crate::error::Validator;
use crate::gateway::GatewayConfig;
use crate::routes::{resolve_pool, PoolEntry};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name clients send and replicas serve (part of every block hash's root).
    #[serde(default = "default_model")]
    pub name: String,
    /// Other names clients may send for this model; the gateway forwards `name`.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Folder with tokenizer.json and tokenizer_config.json, or the replicas' GGUF model file
    /// (its tokenizer metadata).
    #[serde(default)]
    pub tokenizer_dir: Option<String>,
    /// Replicas' KV block size in tokens.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// Longest prompt in tokens. Unset: the smallest `max_model_len` the model's replicas
    /// report on `/v1/models`, or 131072 until one does. Prompts over it are refused before
    /// they are tokenised in full.
    #[serde(default)]
    pub max_model_len: Option<usize>,
    /// The replicas serving this model: `host:port` as listed in `replicas`, or an index into
    /// that list. Empty: every replica (discovered ones included); an adapter: its base's.
    #[serde(default)]
    pub replicas: Vec<PoolEntry>,
    /// This entry is a LoRA adapter of the model named here (another entry); `name` is the
    /// adapter's name on the engines.
    #[serde(default)]
    pub base: Option<String>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: default_model(),
            aliases: Vec::new(),
            tokenizer_dir: None,
            block_size: default_block_size(),
            max_model_len: None,
            replicas: Vec::new(),
            base: None,
        }
    }
}

fn default_model() -> String {
    "Qwen3-8B".into()
}

fn default_block_size() -> usize {
    16
}

impl ModelConfig {
    /// Whether a request naming `requested` asks for this model.
    pub fn answers_to(&self, requested: &str) -> bool {
        self.name == requested || self.aliases.iter().any(|a| a == requested)
    }

    /// Whether the replica `name` (of the listed `replicas`) serves this model. A replica
    /// outside the list (found by discovery) serves only the models without a pool.
    pub fn serves(&self, name: &str, replicas: &[String]) -> bool {
        self.replicas.is_empty() || {
            let pool = resolve_pool(&self.replicas, replicas);
            pool.iter().any(|&i| replicas[i] == name)
        }
    }
}

/// The model of `models` whose KV blocks `replica` (of the `listed` replicas) holds: the first
/// base model it serves (validation keeps a shared replica's models at one block size; its
/// adapters' blocks are rooted at it), else the first model. Its name roots, and its block
/// size cuts, the hashes of the replica's engine events.
pub fn model_of<'a>(
    models: &'a [ModelConfig],
    listed: &[String],
    replica: &str,
) -> &'a ModelConfig {
    models
        .iter()
        .find(|m| m.base.is_none() && m.serves(replica, listed))
        .or_else(|| models.iter().find(|m| m.serves(replica, listed)))
        .unwrap_or(&models[0])
}

impl GatewayConfig {
    /// Fills each LoRA adapter's tokenizer, block size, context limit and replicas from its
    /// base where the entry leaves them out (the block size always: one engine, one size).
    pub fn resolve_adapters(&mut self) {
        let bases = self.models.clone();
        for m in &mut self.models {
            let Some(b) = m
                .base
                .as_ref()
                .and_then(|b| bases.iter().find(|x| &x.name == b))
            else {
                continue;
            };
            m.block_size = b.block_size;
            if m.tokenizer_dir.is_none() {
                m.tokenizer_dir.clone_from(&b.tokenizer_dir);
            }
            if m.max_model_len.is_none() {
                m.max_model_len = b.max_model_len;
            }
            if m.replicas.is_empty() {
                m.replicas.clone_from(&b.replicas);
            }
        }
    }

    /// The models this gateway serves: the `[[models]]` list, or the one `[model]`.
    pub fn served_models(&self) -> &[ModelConfig] {
        if self.models.is_empty() {
            std::slice::from_ref(&self.model)
        } else {
            &self.models
        }
    }

    /// The model whose KV blocks `replica` holds ([`model_of`]).
    pub fn model_of(&self, replica: &str) -> &ModelConfig {
        model_of(self.served_models(), &self.replicas, replica)
    }

    /// The models' rules: names and aliases unique, pools naming listed replicas, every listed
    /// replica serving some model, one block size per replica.
    pub(crate) fn check_models(&self, v: &mut Validator) {
        v.check(
            self.models.is_empty() || self.model == ModelConfig::default(),
            "model",
            "set",
            "give either one [model] table or a list of [[models]] tables, not both",
        );
        let section = if self.models.is_empty() {
            "model"
        } else {
            "models"
        };
        let models = self.served_models();
        let field = |i: usize, f: &str| {
            if self.models.is_empty() {
                format!("model.{f}")
            } else {
                format!("models[{i}].{f}")
            }
        };
        let mut seen: Vec<&str> = Vec::new();
        for (i, m) in models.iter().enumerate() {
            v.check(
                !m.name.is_empty(),
                &field(i, "name"),
                "\"\"",
                "must not be empty",
            );
            for n in std::iter::once(&m.name).chain(&m.aliases) {
                v.check(
                    !seen.contains(&n.as_str()),
                    &field(i, if *n == m.name { "name" } else { "aliases" }),
                    format!("{n:?}"),
                    "names and aliases must be unique across the models",
                );
                seen.push(n);
            }
            v.check(
                (1..=1024).contains(&m.block_size),
                &field(i, "block_size"),
                m.block_size,
                "must be between 1 and 1024 and equal the replicas' block size",
            );
            v.check(
                m.max_model_len != Some(0),
                &field(i, "max_model_len"),
                0,
                "must be at least 1 (omit it to learn it from the replicas)",
            );
            if let Some(b) = &m.base {
                let base = models.iter().find(|x| &x.name == b);
                v.check(
                    base.is_some_and(|x| x.base.is_none() && x.name != m.name),
                    &field(i, "base"),
                    format!("{b:?}"),
                    "must name another [[models]] entry that is not an adapter itself",
                );
            }
            let bases = models.iter().filter(|x| x.base.is_none()).count();
            v.check(
                bases <= 1 || m.base.is_some() || !m.replicas.is_empty(),
                &field(i, "replicas"),
                "[]",
                "with several models, each must list the replicas serving it (left out, every replica would be taken to serve it)",
            );
            for (j, e) in m.replicas.iter().enumerate() {
                let known = match e {
                    PoolEntry::Index(x) => *x < self.replicas.len(),
                    PoolEntry::Name(n) => self.replicas.contains(n),
                };
                v.check(
                    known,
                    &format!("{}[{j}]", field(i, "replicas")),
                    e,
                    "not one of the gateway's replicas (give host:port as listed there, or its index)",
                );
            }
        }
        for (k, r) in self.replicas.iter().enumerate() {
            let serving: Vec<&ModelConfig> = models
                .iter()
                .filter(|m| m.serves(r, &self.replicas))
                .collect();
            v.check(
                !serving.is_empty(),
                &format!("replicas[{k}]"),
                format!("{r:?}"),
                &format!("serves no model: add it to a {section} entry's replicas, or drop it"),
            );
            v.check(
                serving
                    .windows(2)
                    .all(|w| w[0].block_size == w[1].block_size),
                &format!("replicas[{k}]"),
                format!("{r:?}"),
                "serves models of different block sizes; one engine has one block size",
            );
            let zmq = self
                .engines
                .iter()
                .any(|e| e.addr == *r && e.kv_events.is_some());
            let mut families: Vec<&str> = serving
                .iter()
                .map(|m| m.base.as_deref().unwrap_or(&m.name))
                .collect();
            families.sort_unstable();
            families.dedup();
            v.check(
                !zmq || families.len() <= 1,
                &format!("replicas[{k}]"),
                format!("{r:?}"),
                "publishes ZMQ KV events, which carry no model name, so it can serve one model (and its LoRA adapters) only",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::GatewayConfig;

    fn err(text: &str) -> String {
        GatewayConfig::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn one_model_table_or_a_list_serves_and_each_replica_knows_its_model() {
        let one =
            GatewayConfig::from_toml("replicas = [\"a:1\"]\n[model]\nname = \"m\"\n").unwrap();
        assert_eq!(one.served_models().len(), 1);
        assert_eq!(one.model_of("a:1").name, "m");
        let two = GatewayConfig::from_toml(
            "replicas = [\"a:1\", \"b:1\", \"c:1\"]\n\
             [[models]]\nname = \"big\"\naliases = [\"default\"]\nreplicas = [\"a:1\", 1]\n\
             [[models]]\nname = \"small\"\nblock_size = 32\nreplicas = [\"c:1\"]\n",
        )
        .unwrap();
        assert_eq!(two.served_models().len(), 2);
        assert_eq!(two.model_of("b:1").name, "big");
        assert_eq!(two.model_of("c:1").block_size, 32);
        assert!(two.served_models()[0].answers_to("default"));
        assert!(!two.served_models()[1].answers_to("default"));
    }

    #[test]
    fn an_adapter_takes_its_bases_tokenizer_block_size_and_replicas() {
        let c = GatewayConfig::from_toml(
            "replicas = [\"a:1\", \"b:1\"]\n\
             [[models]]\nname = \"base\"\nblock_size = 32\ntokenizer_dir = \"t\"\nreplicas = [1]\n\
             [[models]]\nname = \"sql\"\nbase = \"base\"\n\
             [[models]]\nname = \"other\"\nreplicas = [0]\n",
        )
        .unwrap();
        let sql = &c.served_models()[1];
        assert_eq!(sql.block_size, 32);
        assert_eq!(sql.tokenizer_dir.as_deref(), Some("t"));
        assert!(sql.serves("b:1", &c.replicas) && !sql.serves("a:1", &c.replicas));
        // The replica's events are rooted at the base, not the adapter.
        assert_eq!(c.model_of("b:1").name, "base");
        let e = err(
            "replicas = [\"a:1\"]\n[[models]]\nname = \"x\"\nbase = \"x\"\n\
             [[models]]\nname = \"y\"\nbase = \"nothing\"\n",
        );
        assert!(
            e.contains("models[0].base") && e.contains("models[1].base"),
            "{e}"
        );
    }

    #[test]
    fn models_are_refused_with_every_problem_named() {
        let e = err("replicas = [\"a:1\", \"b:1\", \"c:1\"]\n\
             [[models]]\nname = \"big\"\naliases = [\"x\"]\nreplicas = [\"a:1\", 7]\n\
             [[models]]\nname = \"x\"\nblock_size = 32\nreplicas = [\"a:1\"]\n");
        assert!(e.contains("models[1].name"), "{e}");
        assert!(e.contains("models[0].replicas[1]"), "{e}");
        assert!(
            e.contains("replicas[1]") && e.contains("serves no model"),
            "{e}"
        );
        assert!(e.contains("different block sizes"), "{e}");
        let unlisted =
            err("replicas = [\"a:1\"]\n[[models]]\nname = \"m\"\n[[models]]\nname = \"n\"\n");
        assert!(
            unlisted.contains("models[0].replicas") && unlisted.contains("each must list"),
            "{unlisted}"
        );
        let both = err("replicas = [\"a:1\"]\n[model]\nname = \"m\"\n[[models]]\nname = \"n\"\n");
        assert!(both.contains("not both"), "{both}");
        let zmq = err(
            "replicas = [{ addr = \"a:1\", backend = \"vllm\", kv_events = \"tcp://a:5557\" }]\n\
             [[models]]\nname = \"m\"\n[[models]]\nname = \"n\"\n",
        );
        assert!(zmq.contains("can serve one model"), "{zmq}");
    }
}
