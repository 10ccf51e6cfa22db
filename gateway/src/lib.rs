//! The OpenAI-compatible front door, on pingora. The tree reads as the journey of a request:
//!
//! - [`http`] — the pingora face: connections, the endpoint table, auth, bodies, replies;
//! - [`request`] — the request path as a pipeline of stages (prepare, classify, admit, place,
//!   forward, relay), one file each, plus `explain`, its dry run;
//! - [`routes`] — the policy's routes at run time: the hot-reloaded policy, each route's queue,
//!   in-flight counts and goodput, and the admission rule;
//! - [`fleet`] — the replicas: registry, health, probes, learnt latency, discovery, the client;
//! - [`prefix`] — which replica holds which prefix: the index, its lookups, prefix reuse, the
//!   engines' KV events;
//! - [`models`] — the served models: names, aliases, and each one's tokenizer and hashing;
//! - [`state`] — the composition root that owns the parts and hands each stage its share;
//!   [`server`] wires them and serves; [`admin`] is the admin API; [`membership`] changes the
//!   fleet at run time; [`peers`] shares the admission budget with the fleet's other gateways;
//! - [`batch`] — the OpenAI Batch API: files and jobs in an embedded database, their lines fed
//!   into the fleet's spare capacity through the same request path.
//!
//! `docs/DESIGN.md` opens with a map from each request-path decision to the file that makes it.
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod batch;
pub mod clock;
pub mod fleet;
pub mod http;
pub mod lifecycle;
pub mod membership;
pub mod metrics;
pub mod models;
pub mod peers;
pub mod prefix;
pub mod request;
pub mod routes;
pub mod server;
pub mod state;

pub use server::{build_gateway, GatewayServer};
