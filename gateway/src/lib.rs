//! The OpenAI-compatible front door: reads the body, renders and tokenises the prompt with the
//! protocol crate, hashes its blocks, asks a routing policy for a replica and proxies the
//! answer back, streaming.
//!
//! Built so far: the prefix index the policies consult. The pingora service, replica registry,
//! health checks and KV-event subscribers arrive in the next slices of the gateway issue.
#![forbid(unsafe_code)]

pub mod prefix_index;
