//! A real Llama-architecture model for the `cpu` backend: its hyper-parameters
//! ([`config`]), weights loaded from a GGUF file or a Hugging Face safetensors checkpoint
//! ([`weights`], [`safetensors`]), and the forward pass over the paged KV cache
//! ([`forward`]), which calls the kernels crate for all of its math. Every loader reports
//! through one [`LoadError`] ([`error`]), which imports none of them.

pub mod config;
pub mod error;
pub mod forward;
pub mod safetensors;
pub mod synthetic;
pub mod weights;

pub use config::LlamaConfig;
pub use error::LoadError;
pub use forward::{forward, SeqSlice};
pub use weights::{LlamaWeights, LoadOptions};
