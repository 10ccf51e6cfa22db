//! The seam between the scheduler and whatever runs the model: an [`EngineBackend`] executes
//! one planned step and returns the sampled tokens and how long the step takes. `sim` models the
//! time (the engine then waits it out); `cpu` computes for real (on a blocking thread, off the
//! async runtime) and returns no extra wait; `cuda` is not built yet.

use std::time::Duration;

use std::sync::Arc;

use crate::roofline::StepCost;
use crate::sampling::TokenLogprobs;
use crate::scheduler::{ScheduledItem, SeqId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Sim,
    Cpu,
    Cuda,
}

impl BackendKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "sim" => Some(BackendKind::Sim),
            "cpu" => Some(BackendKind::Cpu),
            "cuda" => Some(BackendKind::Cuda),
            _ => None,
        }
    }
}

/// What one step produced.
#[derive(Debug, Clone, Default)]
pub struct StepResult {
    /// One token per item with `samples`, in item order.
    pub sampled: Vec<u32>,
    /// How long the engine must still wait before the step's results are real.
    pub wait: Duration,
    /// The modelled cost, where the backend models one.
    pub cost: Option<StepCost>,
    /// Per sampled token, in the order of `sampled`: its log-probabilities when the request
    /// asked for them (may be empty when no request did).
    pub logprobs: Vec<Option<Arc<TokenLogprobs>>>,
}

/// Logits kept per sampled item while switched on: tests and detectors compare backends by
/// them. Shared by the backends that compute.
#[derive(Debug, Default)]
pub struct LogitCapture(Option<Vec<(SeqId, Vec<f32>)>>);

impl LogitCapture {
    pub fn set(&mut self, on: bool) {
        self.0 = on.then(Vec::new);
    }

    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Keeps `logits` of sequence `seq` when on.
    pub fn push(&mut self, seq: SeqId, logits: Vec<f32>) {
        if let Some(c) = self.0.as_mut() {
            c.push((seq, logits));
        }
    }

    /// What was kept since the last call, in step order.
    pub fn take(&mut self) -> Vec<(SeqId, Vec<f32>)> {
        self.0.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

pub trait EngineBackend: Send + 'static {
    /// `sim`, `cpu` or `cuda`: the `--backend` value and the metrics label.
    fn name(&self) -> &'static str;
    /// Whether `execute` computes for real (and so must run off the async runtime).
    fn computes(&self) -> bool {
        false
    }
    fn execute(&mut self, items: &[ScheduledItem]) -> StepResult;
    /// The replica's peak model FLOP/s on the wall clock, where the backend knows it: the
    /// denominator of model FLOPs utilisation (the sim: its GPU's bf16 peak × tensor
    /// parallel ÷ time scale). `None` where it does not (cpu, cuda).
    fn peak_flops(&self) -> Option<f64> {
        None
    }
}
