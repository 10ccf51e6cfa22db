//! The OpenAI-compatible front door built on pingora: reads the body, renders and tokenises the
//! prompt with the protocol crate, hashes its blocks, asks a routing policy for a replica and
//! proxies the answer back, streaming.
//!
//! Not built yet: it arrives with the gateway issue, on top of the replica engine.
#![forbid(unsafe_code)]
