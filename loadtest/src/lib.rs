//! The benchmark client behind `kvgate bench`: open-loop arrivals at fixed rates (Poisson, or a
//! replayed trace), seeded workloads (and a clustered arrival process, [`bursty`]), streaming measurement of what a user sees (TTFT, every
//! inter-token gap, end to end, cached tokens, the replica that answered), goodput against an
//! SLO, rate sweeps against several targets interleaved ([`compare`]), the oracle hit-ratio
//! ceiling ([`oracle`]), plots ([`plot`]) and regression runs against a recorded baseline
//! ([`regression`]).
#![forbid(unsafe_code)]

pub mod arrival;
pub mod bursty;
pub mod client;
pub mod compare;
pub mod oracle;
pub mod plot;
pub mod regression;
pub mod run;
pub mod stats;
pub mod trace;
pub mod words;
pub mod workload;
