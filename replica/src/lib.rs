//! The kvgate replica: an OpenAI-compatible engine process. A continuous-batching
//! [`scheduler`] over a paged, prefix-caching [`block_manager`], driven by the [`engine`] loop
//! through an [`backend::EngineBackend`] — `sim` models step times with the [`roofline`] — and
//! served over HTTP by [`server`]. [`app::build_server`] assembles it all. The `cpu` backend
//! ([`cpu`]) runs a real Llama-architecture [`model`] on the same paged KV cache; the `cuda`
//! backend (module `cuda`, feature `cuda`) runs the same model and cache layout on an NVIDIA GPU.
// One exception, with its SAFETY note: memory-mapping model files (`model::weights`).
#![deny(unsafe_code)]

pub mod api;
pub mod app;
pub mod backend;
pub mod block_manager;
pub mod capacity;
pub mod cpu;
#[cfg(feature = "gpu")]
pub mod cuda;
pub mod engine;
pub mod generate;
pub mod http_util;
pub mod info;
pub mod kv_hub;
pub mod kv_quality;
pub mod metrics;
pub mod model;
pub mod profiles;
pub mod rng;
pub mod roofline;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod sim;
pub mod state;
pub mod zmq_publisher;

pub use app::{build_server, ReplicaConfig, ReplicaServer};
