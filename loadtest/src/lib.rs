//! The benchmark client behind `kvgate bench` (in progress): open-loop Poisson arrivals, seeded
//! workloads, streaming measurement of the four timers and a side-by-side compare mode.
//!
//! Built so far: the seeded random source and arrival process ([`arrival`]), the percentile
//! maths of the report ([`stats`]) and the seeded workloads ([`workload`]: chat, agent, rag,
//! mixed-tail), the streaming measuring client ([`client`]) and a single open-loop run with its
//! report ([`run`]), behind `kvgate bench`. Trace replay, rate sweeps, plots and compare mode
//! arrive with the rest of the load-tester issue.
#![forbid(unsafe_code)]

pub mod arrival;
pub mod client;
pub mod run;
pub mod stats;
pub mod workload;
