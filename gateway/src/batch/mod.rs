//! The OpenAI Batch API, run on the fleet's trough. A client uploads a JSONL file of requests
//! (`POST /v1/files`, `purpose=batch`) and creates a batch over it (`POST /v1/batches` with a
//! `completion_window`); the gateway keeps both in an embedded SQLite database and feeds the
//! lines into the fleet only while the interactive routes have room under their promises,
//! through the same request path an interactive request takes. The parts, one file each:
//!
//! - [`api`] — the endpoints (files: upload, list, retrieve, content, delete; batches: create,
//!   list, retrieve, cancel), per tenant;
//! - [`multipart`] — the upload's `multipart/form-data` body; [`jsonl`] — the input file's
//!   checks, each problem a 400 naming its line;
//! - [`objects`] — the OpenAI objects and ids; [`store`] — the database;
//! - [`trough`] — which replicas may take a batch line now; [`line`] — one line through the
//!   request pipeline; `attempt` — one line's try, its result written; [`runner`] — the
//!   feeding loop: dispatch, results, cancel, expiry, retention.
//!
//! A gateway killed mid-job finds its unfinished batches in the database on restart and runs
//! the lines that have no result yet; results are keyed by line, so each `custom_id` is in
//! the output once.

pub mod api;
mod attempt;
pub mod jsonl;
pub mod line;
pub mod multipart;
pub mod objects;
pub mod runner;
pub mod store;
pub mod trough;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use config::batch::BatchConfig;

use crate::batch::store::{Store, StoreError};

/// The Batch API's shared part: its settings, its database, and the runner's doorbell.
pub struct Batches {
    pub cfg: BatchConfig,
    pub store: Arc<Store>,
    /// Rung when a batch is created or cancelled, so the runner looks at once.
    pub wake: tokio::sync::Notify,
    /// This gateway's name in the batches' leases (`store/lease.rs`).
    pub node_id: String,
    /// Uploads and creations in progress at once (each holds a whole file and checks it).
    pub heavy: tokio::sync::Semaphore,
}

impl Batches {
    /// Opens the database `cfg` names for the gateway serving at `api_addr`; `None` when
    /// the API is off.
    pub fn open(
        cfg: &BatchConfig,
        api_addr: SocketAddr,
    ) -> Result<Option<Arc<Batches>>, StoreError> {
        let Some(path) = &cfg.path else {
            return Ok(None);
        };
        let store = Store::open(Path::new(path))?;
        let node_id = cfg.node_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "kvgate".into());
            format!("{host}/{api_addr}")
        });
        tracing::info!(path, node_id, "Batch API on");
        Ok(Some(Arc::new(Batches {
            cfg: cfg.clone(),
            store,
            wake: tokio::sync::Notify::new(),
            node_id,
            heavy: tokio::sync::Semaphore::new(2),
        })))
    }

    /// How long a claim on a batch lasts, and how often it is renewed.
    pub fn lease(&self) -> (Duration, Duration) {
        let lease = Duration::from_secs(self.cfg.lease_s);
        (lease, lease / 3)
    }

    /// At a clean stop: batch lines still running were cut with the drain; their batches go
    /// back to the database unclaimed, for the next gateway to take at once.
    pub fn release_claims(&self) {
        match self.store.release(&self.node_id) {
            Ok(n) if n > 0 => tracing::info!(batches = n, "batch claims released"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot release the batch claims"),
        }
    }

    /// Lines this gateway runs at once for `healthy` replicas.
    pub fn max_in_flight(&self, healthy: usize) -> usize {
        match self.cfg.max_in_flight {
            0 => self.cfg.max_per_replica * healthy.max(1),
            n => n,
        }
    }
}
