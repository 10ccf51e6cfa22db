use super::*;
use crate::batch::objects::{new_id, now_s};

fn store() -> (Arc<Store>, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("{}.sqlite3", new_id("kvgate-store-test-")));
    (Store::open(&path).unwrap(), path)
}

fn new_row(lines: usize) -> BatchRow {
    let now = now_s();
    BatchRow {
        id: new_id("batch_"),
        tenant: "t".into(),
        endpoint: "/v1/completions".into(),
        input_file_id: "file-x".into(),
        completion_window: "1h".into(),
        status: Status::InProgress,
        created_at: now,
        in_progress_at: Some(now),
        expires_at: now + 3600,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
        output_file_id: None,
        error_file_id: None,
        total: lines as i64,
        completed: 0,
        failed: 0,
        metadata: None,
        model: Some("m".into()),
        usage: Default::default(),
    }
}

fn batch(s: &Store, lines: usize) -> BatchRow {
    let row = new_row(lines);
    let stored: Vec<StoredLine> = (0..lines)
        .map(|i| StoredLine {
            idx: i as i64,
            custom_id: format!("c{i}"),
            body: b"{}".to_vec(),
        })
        .collect();
    s.create_batch(&row, &stored, usize::MAX).unwrap().unwrap();
    row
}

fn content(s: &Store, id: &Option<String>) -> Vec<serde_json::Value> {
    let bytes = s
        .file_content("t", id.as_deref().unwrap())
        .unwrap()
        .unwrap();
    String::from_utf8(bytes)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_line_run_twice_is_kept_and_counted_once_and_the_output_is_in_line_order() {
    let (s, path) = store();
    let b = batch(&s, 3);
    assert_eq!(s.pending(&b.id).unwrap(), [0, 1, 2]);
    let line = |c: &str| format!("{{\"custom_id\":\"{c}\"}}");
    assert!(s.record(&b.id, 2, true, &line("c2")).unwrap());
    assert!(
        !s.record(&b.id, 2, true, &line("c2")).unwrap(),
        "second run ignored"
    );
    assert!(s.record(&b.id, 0, true, &line("c0")).unwrap());
    assert!(s.record(&b.id, 1, false, &line("c1")).unwrap());
    assert!(s.pending(&b.id).unwrap().is_empty());
    s.finalize(&b.id, Ending::Completed, now_s(), now_s() + 3600)
        .unwrap();
    let done = s.batch("t", &b.id).unwrap().unwrap();
    assert_eq!(done.status, Status::Completed);
    assert_eq!((done.completed, done.failed), (2, 1));
    let out: Vec<_> = content(&s, &done.output_file_id)
        .iter()
        .map(|v| v["custom_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(out, ["c0", "c2"]);
    assert_eq!(content(&s, &done.error_file_id).len(), 1);
    // A line that finishes after the end changes nothing either.
    assert!(!s.record(&b.id, 1, true, &line("c1")).unwrap());
    // Finalising again changes nothing.
    s.finalize(&b.id, Ending::Cancelled, now_s(), now_s() + 3600)
        .unwrap();
    assert_eq!(s.batch("t", &b.id).unwrap().unwrap(), done);
    // Another tenant sees none of it.
    assert!(s.batch("u", &b.id).unwrap().is_none());
    assert!(s
        .file_content("u", done.output_file_id.as_deref().unwrap())
        .unwrap()
        .is_none());
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_cancelled_batch_lists_the_lines_it_never_ran_as_errors() {
    let (s, path) = store();
    let b = batch(&s, 3);
    s.record(&b.id, 1, true, "{\"custom_id\":\"c1\"}").unwrap();
    let c = s.cancel("t", &b.id, now_s()).unwrap().unwrap();
    assert_eq!(c.status, Status::Cancelling);
    assert!(
        s.cancel("u", &b.id, now_s()).unwrap().is_none(),
        "not the tenant's"
    );
    s.finalize(&b.id, Ending::Cancelled, now_s(), now_s() + 3600)
        .unwrap();
    let done = s.batch("t", &b.id).unwrap().unwrap();
    assert_eq!(done.status, Status::Cancelled);
    assert!(done.cancelled_at.is_some());
    let errors = content(&s, &done.error_file_id);
    let ids: Vec<_> = errors
        .iter()
        .map(|v| v["custom_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["c0", "c2"]);
    assert_eq!(errors[0]["error"]["code"], "batch_cancelled");
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_batch_is_held_by_one_gateway_until_its_lease_runs_out() {
    let (s, path) = store();
    let b = batch(&s, 1);
    let now = now_s();
    assert_eq!(s.claim("a", now, now + 30).unwrap().len(), 1);
    assert!(
        s.claim("b", now + 10, now + 40).unwrap().is_empty(),
        "a holds it"
    );
    assert_eq!(
        s.claim("a", now + 20, now + 50).unwrap().len(),
        1,
        "renewed"
    );
    assert!(s.claim("b", now + 40, now + 70).unwrap().is_empty());
    assert_eq!(
        s.claim("b", now + 51, now + 81).unwrap()[0].id,
        b.id,
        "taken over"
    );
    assert!(
        s.claim("a", now + 52, now + 82).unwrap().is_empty(),
        "a lost it"
    );
    // A clean stop gives the claim up: the next gateway takes it at once.
    assert_eq!(s.release("b").unwrap(), 1);
    assert_eq!(
        s.claim("c", now + 53, now + 83).unwrap().len(),
        1,
        "released"
    );
    s.finalize(&b.id, Ending::Completed, now, now + 3600)
        .unwrap();
    assert!(
        s.claim("c", now + 54, now + 84).unwrap().is_empty(),
        "finished"
    );
    let _ = std::fs::remove_file(path);
}

#[test]
fn retention_deletes_what_ended_long_ago() {
    let (s, path) = store();
    let b = batch(&s, 1);
    s.record(&b.id, 0, true, "{\"custom_id\":\"c0\"}").unwrap();
    s.finalize(&b.id, Ending::Completed, now_s(), now_s() + 3600)
        .unwrap();
    let running = batch(&s, 1);
    assert_eq!(s.expire(now_s() - 10).unwrap(), 0, "nothing old enough");
    assert!(s.expire(now_s() + 10).unwrap() > 0);
    assert!(s.batch("t", &b.id).unwrap().is_none());
    assert!(
        s.batch("t", &running.id).unwrap().is_some(),
        "unfinished batches stay"
    );
    let _ = std::fs::remove_file(path);
}

#[test]
fn the_limits_are_checked_in_the_write_that_they_guard() {
    let (s, path) = store();
    batch(&s, 1);
    let row = |_: usize| new_row(0);
    // One unfinished batch already: a limit of 1 refuses the next, naming the count.
    assert_eq!(s.create_batch(&row(1), &[], 1).unwrap(), Err(1));
    assert_eq!(s.create_batch(&row(2), &[], 2).unwrap(), Ok(()));
    // A file that would take the database past its limit is refused; deleting makes room.
    let file = |id: &str| FileRow {
        id: id.into(),
        tenant: "t".into(),
        purpose: "batch".into(),
        filename: "f.jsonl".into(),
        bytes: 1 << 20,
        created_at: now_s(),
        expires_at: None,
    };
    let mib = vec![b'x'; 1 << 20];
    let limit = s.bytes_used().unwrap() + (3 << 20) / 2;
    assert!(s.insert_file(&file("file-a"), &mib, limit).unwrap());
    assert!(
        !s.insert_file(&file("file-b"), &mib, limit).unwrap(),
        "over the limit"
    );
    assert!(s.delete_file("t", "file-a").unwrap());
    assert!(
        s.insert_file(&file("file-b"), &mib, limit).unwrap(),
        "freed pages count"
    );
    let _ = std::fs::remove_file(path);
}

#[test]
fn the_batch_sums_each_kept_answers_usage_once_and_names_its_model() {
    let (s, path) = store();
    let b = batch(&s, 3);
    let answer = |c: &str, prompt: u64, cached: u64, out: u64| {
        crate::batch::objects::answered_line(
            c,
            200,
            None,
            serde_json::json!({"usage": {"prompt_tokens": prompt, "completion_tokens": out,
                "prompt_tokens_details": {"cached_tokens": cached}}}),
        )
        .to_string()
    };
    assert!(s
        .record(&b.id, 0, true, &answer("c0", 100, 64, 10))
        .unwrap());
    // Run again (a takeover's repeat): not summed twice.
    assert!(!s
        .record(&b.id, 0, true, &answer("c0", 100, 64, 10))
        .unwrap());
    // An answer without `prompt_tokens_details` (a /v1/completions replica that reports none).
    let plain = crate::batch::objects::answered_line(
        "c1",
        200,
        None,
        serde_json::json!({"usage": {"prompt_tokens": 50, "completion_tokens": 5}}),
    );
    assert!(s.record(&b.id, 1, true, &plain.to_string()).unwrap());
    // A line that got no answer carries no usage.
    let error = crate::batch::objects::error_line("c2", "internal_error", "x").to_string();
    assert!(s.record(&b.id, 2, false, &error).unwrap());
    let row = s.batch("t", &b.id).unwrap().unwrap();
    assert_eq!(
        row.usage,
        Usage {
            input_tokens: 150,
            cached_tokens: 64,
            output_tokens: 15
        }
    );
    assert_eq!(row.model.as_deref(), Some("m"));
    let v = row.to_json();
    assert_eq!(v["model"], "m");
    assert_eq!(v["usage"]["total_tokens"], 165);
    assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 64);
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_database_from_before_usage_is_brought_up_to_date_with_its_batches_kept() {
    let path = std::env::temp_dir().join(format!("{}.sqlite3", new_id("kvgate-store-old-")));
    {
        // The first version's batches table, as an older gateway left it.
        let c = Connection::open(&path).unwrap();
        c.execute_batch(
            "CREATE TABLE batches(
               id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL,
               input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
               created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER NOT NULL,
               finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
               cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT,
               total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
               failed INTEGER NOT NULL DEFAULT 0, metadata TEXT, owner TEXT, lease_until INTEGER);
             INSERT INTO batches(id, tenant, endpoint, input_file_id, completion_window, status,
               created_at, expires_at, total, completed)
             VALUES ('batch_old', 't', '/v1/completions', 'file-x', '1h', 'completed', 1, 2, 4, 4);
             PRAGMA user_version = 1;",
        )
        .unwrap();
    }
    let s = Store::open(&path).unwrap();
    let old = s.batch("t", "batch_old").unwrap().unwrap();
    assert_eq!((old.total, old.completed), (4, 4));
    assert_eq!((old.model, old.usage), (None, Usage::default()));
    // New batches work on it, and opening it again changes nothing.
    let b = batch(&s, 1);
    drop(s);
    let s = Store::open(&path).unwrap();
    assert!(s.batch("t", &b.id).unwrap().is_some());
    let _ = std::fs::remove_file(path);
}
