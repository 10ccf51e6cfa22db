//! The model's tokeniser and chat template, loaded from the model's own files: `tokenizer.json`
//! (HF tokenizers) and `tokenizer_config.json` (chat template, BOS/EOS). Gateway and replica load
//! the same folder through [`TextTokenizer::from_dir`], so both count and hash the same tokens.
//! Encoding a long prompt costs tens of milliseconds: callers run it on a blocking pool, never
//! on the async reactor.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::chat_template::{ChatTemplate, TemplateError};
use crate::openai::ChatMessage;
use crate::ApiError;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("{path} is not a valid tokenizer: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("the tokenizer has no chat template (tokenizer_config.json lacks `chat_template`)")]
    NoChatTemplate,
    #[error("tokenisation failed: {0}")]
    Encode(String),
    #[error("token id {0} is outside the vocabulary")]
    UnknownToken(u32),
}

impl From<TokenizerError> for ApiError {
    fn from(e: TokenizerError) -> Self {
        match e {
            TokenizerError::Template(t) => t.into(),
            TokenizerError::UnknownToken(_) | TokenizerError::NoChatTemplate => {
                ApiError::invalid_request(e.to_string())
            }
            other => ApiError::internal(other.to_string()),
        }
    }
}

/// A special added token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub id: u32,
    pub content: String,
    /// The token absorbs whitespace around it (lstrip / rstrip / single_word).
    pub strips_whitespace: bool,
}

/// A loaded tokeniser with its chat template.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    eos_token_id: Option<u32>,
    vocab_size: usize,
    /// Most input bytes one token can stand for (see `token_bound.rs`).
    max_bytes_per_token: usize,
    dir: PathBuf,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

