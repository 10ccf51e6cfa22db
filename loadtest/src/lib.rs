//! The benchmark client behind `kvgate bench`: open-loop Poisson arrivals, seeded workloads,
//! streaming measurement of the four timers and a side-by-side compare mode.
//!
//! Not built yet: it arrives with the load-tester issue.
#![forbid(unsafe_code)]
