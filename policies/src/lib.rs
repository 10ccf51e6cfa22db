//! Routing policies: pure functions of a request's block hashes and a snapshot of the replica
//! set, returning a decision and its reason. No I/O, no async, no proxy types, so every policy
//! can be called from a unit test with a fabricated fleet.
//!
//! The `RoutingPolicy` trait and its implementations arrive with the gateway issue.
#![forbid(unsafe_code)]
