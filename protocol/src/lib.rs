//! The vocabulary every kvgate component shares: OpenAI request and response types, SSE framing,
//! OpenAI-shaped errors, the one block-hash function, the KV-event wire format and the tokeniser
//! with its chat template. Gateway and replica both hash through [`hashing`], so a prefix the
//! gateway predicts is exactly the prefix the replica caches.
#![forbid(unsafe_code)]

pub mod auth;
pub mod chat_template;
pub mod error;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod hashing;
pub mod kv_events;
pub mod openai;
pub mod openai_fields;
pub mod openai_tools;
pub mod segment_cache;
pub mod slo;
pub mod sse;
pub mod text_chunks;
pub mod time;
pub mod token_bound;
pub mod tokenizer;

pub use error::ApiError;
