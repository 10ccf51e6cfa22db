//! What the gateway knows about which replica caches which prefix. [`index`] holds it (block
//! hash → replicas, exact from KV events, approximate from routing; [`group`] is its map for 64
//! replicas at a time); [`view`] is what the request path asks of it (how much of a prompt each
//! replica holds, and what it records when a request is sent); [`reuse`] counts how often each prefix is reused; [`warming`] which prefixes have a warming
//! request in flight. The engines' own event
//! streams come in through [`zmq`] (vLLM and SGLang over ZMQ) and [`engine_events`] (their
//! block hashes rebuilt as the gateway's); kvgate replicas' streams are followed by the fleet
//! (`fleet/events.rs`), which owns the subscriptions.

pub mod engine_events;
pub mod group;
pub mod index;
pub mod reuse;
pub mod view;
pub mod warming;
pub mod zmq;
