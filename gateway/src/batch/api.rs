//! The Files and Batches endpoints, OpenAI's shapes, each tenant seeing only its own:
//!
//! | | |
//! |---|---|
//! | `POST /v1/files` | upload a JSONL file (`purpose=batch`), checked line by line |
//! | `GET /v1/files`, `GET /v1/files/{id}` | list (`purpose`, `limit`, `after`), retrieve |
//! | `GET /v1/files/{id}/content` | the bytes (inputs, outputs, error files) |
//! | `DELETE /v1/files/{id}` | delete |
//! | `POST /v1/batches` | create over an uploaded file (`endpoint`, `completion_window`) |
//! | `GET /v1/batches`, `GET /v1/batches/{id}` | list (`limit`, `after`), retrieve |
//! | `POST /v1/batches/{id}/cancel` | stop starting lines; running ones finish |
//!
//! Uploading and creating need the `batch` priority class in the caller's API key.

use std::time::Duration;

use bytes::Bytes;
use config::{Grant, Priority};
use pingora::proxy::Session;
use protocol::ApiError;
use serde_json::{json, Value};

use crate::batch::objects::{self, now_s, BatchRow, FileRow, Status};
use crate::batch::store::StoreError;
use crate::batch::{jsonl, multipart, Batches};
use crate::http::body::read_within;
use crate::http::session::{respond, respond_error};
use crate::state::GatewayState;

/// Whether `path` is one of this module's.
pub fn owns(path: &str) -> bool {
    ["/v1/files", "/v1/batches"]
        .iter()
        .any(|p| path == *p || path.strip_prefix(p).is_some_and(|r| r.starts_with('/')))
}

/// Longest a JSON body of this API may be.
const MAX_JSON_BYTES: usize = 1 << 20;
/// An upload's body may take this long (a 200 MiB file on a slow link).
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// A page of a list, by default and at most.
const PAGE: usize = 20;
const MAX_PAGE: usize = 100;

fn store_error(e: StoreError) -> ApiError {
    tracing::error!(error = %e, "batch database");
    ApiError::internal("the batch database failed; the request was not carried out")
}

fn not_found(kind: &str, id: &str) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        format!("No such {kind} object: {id}"),
    )
    .with_code("not_found")
}

fn need_batch_class(grant: Option<&Grant>) -> Result<(), ApiError> {
    match grant {
        Some(g) if !g.allows(Priority::Batch) => Err(ApiError::new(
            403,
            "permission_error",
            format!("tenant {} may not use the batch priority class", g.tenant),
        )
        .with_code("priority_not_allowed")),
        _ => Ok(()),
    }
}

/// A query parameter (the values this API takes need no percent-decoding).
fn query<'a>(q: Option<&'a str>, key: &str) -> Option<&'a str> {
    q?.split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// The page size asked for: `default` when none, at most `max` (OpenAI's: 10,000 files,
/// 100 batches).
fn page(q: Option<&str>, default: usize, max: usize) -> Result<usize, ApiError> {
    match query(q, "limit") {
        None => Ok(default),
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                ApiError::invalid_request(format!("limit must be between 1 and {max}"))
                    .with_param("limit")
            }),
    }
}

async fn json(session: &mut Session, status: u16, v: &Value) -> u16 {
    respond(session, status, Bytes::from(v.to_string()), &[]).await
}