/// The only `.gguf` file in `dir`, if there is exactly one.
fn single_gguf(dir: &Path) -> Option<PathBuf> {
    let mut found = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"));
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// `bos_token` / `eos_token` appear either as a string or as an AddedToken object.
fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The chat template is either a string or a list of named templates (`default` is used).
fn chat_template_source(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| items.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    /// Loads a tokenizer from a model path: a GGUF file (its `tokenizer.ggml.*` metadata), a
    /// folder with `tokenizer.json` (and optionally `tokenizer_config.json`), or a folder that
    /// holds exactly one `.gguf` file and no `tokenizer.json`.
    pub fn from_path(path: &Path) -> Result<Self, TokenizerError> {
        if path.is_file() {
            return Self::from_gguf(path);
        }
        if !path.join("tokenizer.json").exists() {
            if let Some(g) = single_gguf(path) {
                return Self::from_gguf(&g);
            }
        }
        Self::from_dir(path)
    }

    /// Rebuilds the tokenizer and chat template from a GGUF file's metadata.
    pub fn from_gguf(path: &Path) -> Result<Self, TokenizerError> {
        let invalid = |reason: String| TokenizerError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let header = crate::gguf::GgufHeader::open(path).map_err(|e| invalid(e.to_string()))?;
        let (json, config) =
            crate::gguf_tokenizer::tokenizer_files(&header).map_err(|e| invalid(e.to_string()))?;
        let inner: tokenizers::Tokenizer = json
            .to_string()
            .parse()
            .map_err(|e: tokenizers::Error| invalid(e.to_string()))?;
        Self::build(inner, &config, path)
    }

    /// Loads `tokenizer.json` and, if present, `tokenizer_config.json` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tok_path = dir.join("tokenizer.json");
        let inner =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| TokenizerError::Invalid {
                path: tok_path.clone(),
                reason: e.to_string(),
            })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let config: Value = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| TokenizerError::Read {
                path: cfg_path.clone(),
                reason: e.to_string(),
            })?;
            serde_json::from_str(&text).map_err(|e| TokenizerError::Invalid {
                path: cfg_path.clone(),
                reason: e.to_string(),
            })?
        } else {
            Value::Null
        };
        // Newer Hugging Face folders keep the chat template in its own file.
        let mut config = config;
        let jinja = dir.join("chat_template.jinja");
        if chat_template_source(&config).is_none() && jinja.exists() {
            let text = std::fs::read_to_string(&jinja).map_err(|e| TokenizerError::Read {
                path: jinja.clone(),
                reason: e.to_string(),
            })?;
            match &mut config {
                Value::Object(m) => {
                    m.insert("chat_template".into(), Value::String(text));
                }
                other => *other = serde_json::json!({ "chat_template": text }),
            }
        }
        Self::build(inner, &config, dir)
    }

    fn build(
        inner: tokenizers::Tokenizer,
        config: &Value,
        source: &Path,
    ) -> Result<Self, TokenizerError> {
        let bos = special_token(config, "bos_token").unwrap_or_default();
        let eos = special_token(config, "eos_token");
        let template = match chat_template_source(config) {
            Some(src) => Some(ChatTemplate::new(&src, &bos, eos.as_deref().unwrap_or(""))?),
            None => None,
        };
        let eos_token_id = eos.as_deref().and_then(|e| inner.token_to_id(e));
        let vocab_size = inner.get_vocab_size(true);
        // A vocabulary entry's UTF-8 length is at least the input bytes it stands for (byte-level
        // alphabets and the metaspace symbol take more bytes than they represent); a normaliser
        // can shrink the input (NFC composes), hence the factor 2.
        let longest = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1);
        let max_bytes_per_token = longest
            * if inner.get_normalizer().is_some() {
                2
            } else {
                1
            };
        Ok(TextTokenizer {
            inner,
            template,
            eos_token_id,
            vocab_size,
            max_bytes_per_token,
            dir: source.to_path_buf(),
        })
    }

    /// Where the tokenizer was loaded from (a folder or a GGUF file).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Most input bytes one token can stand for: `bytes / this` tokens is a lower bound.
    pub fn max_bytes_per_token(&self) -> usize {
        self.max_bytes_per_token
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TokenizerError::UnknownToken(bad));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Special added tokens (content and id), for splitting rendered chat text.
    pub fn special_tokens(&self) -> Vec<SpecialToken> {
        let mut v: Vec<SpecialToken> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| SpecialToken {
                id,
                strips_whitespace: t.lstrip || t.rstrip || t.single_word,
                content: t.content,
            })
            .collect();
        v.sort_by_key(|s| s.id);
        v
    }

    /// The textual pieces of `ids` (for `/tokenize`'s `token_strs`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Renders messages with the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[Value]>,
        extra: Option<&serde_json::Map<String, Value>>,
    ) -> Result<String, ApiError> {
        let t = self
            .template
            .as_ref()
            .ok_or_else(|| ApiError::from(TokenizerError::NoChatTemplate))?;
        t.render(messages, add_generation_prompt, tools, extra)
    }

    /// Renders and tokenises a chat. The template already places BOS where the model wants it,
    /// so no special tokens are added on top (as vLLM does for chat).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[Value]>,
        extra: Option<&serde_json::Map<String, Value>>,
    ) -> Result<Vec<u32>, ApiError> {
        let text = self.apply_chat_template(messages, add_generation_prompt, tools, extra)?;
        Ok(self.encode(&text, false)?)
    }
}

/// Turns a stream of token ids into text deltas without re-decoding the whole output each
/// token and without emitting half of a multi-byte character (the prefix/read offset scheme
/// used by TGI and vLLM).
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn step(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(delta) = full.get(prefix.len()..) {
                let delta = delta.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }
}

/// Where the default model files live: `$KVGATE_TOKENIZER_DIR`, else `models/qwen3` in the
/// current directory or next to the running binary's workspace (`target/<profile>/..`).
pub fn default_tokenizer_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("KVGATE_TOKENIZER_DIR") {
        return Some(PathBuf::from(dir));
    }
    let mut candidates = vec![PathBuf::from("models/qwen3")];
    if let Ok(exe) = std::env::current_exe() {
        for anc in exe.ancestors().skip(1).take(4) {
            candidates.push(anc.join("models/qwen3"));
        }
    }
    candidates
        .into_iter()
        .find(|c| c.join("tokenizer.json").exists())
}
