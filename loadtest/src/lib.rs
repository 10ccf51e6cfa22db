//! The benchmark client behind `kvgate bench` (in progress): open-loop Poisson arrivals, seeded
//! workloads, streaming measurement of the four timers and a side-by-side compare mode.
//!
//! Built so far: the seeded random source and arrival process ([`arrival`]) and the percentile
//! maths of the report ([`stats`]). The HTTP client, workloads, report and compare mode arrive
//! with the rest of the load-tester issue.
#![forbid(unsafe_code)]

pub mod arrival;
pub mod stats;