/// Answers a Files or Batches request; returns the status.
pub async fn handle(state: &GatewayState, session: &mut Session, grant: Option<Grant>) -> u16 {
    let Some(b) = state.batch.as_deref() else {
        let e = ApiError::new(
            404,
            "invalid_request_error",
            "the Batch API is off on this gateway: set [batch] path in the gateway file",
        )
        .with_code("batch_api_off");
        return respond_error(session, &e).await;
    };
    let tenant = grant.as_ref().map(|g| g.tenant.clone()).unwrap_or_default();
    let method = session.req_header().method.as_str().to_string();
    let path = session.req_header().uri.path().to_string();
    let q = session.req_header().uri.query().map(str::to_string);
    let parts: Vec<&str> = path.trim_start_matches("/v1/").split('/').collect();
    let result = match (method.as_str(), parts.as_slice()) {
        ("POST", ["files"]) => upload(state, b, session, grant.as_ref(), tenant).await,
        ("GET" | "HEAD", ["files"]) => list_files(b, tenant, q.as_deref()).await,
        ("GET" | "HEAD", ["files", id]) => {
            let id = id.to_string();
            match b.store.call(move |s| s.file(&tenant, &id)).await {
                Ok(Some(f)) => Ok((200, f.to_json())),
                Ok(None) => Err(not_found("File", parts[1])),
                Err(e) => Err(store_error(e)),
            }
        }
        ("GET" | "HEAD", ["files", id, "content"]) => {
            let id = id.to_string();
            return match b.store.call(move |s| s.file_content(&tenant, &id)).await {
                Ok(Some(bytes)) => {
                    let headers = [("content-type", "application/jsonl".to_string())];
                    respond(session, 200, Bytes::from(bytes), &headers).await
                }
                Ok(None) => respond_error(session, &not_found("File", parts[1])).await,
                Err(e) => respond_error(session, &store_error(e)).await,
            };
        }
        ("DELETE", ["files", id]) => {
            let id = id.to_string();
            let id2 = id.clone();
            match b.store.call(move |s| s.delete_file(&tenant, &id2)).await {
                Ok(true) => Ok((200, json!({"id": id, "object": "file", "deleted": true}))),
                Ok(false) => Err(not_found("File", &id)),
                Err(e) => Err(store_error(e)),
            }
        }
        ("POST", ["batches"]) => create(state, b, session, grant.as_ref(), tenant).await,
        ("GET" | "HEAD", ["batches"]) => list_batches(b, tenant, q.as_deref()).await,
        ("GET" | "HEAD", ["batches", id]) => {
            let id = id.to_string();
            match b.store.call(move |s| s.batch(&tenant, &id)).await {
                Ok(Some(r)) => Ok((200, r.to_json())),
                Ok(None) => Err(not_found("Batch", parts[1])),
                Err(e) => Err(store_error(e)),
            }
        }
        ("POST", ["batches", id, "cancel"]) => cancel(b, tenant, id.to_string()).await,
        (m, _) => Err(
            if matches!(
                (m, parts.as_slice()),
                (_, ["files"] | ["files", _] | ["files", _, "content"])
                    | (_, ["batches"] | ["batches", _] | ["batches", _, "cancel"])
            ) {
                ApiError::method_not_allowed(m, &path)
            } else {
                ApiError::not_found_path(&path)
            },
        ),
    };
    match result {
        Ok((status, v)) => json(session, status, &v).await,
        // The openai SDKs retry 409, 429 and 5xx unless told not to; these cannot succeed
        // by retrying (a finished batch, the tenant's batch limit, a full database).
        Err(e) if matches!(e.status, 409 | 507) || e.status == 429 => {
            let headers = [("x-should-retry", "false".to_string())];
            respond(session, e.status, Bytes::from(e.to_json()), &headers).await
        }
        Err(e) => respond_error(session, &e).await,
    }
}

fn busy() -> ApiError {
    ApiError::unavailable("the gateway is shutting down; retry on another instance")
}

type Answer = Result<(u16, Value), ApiError>;

