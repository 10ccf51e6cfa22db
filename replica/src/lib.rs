//! The kvgate replica: an OpenAI-compatible engine process.
#![forbid(unsafe_code)]

pub mod block_manager;
pub mod capacity;
pub mod profiles;
pub mod roofline;
pub mod scheduler;
