//! How the gateway talks to its replicas: one pooled keep-alive HTTP client (connect timeout,
//! no Nagle), the fleet token every request to a replica carries, and the limits on what a
//! replica may make the gateway wait for or hold ([`UpstreamLimits`]).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<HttpConnector, http_body_util::Full<Bytes>>;

/// Builds the client used for replicas: pooled keep-alive, connect timeout, no Nagle.
pub fn http_client(connect_timeout: Duration) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(connect_timeout));
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(conn)
}

/// The gateway file's limits on talking to a replica.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamLimits {
    /// Further attempts after the first fails before anything reached the client.
    pub retries: u32,
    /// Wait before retry `n`: `n` times this.
    pub retry_backoff: Duration,
    /// How long a replica may take to send the first event or the answer's head.
    pub first_byte_timeout: Duration,
    /// Longest pause inside a body once its head arrived.
    pub body_idle_timeout: Duration,
    /// Largest unstreamed answer held.
    pub max_response_bytes: usize,
    /// Largest stream relayed.
    pub max_stream_bytes: u64,
    /// Token events allowed past `max_tokens` × choices.
    pub stream_token_slack: u64,
}

/// Why a GET to a replica brought nothing back (said to the operator as it is).
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("cannot resolve {0}")]
    Unresolved(String),
    #[error("{0}")]
    Transport(String),
    #[error("{path} answered {status}")]
    Status {
        path: String,
        status: http::StatusCode,
    },
    #[error("{path} did not answer within {timeout:?}")]
    Timeout { path: String, timeout: Duration },
    #[error("{path} answered more than {limit} bytes")]
    TooLarge { path: String, limit: usize },
}

/// Largest answer a probe (`/health`, `/server_info`, `/v1/models`, `/get_load`, `/metrics`)
/// may send: a replica that sends more is broken, and must not grow the gateway's memory.
pub const MAX_PROBE_BYTES: usize = 4 << 20;

/// The pooled client with the fleet's credentials.
#[derive(Clone)]
pub struct FleetClient {
    client: HttpClient,
    /// `Authorization` sent with every request to a replica (the fleet token).
    auth: Option<http::HeaderValue>,
}

impl FleetClient {
    pub fn new(client: HttpClient, fleet_token: Option<&str>) -> Self {
        let auth = fleet_token.and_then(|t| {
            let mut v = http::HeaderValue::from_str(&format!("Bearer {t}")).ok()?;
            v.set_sensitive(true);
            Some(v)
        });
        FleetClient { client, auth }
    }

    /// A request to a replica, carrying the fleet token.
    pub fn request(
        &self,
        method: http::Method,
        url: String,
        body: Bytes,
    ) -> http::Request<Full<Bytes>> {
        let mut b = http::Request::builder().method(method).uri(url);
        if let Some(a) = &self.auth {
            b = b.header(http::header::AUTHORIZATION, a.clone());
        }
        if !body.is_empty() {
            b = b.header(http::header::CONTENT_TYPE, "application/json");
        }
        b.body(Full::new(body))
            .unwrap_or_else(|_| http::Request::new(Full::new(Bytes::new())))
    }

    /// Sends `req` on the pooled client.
    pub fn send(&self, req: http::Request<Full<Bytes>>) -> ResponseFuture {
        self.client.request(req)
    }

    /// GET `path` at `addr`, the whole body within `timeout`; the error says why, for the
    /// operator.
    pub async fn fetch(
        &self,
        addr: SocketAddr,
        path: &str,
        timeout: Duration,
    ) -> Result<Bytes, FetchError> {
        self.exchange(http::Method::GET, addr, path, Bytes::new(), timeout)
            .await
    }

    /// POST the JSON `body` to `path` at `addr`; the answer as [`FleetClient::fetch`] gives it.
    pub async fn post(
        &self,
        addr: SocketAddr,
        path: &str,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, FetchError> {
        self.exchange(http::Method::POST, addr, path, body, timeout)
            .await
    }

    async fn exchange(
        &self,
        method: http::Method,
        addr: SocketAddr,
        path: &str,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, FetchError> {
        let req = self.request(method, format!("http://{addr}{path}"), body);
        let fut = async {
            let resp = self
                .send(req)
                .await
                .map_err(|e| FetchError::Transport(e.to_string()))?;
            if !resp.status().is_success() {
                return Err(FetchError::Status {
                    path: path.to_string(),
                    status: resp.status(),
                });
            }
            http_body_util::Limited::new(resp.into_body(), MAX_PROBE_BYTES)
                .collect()
                .await
                .map(|c| c.to_bytes())
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        FetchError::TooLarge {
                            path: path.to_string(),
                            limit: MAX_PROBE_BYTES,
                        }
                    } else {
                        FetchError::Transport(e.to_string())
                    }
                })
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| FetchError::Timeout {
                path: path.to_string(),
                timeout,
            })?
    }
}
