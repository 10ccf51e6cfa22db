//! The Batch API's database: SQLite through rusqlite (bundled, so nothing to install). Four
//! tables — `files` (uploads and the output and error files, content inline), `batches` (the
//! OpenAI object's fields, counts, and an owner and lease for several gateways), `lines` (each
//! input line's `custom_id` and body, copied from the file at creation), `results` (one row per
//! finished line, keyed by batch and line). A result is written with `INSERT OR IGNORE` and the
//! batch's counts move in the same transaction only when the row is new: a line may run twice
//! (a gateway killed after the replica answered but before the write), its result is kept
//! once, and the output file, built in line order at finalize, names each `custom_id` once.
//!
//! Every call is synchronous and short; callers on the async runtime go through
//! [`Store::call`], which runs it on tokio's blocking pool.

use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use crate::batch::objects::{BatchRow, FileRow, Status, Usage};

mod ending;
mod lease;
#[cfg(test)]
mod tests;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("batch database {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("batch database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("batch database task failed: {0}")]
    Join(String),
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS files(
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
  bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, content BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files(tenant, created_at);
CREATE TABLE IF NOT EXISTS batches(
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL,
  input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
  created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER NOT NULL,
  finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
  cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT,
  total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
  failed INTEGER NOT NULL DEFAULT 0, metadata TEXT, owner TEXT, lease_until INTEGER,
  model TEXT, input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
  output_tokens INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches(tenant, created_at);
CREATE TABLE IF NOT EXISTS lines(
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body BLOB NOT NULL,
  PRIMARY KEY(batch_id, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS results(
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL,
  PRIMARY KEY(batch_id, idx)) WITHOUT ROWID;
";

/// Columns added after the first version, for a database an older gateway created:
/// `(name, definition)`.
const ADDED_BATCH_COLUMNS: [(&str, &str); 4] = [
    ("model", "TEXT"),
    ("input_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("cached_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("output_tokens", "INTEGER NOT NULL DEFAULT 0"),
];

/// The schema's version, kept in `PRAGMA user_version`.
const SCHEMA_VERSION: i64 = 2;

pub(super) const BATCH_COLUMNS: &str = "id, tenant, endpoint, input_file_id, completion_window, status, \
     created_at, in_progress_at, expires_at, finalizing_at, completed_at, failed_at, expired_at, \
     cancelling_at, cancelled_at, output_file_id, error_file_id, total, completed, failed, metadata, \
     model, input_tokens, cached_tokens, output_tokens";

/// The statuses of a batch still to run or to finish, as an SQL list.
pub(super) const UNFINISHED: &str = "('validating', 'in_progress', 'finalizing', 'cancelling')";

pub(super) const FILE_COLUMNS: &str =
    "id, tenant, purpose, filename, bytes, created_at, expires_at";

pub(super) fn batch_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<BatchRow> {
    Ok(BatchRow {
        id: r.get(0)?,
        tenant: r.get(1)?,
        endpoint: r.get(2)?,
        input_file_id: r.get(3)?,
        completion_window: r.get(4)?,
        status: Status::parse(&r.get::<_, String>(5)?),
        created_at: r.get(6)?,
        in_progress_at: r.get(7)?,
        expires_at: r.get(8)?,
        finalizing_at: r.get(9)?,
        completed_at: r.get(10)?,
        failed_at: r.get(11)?,
        expired_at: r.get(12)?,
        cancelling_at: r.get(13)?,
        cancelled_at: r.get(14)?,
        output_file_id: r.get(15)?,
        error_file_id: r.get(16)?,
        total: r.get(17)?,
        completed: r.get(18)?,
        failed: r.get(19)?,
        metadata: r.get(20)?,
        model: r.get(21)?,
        usage: Usage {
            input_tokens: r.get(22)?,
            cached_tokens: r.get(23)?,
            output_tokens: r.get(24)?,
        },
    })
}

fn file_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<FileRow> {
    Ok(FileRow {
        id: r.get(0)?,
        tenant: r.get(1)?,
        purpose: r.get(2)?,
        filename: r.get(3)?,
        bytes: r.get(4)?,
        created_at: r.get(5)?,
        expires_at: r.get(6)?,
    })
}

/// One input line as stored: its position in the file, `custom_id` and request body.
#[derive(Debug, Clone)]
pub struct StoredLine {
    pub idx: i64,
    pub custom_id: String,
    pub body: Vec<u8>,
}

/// How a batch ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Completed,
    /// Past its window: lines not run are written to the error file as `batch_expired`.
    Expired,
    /// Cancelled: lines not run are written to the error file as `batch_cancelled`.
    Cancelled,
}

pub struct Store {
    pub(super) conn: Mutex<Connection>,
}

impl Store {
    /// Opens (creating when missing) the database at `path`.
    pub fn open(path: &Path) -> Result<Arc<Store>, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(dir);
        }
        let open = |source| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        let mut conn = Connection::open(path).map_err(open)?;
        // WAL: readers never wait for the writer; NORMAL: a commit survives the process being
        // killed (not a power cut between checkpoints, which FULL would cost an fsync per
        // result for).
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(open)?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // The WAL file is cut back to this after each checkpoint.
        conn.pragma_update(None, "journal_size_limit", 64i64 << 20)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        migrate(&mut conn)?;
        Ok(Arc::new(Store {
            conn: Mutex::new(conn),
        }))
    }

    /// Runs `f` on the blocking pool with the connection.
    pub async fn call<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || f(&me))
            .await
            .map_err(|e| StoreError::Join(e.to_string()))?
    }

    /// The bytes the database's data takes (pages in use; freed pages are reused by later
    /// writes, so deleting a file makes room at once although the file does not shrink).
    pub fn bytes_used(&self) -> Result<u64, StoreError> {
        used_bytes(&self.conn.lock())
    }

    /// Stores a file unless that would take the database past `max_bytes`: `false` then.
    /// The check and the write are one transaction (other gateways on the file included).
    pub fn insert_file(
        &self,
        f: &FileRow,
        content: &[u8],
        max_bytes: u64,
    ) -> Result<bool, StoreError> {
        let mut c = self.conn.lock();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if used_bytes(&tx)? + content.len() as u64 > max_bytes {
            return Ok(false);
        }
        insert_file(&tx, f, content)?;
        tx.commit()?;
        Ok(true)
    }

    pub fn file(&self, tenant: &str, id: &str) -> Result<Option<FileRow>, StoreError> {
        Ok(self
            .conn
            .lock()
            .query_row(
                &format!("SELECT {FILE_COLUMNS} FROM files WHERE id = ?1 AND tenant = ?2"),
                params![id, tenant],
                file_row,
            )
            .optional()?)
    }

    pub fn file_content(&self, tenant: &str, id: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .conn
            .lock()
            .query_row(
                "SELECT content FROM files WHERE id = ?1 AND tenant = ?2",
                params![id, tenant],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// The tenant's files, newest first, after the one named `after` (a page of `limit`).
    pub fn list_files(
        &self,
        tenant: &str,
        purpose: Option<&str>,
        limit: usize,
        after: Option<&str>,
    ) -> Result<Vec<FileRow>, StoreError> {
        let c = self.conn.lock();
        let mut q = c.prepare(&format!(
            "SELECT {FILE_COLUMNS} FROM files WHERE tenant = ?1 AND (?2 IS NULL OR purpose = ?2)
             AND (?3 IS NULL OR (created_at, id) <
                  (SELECT created_at, id FROM files WHERE id = ?3 AND tenant = ?1))
             ORDER BY created_at DESC, id DESC LIMIT ?4"
        ))?;
        let rows = q.query_map(params![tenant, purpose, after, limit as i64], file_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Deletes a file; `false` when the tenant has none by that id.
    pub fn delete_file(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        Ok(self.conn.lock().execute(
            "DELETE FROM files WHERE id = ?1 AND tenant = ?2",
            params![id, tenant],
        )? == 1)
    }

    /// Creates a batch and its lines in one transaction, unless its tenant has
    /// `max_unfinished` unfinished batches already: `Err(n)` with their count then.
    pub fn create_batch(
        &self,
        b: &BatchRow,
        lines: &[StoredLine],
        max_unfinished: usize,
    ) -> Result<Result<(), usize>, StoreError> {
        let mut c = self.conn.lock();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let unfinished: i64 = tx.query_row(
            &format!("SELECT count(*) FROM batches WHERE tenant = ?1 AND status IN {UNFINISHED}"),
            params![b.tenant],
            |r| r.get(0),
        )?;
        if unfinished as usize >= max_unfinished {
            return Ok(Err(unfinished as usize));
        }
        tx.execute(
            "INSERT INTO batches(id, tenant, endpoint, input_file_id, completion_window, status,
               created_at, in_progress_at, expires_at, total, metadata, model)
             VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12)",
            params![
                b.id,
                b.tenant,
                b.endpoint,
                b.input_file_id,
                b.completion_window,
                b.status.as_str(),
                b.created_at,
                b.in_progress_at,
                b.expires_at,
                b.total,
                b.metadata,
                b.model
            ],
        )?;
        {
            let mut ins = tx.prepare(
                "INSERT INTO lines(batch_id, idx, custom_id, body) VALUES (?1,?2,?3,?4)",
            )?;
            for l in lines {
                ins.execute(params![b.id, l.idx, l.custom_id, l.body])?;
            }
        }
        tx.commit()?;
        Ok(Ok(()))
    }

    pub fn batch(&self, tenant: &str, id: &str) -> Result<Option<BatchRow>, StoreError> {
        Ok(self
            .conn
            .lock()
            .query_row(
                &format!("SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?1 AND tenant = ?2"),
                params![id, tenant],
                batch_row,
            )
            .optional()?)
    }

    /// The tenant's batches, newest first, after the one named `after`.
    pub fn list_batches(
        &self,
        tenant: &str,
        limit: usize,
        after: Option<&str>,
    ) -> Result<Vec<BatchRow>, StoreError> {
        let c = self.conn.lock();
        let mut q = c.prepare(&format!(
            "SELECT {BATCH_COLUMNS} FROM batches WHERE tenant = ?1
             AND (?2 IS NULL OR (created_at, id) <
                  (SELECT created_at, id FROM batches WHERE id = ?2 AND tenant = ?1))
             ORDER BY created_at DESC, id DESC LIMIT ?3"
        ))?;
        let rows = q.query_map(params![tenant, after, limit as i64], batch_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The positions of a batch's lines with no result yet, in order.
    pub fn pending(&self, batch: &str) -> Result<Vec<i64>, StoreError> {
        let c = self.conn.lock();
        let mut q = c.prepare(
            "SELECT l.idx FROM lines l LEFT JOIN results r
               ON r.batch_id = l.batch_id AND r.idx = l.idx
             WHERE l.batch_id = ?1 AND r.idx IS NULL ORDER BY l.idx",
        )?;
        let rows = q.query_map(params![batch], |r| r.get(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn line(&self, batch: &str, idx: i64) -> Result<Option<StoredLine>, StoreError> {
        Ok(self
            .conn
            .lock()
            .query_row(
                "SELECT idx, custom_id, body FROM lines WHERE batch_id = ?1 AND idx = ?2",
                params![batch, idx],
                |r| {
                    Ok(StoredLine {
                        idx: r.get(0)?,
                        custom_id: r.get(1)?,
                        body: r.get(2)?,
                    })
                },
            )
            .optional()?)
    }

    /// Keeps a line's result unless it has one already; `true` when this call wrote it. The
    /// batch's counts and token sums (from the answer's `usage` in `line`) move only then.
    pub fn record(&self, batch: &str, idx: i64, ok: bool, line: &str) -> Result<bool, StoreError> {
        let mut c = self.conn.lock();
        let tx = c.transaction()?;
        // Not into a batch already ended (a line that finished after a cancel or a takeover's
        // finalise): its files are written and its counts final.
        let new = tx.execute(
            &format!(
                "INSERT OR IGNORE INTO results(batch_id, idx, ok, line)
                 SELECT ?1, ?2, ?3, ?4 WHERE EXISTS
                   (SELECT 1 FROM batches WHERE id = ?1 AND status IN {UNFINISHED})"
            ),
            params![batch, idx, ok, line],
        )? == 1;
        if new {
            let column = if ok { "completed" } else { "failed" };
            tx.execute(
                &format!(
                    "UPDATE batches SET {column} = {column} + 1,
                       input_tokens = input_tokens + coalesce(json_extract(?2, '$.response.body.usage.prompt_tokens'), 0),
                       cached_tokens = cached_tokens + coalesce(json_extract(?2, '$.response.body.usage.prompt_tokens_details.cached_tokens'), 0),
                       output_tokens = output_tokens + coalesce(json_extract(?2, '$.response.body.usage.completion_tokens'), 0)
                     WHERE id = ?1"
                ),
                params![batch, line],
            )?;
        }
        tx.commit()?;
        Ok(new)
    }

    /// Marks a batch `cancelling` (from `validating` or `in_progress`); the row after.
    pub fn cancel(&self, tenant: &str, id: &str, now: i64) -> Result<Option<BatchRow>, StoreError> {
        self.conn.lock().execute(
            "UPDATE batches SET status = 'cancelling', cancelling_at = ?3
             WHERE id = ?1 AND tenant = ?2 AND status IN ('validating', 'in_progress')",
            params![id, tenant, now],
        )?;
        self.batch(tenant, id)
    }
}

/// Brings a database an older gateway created up to [`SCHEMA_VERSION`]: the batch columns
/// added since (a fresh database has them from `SCHEMA`).
/// One transaction, so two gateways opening the file at once do not both add a column.
fn migrate(c: &mut Connection) -> Result<(), StoreError> {
    let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version >= SCHEMA_VERSION {
        return Ok(());
    }
    for (name, definition) in ADDED_BATCH_COLUMNS {
        let present: bool = tx.query_row(
            "SELECT count(*) > 0 FROM pragma_table_info('batches') WHERE name = ?1",
            params![name],
            |r| r.get(0),
        )?;
        if !present {
            tx.execute_batch(&format!(
                "ALTER TABLE batches ADD COLUMN {name} {definition}"
            ))?;
        }
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    tx.commit()?;
    Ok(())
}

/// Pages in use × page size.
fn used_bytes(c: &Connection) -> Result<u64, StoreError> {
    let pages: i64 = c.query_row("PRAGMA page_count", [], |r| r.get(0))?;
    let free: i64 = c.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
    let size: i64 = c.query_row("PRAGMA page_size", [], |r| r.get(0))?;
    Ok(((pages - free).max(0) * size) as u64)
}

/// Writes a file row with its content.
pub(super) fn insert_file(c: &Connection, f: &FileRow, content: &[u8]) -> rusqlite::Result<()> {
    c.execute(
        &format!("INSERT INTO files({FILE_COLUMNS}, content) VALUES (?1,?2,?3,?4,?5,?6,?7,?8)"),
        params![
            f.id,
            f.tenant,
            f.purpose,
            f.filename,
            f.bytes,
            f.created_at,
            f.expires_at,
            content
        ],
    )?;
    Ok(())
}
