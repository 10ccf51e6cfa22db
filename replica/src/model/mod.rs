//! A real Llama-architecture model for the `cpu` backend: its hyper-parameters
//! ([`config`]), weights loaded from a GGUF file or a Hugging Face safetensors checkpoint
//! ([`weights`], [`safetensors`]), and the forward pass over the paged KV cache
//! ([`forward`]), which calls the kernels crate for all of its math.

pub mod config;
pub mod forward;
pub mod safetensors;
pub mod synthetic;
pub mod weights;

pub use config::LlamaConfig;
pub use forward::{forward, SeqSlice};
pub use weights::{LlamaWeights, LoadError, LoadOptions};
