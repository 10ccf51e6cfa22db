//! How a batch ends: finalising (the output and error files, written in one transaction with
//! the final status) and retention (what ended long ago is deleted).

use rusqlite::{params, TransactionBehavior};

use super::{insert_file, Ending, Store, StoreError, UNFINISHED};
use crate::batch::objects::{error_line, new_id, FileRow, Status};

impl Store {
    /// Ends a batch in one transaction: the output file (successful lines, in line order),
    /// the error file (failed lines, then — when expired or cancelled — the lines never run),
    /// the final status and its time; the two files are kept until `files_expire`. A batch
    /// already ended is left as it is.
    pub fn finalize(
        &self,
        id: &str,
        ending: Ending,
        now: i64,
        files_expire: i64,
    ) -> Result<(), StoreError> {
        let mut c = self.conn.lock();
        // Immediate: it reads then writes, and another gateway on the file may be writing.
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let (tenant, status): (String, String) = tx.query_row(
            "SELECT tenant, status FROM batches WHERE id = ?1",
            params![id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        if Status::parse(&status).is_final() {
            return Ok(());
        }
        let collect = |ok: bool| -> rusqlite::Result<Vec<u8>> {
            let mut q = tx
                .prepare("SELECT line FROM results WHERE batch_id = ?1 AND ok = ?2 ORDER BY idx")?;
            let mut out = Vec::new();
            for l in q.query_map(params![id, ok], |r| r.get::<_, String>(0))? {
                out.extend_from_slice(l?.as_bytes());
                out.push(b'\n');
            }
            Ok(out)
        };
        let output = collect(true)?;
        let mut errors = collect(false)?;
        let unrun = match ending {
            Ending::Completed => None,
            Ending::Expired => Some((
                "batch_expired",
                "This request could not be executed before the completion window expired.",
            )),
            Ending::Cancelled => Some((
                "batch_cancelled",
                "This request was not executed because the batch was cancelled.",
            )),
        };
        if let Some((code, message)) = unrun {
            let mut q = tx.prepare(
                "SELECT l.custom_id FROM lines l LEFT JOIN results r
                   ON r.batch_id = l.batch_id AND r.idx = l.idx
                 WHERE l.batch_id = ?1 AND r.idx IS NULL ORDER BY l.idx",
            )?;
            for custom_id in q.query_map(params![id], |r| r.get::<_, String>(0))? {
                let line = error_line(&custom_id?, code, message).to_string();
                errors.extend_from_slice(line.as_bytes());
                errors.push(b'\n');
            }
        }
        let file = |content: &[u8], kind: &str| -> rusqlite::Result<Option<String>> {
            if content.is_empty() {
                return Ok(None);
            }
            let f = FileRow {
                id: new_id("file-"),
                tenant: tenant.clone(),
                purpose: "batch_output".into(),
                filename: format!("{id}_{kind}.jsonl"),
                bytes: content.len() as i64,
                created_at: now,
                expires_at: Some(files_expire),
            };
            insert_file(&tx, &f, content)?;
            Ok(Some(f.id))
        };
        let output_id = file(&output, "output")?;
        let error_id = file(&errors, "error")?;
        let (status, at) = match ending {
            Ending::Completed => ("completed", "completed_at"),
            Ending::Expired => ("expired", "expired_at"),
            Ending::Cancelled => ("cancelled", "cancelled_at"),
        };
        tx.execute(
            &format!(
                "UPDATE batches SET status = ?2, {at} = ?3, finalizing_at = coalesce(finalizing_at, ?3),
                 output_file_id = ?4, error_file_id = ?5 WHERE id = ?1"
            ),
            params![id, status, now, output_id, error_id],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Marks a batch `failed` (its files could not be written: `finalize` kept failing).
    pub fn fail(&self, id: &str, now: i64) -> Result<(), StoreError> {
        self.conn.lock().execute(
            &format!(
                "UPDATE batches SET status = 'failed', failed_at = ?2 WHERE id = ?1 AND status IN {UNFINISHED}"
            ),
            params![id, now],
        )?;
        Ok(())
    }

    /// Deletes batches that ended before `before` (with their lines and results) and files
    /// created before it that no unfinished batch reads; how many rows went.
    pub fn expire(&self, before: i64) -> Result<usize, StoreError> {
        let mut c = self.conn.lock();
        let tx = c.transaction()?;
        let gone =
            "SELECT id FROM batches WHERE status IN ('completed', 'failed', 'expired', 'cancelled')
               AND coalesce(completed_at, failed_at, expired_at, cancelled_at, created_at) < ?1";
        let mut n = tx.execute(
            &format!("DELETE FROM results WHERE batch_id IN ({gone})"),
            params![before],
        )?;
        n += tx.execute(
            &format!("DELETE FROM lines WHERE batch_id IN ({gone})"),
            params![before],
        )?;
        n += tx.execute(
            &format!("DELETE FROM batches WHERE id IN ({gone})"),
            params![before],
        )?;
        n += tx.execute(
            &format!(
                "DELETE FROM files WHERE created_at < ?1 AND id NOT IN (
                   SELECT input_file_id FROM batches WHERE status IN {UNFINISHED})"
            ),
            params![before],
        )?;
        tx.commit()?;
        // The freed pages are reused by later writes (`bytes_used` counts pages in use); no
        // VACUUM, which would copy the whole database while holding the write lock.
        Ok(n)
    }
}