async fn upload(
    state: &GatewayState,
    b: &Batches,
    session: &mut Session,
    grant: Option<&Grant>,
    tenant: String,
) -> Answer {
    need_batch_class(grant)?;
    // A few uploads at a time: each holds its whole body, and checking it is CPU work.
    let _permit = b.heavy.acquire().await.map_err(|_| busy())?;
    let content_type = session
        .req_header()
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let boundary = multipart::boundary(&content_type)?;
    let limit = (b.cfg.max_file_mib << 20) as usize;
    // Room for the form's own bytes around the file.
    let body = read_within(session, limit + (64 << 10), UPLOAD_TIMEOUT, &state.metrics).await?;
    let parts = multipart::parse(&body, &boundary)?;
    let field = |name: &str| parts.iter().find(|p| p.name == name);
    let purpose = field("purpose")
        .map(|p| String::from_utf8_lossy(&p.data).trim().to_string())
        .ok_or_else(|| ApiError::invalid_request("missing `purpose`").with_param("purpose"))?;
    if purpose != "batch" {
        return Err(ApiError::invalid_request(format!(
            "this gateway stores files for the Batch API only: purpose must be \"batch\", got {purpose:?}"
        ))
        .with_param("purpose"));
    }
    let file = field("file")
        .ok_or_else(|| ApiError::invalid_request("missing the `file` part").with_param("file"))?;
    if file.data.len() > limit {
        return Err(ApiError::payload_too_large(limit));
    }
    let lines = checked_lines(file.data.clone(), b.cfg.max_lines).await?;
    served(&lines, &state.models.load())?;
    let now = now_s();
    let row = FileRow {
        id: objects::new_id("file-"),
        tenant,
        purpose,
        filename: file
            .filename
            .clone()
            .unwrap_or_else(|| "batch.jsonl".into()),
        bytes: file.data.len() as i64,
        created_at: now,
        expires_at: Some(now + (b.cfg.retention_h * 3600) as i64),
    };
    let max_disk = b.cfg.max_disk_mib << 20;
    let data = file.data.clone();
    let r = row.clone();
    let stored = b
        .store
        .call(move |s| s.insert_file(&r, &data, max_disk))
        .await
        .map_err(store_error)?;
    if !stored {
        return Err(ApiError::new(
            507,
            "server_error",
            format!(
                "the batch database is at its size limit (batch.max_disk_mib = {}); delete files or wait for finished batches to expire",
                b.cfg.max_disk_mib
            ),
        )
        .with_code("storage_full"));
    }
    Ok((200, row.to_json()))
}

async fn list_files(b: &Batches, tenant: String, q: Option<&str>) -> Answer {
    let limit = page(q, 10_000, 10_000)?;
    let purpose = query(q, "purpose").map(str::to_string);
    let after = query(q, "after").map(str::to_string);
    let rows = b
        .store
        .call(move |s| s.list_files(&tenant, purpose.as_deref(), limit + 1, after.as_deref()))
        .await
        .map_err(store_error)?;
    let more = rows.len() > limit;
    let items = rows.iter().take(limit).map(FileRow::to_json).collect();
    Ok((200, objects::list(items, more)))
}

async fn list_batches(b: &Batches, tenant: String, q: Option<&str>) -> Answer {
    let limit = page(q, PAGE, MAX_PAGE)?;
    let after = query(q, "after").map(str::to_string);
    let rows = b
        .store
        .call(move |s| s.list_batches(&tenant, limit + 1, after.as_deref()))
        .await
        .map_err(store_error)?;
    let more = rows.len() > limit;
    let items = rows.iter().take(limit).map(BatchRow::to_json).collect();
    Ok((200, objects::list(items, more)))
}

#[derive(serde::Deserialize)]
struct CreateBody {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    #[serde(default)]
    metadata: Option<serde_json::Map<String, Value>>,
}

