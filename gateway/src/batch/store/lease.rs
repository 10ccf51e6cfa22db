//! Several gateways on one database: each unfinished batch is run by one gateway at a time,
//! the one holding its lease (`owner`, `lease_until`). A gateway claims, in one `BEGIN
//! IMMEDIATE` transaction (SQLite's write lock, so two claims never interleave), every
//! unfinished batch that has no owner, is its own, or whose owner's lease ran out, and
//! extends the lease on all of them; it claims again every third of the lease. A gateway that
//! dies stops renewing, and another takes its batches once the lease is past; one restarted
//! under the same node id takes them back at once. A line started by the old owner may also
//! finish after the takeover: results are kept once per line, so the output is unchanged.

use rusqlite::{params, TransactionBehavior};

use super::{batch_row, Store, StoreError, BATCH_COLUMNS, UNFINISHED};
use crate::batch::objects::BatchRow;

impl Store {
    /// Claims for `me` until `lease_until` what is free, and returns what `me` now holds,
    /// oldest first.
    pub fn claim(&self, me: &str, now: i64, lease_until: i64) -> Result<Vec<BatchRow>, StoreError> {
        let mut c = self.conn.lock();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            &format!(
                "UPDATE batches SET owner = ?1, lease_until = ?3 WHERE status IN {UNFINISHED}
                   AND (owner IS NULL OR owner = ?1 OR lease_until IS NULL OR lease_until < ?2)"
            ),
            params![me, now, lease_until],
        )?;
        let rows = {
            let mut q = tx.prepare(&format!(
                "SELECT {BATCH_COLUMNS} FROM batches WHERE owner = ?1 AND status IN {UNFINISHED}
                 ORDER BY created_at, id"
            ))?;
            let rows = q.query_map(params![me], batch_row)?;
            rows.collect::<Result<Vec<_>, _>>()?
        };
        tx.commit()?;
        Ok(rows)
    }

    /// Gives up `me`'s claims (a gateway stopping cleanly), so another gateway, or this one
    /// restarted on another address, takes the batches at once rather than after the lease.
    pub fn release(&self, me: &str) -> Result<usize, StoreError> {
        Ok(self.conn.lock().execute(
            "UPDATE batches SET owner = NULL, lease_until = NULL WHERE owner = ?1",
            params![me],
        )?)
    }
}
