//! The replicas behind the gateway: who they are ([`registry`] — the list, reloadable, by
//! slot — and one [`replica`] record each), whether they are up ([`health`]), what they say
//! about themselves ([`probes`], [`engine_metrics`]), how fast they are ([`latency_model`] and its [`ttft_fit`],
//! learnt from what the gateway relays, and [`prefill_queue`], the prefill sent there and not
//! yet answered), how loaded ([`pressure`]), where they come from ([`discovery`]), how the
//! gateway talks to them ([`client`]), what a request holds there while it runs
//! ([`guards`]), which answer unusably ([`outlier`]), and whose prompt token counts differ
//! from the gateway's ([`prompt_check`]: a drifted tokenizer or chat template), how many tokens
//! they generate per second ([`throughput`], for the cost gauge), how their decode step grows
//! with the context in flight ([`step_fit`]), the statistics of their inter-token gaps
//! ([`gap_stats`]), how many requests a second come to use their cache ([`reuse_rate`]). Their KV event
//! streams are followed here ([`events`], [`tasks`]) and written into the prefix index
//! (`prefix/`).

pub mod client;
pub mod discovery;
pub mod engine_metrics;
pub mod events;
pub mod gap_stats;
pub mod guards;
pub mod health;
pub mod latency_model;
pub mod outlier;
pub mod prefill_queue;
pub mod pressure;
pub mod probes;
pub mod prompt_check;
pub mod registry;
pub mod replica;
pub mod reuse_rate;
pub mod step_fit;
pub mod step_phase;
pub mod tasks;
pub mod throughput;
pub mod ttft_fit;