async fn create(
    state: &GatewayState,
    b: &Batches,
    session: &mut Session,
    grant: Option<&Grant>,
    tenant: String,
) -> Answer {
    need_batch_class(grant)?;
    let _permit = b.heavy.acquire().await.map_err(|_| busy())?;
    let body = read_within(session, MAX_JSON_BYTES, state.body_timeout, &state.metrics).await?;
    let req: CreateBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid_request(format!("invalid batch request: {e}")))?;
    if !jsonl::ENDPOINTS.contains(&req.endpoint.as_str()) {
        return Err(ApiError::invalid_request(format!(
            "endpoint must be one of {:?}, got {:?}",
            jsonl::ENDPOINTS,
            req.endpoint
        ))
        .with_param("endpoint"));
    }
    let window = objects::window_seconds(&req.completion_window).ok_or_else(|| {
        ApiError::invalid_request(format!(
            "completion_window must be \"24h\" (or a whole number of hours or minutes up to a week, e.g. \"1h\", \"30m\"), got {:?}",
            req.completion_window
        ))
        .with_param("completion_window")
    })?;
    if let Some(m) = &req.metadata {
        if m.len() > 16 || m.values().any(|v| !v.is_string()) {
            return Err(
                ApiError::invalid_request("metadata holds at most 16 string values")
                    .with_param("metadata"),
            );
        }
    }
    let (t, id) = (tenant.clone(), req.input_file_id.clone());
    let content = b
        .store
        .call(move |s| s.file_content(&t, &id))
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found("File", &req.input_file_id))?;
    let lines = checked_lines(content, b.cfg.max_lines).await?;
    for l in &lines {
        if l.url != req.endpoint {
            return Err(ApiError::invalid_request(format!(
                "line {} of the batch file: its url {} is not the batch's endpoint {}",
                l.line_no, l.url, req.endpoint
            ))
            .with_code("invalid_batch_line"));
        }
    }
    // Again: the models served may have changed since the upload.
    served(&lines, &state.models.load())?;
    // OpenAI's batch names its one model; lines that name several leave it null.
    let model = lines
        .first()
        .map(|l| l.model.clone())
        .filter(|m| lines.iter().all(|l| &l.model == m));
    let now = now_s();
    let row = BatchRow {
        id: objects::new_id("batch_"),
        tenant,
        endpoint: req.endpoint,
        input_file_id: req.input_file_id,
        completion_window: req.completion_window,
        status: Status::InProgress,
        created_at: now,
        in_progress_at: Some(now),
        expires_at: now + window,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
        output_file_id: None,
        error_file_id: None,
        total: lines.len() as i64,
        completed: 0,
        failed: 0,
        metadata: req.metadata.map(|m| Value::Object(m).to_string()),
        model,
        usage: Default::default(),
    };
    let stored: Vec<_> = lines.into_iter().map(|l| l.stored).collect();
    let (r, max_jobs) = (row.clone(), b.cfg.max_jobs_per_tenant);
    if let Err(unfinished) = b
        .store
        .call(move |s| s.create_batch(&r, &stored, max_jobs))
        .await
        .map_err(store_error)?
    {
        return Err(ApiError::new(
            429,
            "rate_limit_exceeded",
            format!(
                "this tenant has {unfinished} unfinished batches, the most it may have (batch.max_jobs_per_tenant)"
            ),
        )
        .with_code("too_many_batches"));
    }
    b.wake.notify_one();
    tracing::info!(batch = %row.id, lines = row.total, window = %row.completion_window, "batch created");
    Ok((200, row.to_json()))
}

/// A file's lines checked (`jsonl::parse`) on the blocking pool: CPU work on up to
/// `max_file_mib` of text.
async fn checked_lines(
    content: impl AsRef<[u8]> + Send + 'static,
    max_lines: usize,
) -> Result<Vec<jsonl::InputLine>, ApiError> {
    tokio::task::spawn_blocking(move || jsonl::parse(content.as_ref(), max_lines))
        .await
        .map_err(|_| busy())?
}

/// Every line names a model this gateway serves (a 400 naming the first that does not).
fn served(lines: &[jsonl::InputLine], catalog: &crate::models::Catalog) -> Result<(), ApiError> {
    match lines.iter().find(|l| catalog.find(&l.model).is_none()) {
        None => Ok(()),
        Some(l) => Err(ApiError::invalid_request(format!(
            "line {} of the batch file: model {:?} is not served here (served: {})",
            l.line_no,
            l.model,
            catalog.names().join(", ")
        ))
        .with_code("invalid_batch_line")),
    }
}

async fn cancel(b: &Batches, tenant: String, id: String) -> Answer {
    let i = id.clone();
    let row = b
        .store
        .call(move |s| s.cancel(&tenant, &i, now_s()))
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found("Batch", &id))?;
    match row.status {
        Status::Cancelling => {
            b.wake.notify_one();
            Ok((200, row.to_json()))
        }
        Status::Cancelled => Ok((200, row.to_json())),
        s => Err(ApiError::new(
            409,
            "invalid_request_error",
            format!("Cannot cancel a batch with status {}.", s.as_str()),
        )
        .with_code("batch_not_cancellable")),
    }
}
