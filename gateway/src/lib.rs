//! The OpenAI-compatible front door, on pingora: reads the whole body, renders and tokenises
//! the prompt with the protocol crate, hashes its blocks, asks a routing policy (fed by the
//! prefix index and the replicas' load) for a replica among those admission allows, and
//! proxies the answer back, streaming, accounting goodput per route.
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admission;
pub mod admission_queue;
pub mod auth;
pub mod body;
pub mod clock;
pub mod conn;
pub mod discovery;
pub mod dispatch;
pub mod engine_events;
pub mod engine_metrics;
pub mod explain;
pub mod fleet;
pub mod forward;
pub mod goodput;
pub mod latency_model;
pub mod lifecycle;
pub mod metrics;
pub mod placement;
pub mod policy_store;
pub mod prefix_index;
pub mod prefix_reuse;
pub mod proxy;
pub mod registry;
pub mod relay;
pub mod route_runtime;
pub mod router;
pub mod server;
pub mod state;
pub mod write_buffer;
pub mod zmq_events;

pub use server::{build_gateway, GatewayServer};
