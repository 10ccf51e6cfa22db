//! Wall-clock time as the OpenAI wire format and the admin endpoints carry it: whole seconds
//! since the Unix epoch (`created`, `loaded_at_unix`). Only timestamps shown to people or
//! clients go through here; durations and deadlines use a monotonic clock.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch; 0 if the system clock reads earlier than the epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
