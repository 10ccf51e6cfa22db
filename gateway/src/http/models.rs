//! `GET /v1/models` and `GET /v1/models/{id}`: the union of the model cards the healthy
//! replicas serve, asked of all of them at once when a client asks (2 s for the whole answer,
//! head and body, at most 4 MiB; a replica that does not answer in time is left out).

use std::time::Duration;

use bytes::Bytes;
use pingora::proxy::Session;
use protocol::ApiError;

use crate::fleet::registry::Registry;
use crate::http::session::{respond, respond_error};

/// `GET /v1/models`.
pub async fn list(session: &mut Session, fleet: &Registry) -> u16 {
    let ids = cards(fleet).await;
    let body = serde_json::json!({"object": "list", "data": ids});
    respond(session, 200, Bytes::from(body.to_string()), &[]).await
}

/// `GET /v1/models/{id}`: the card of a model some healthy replica serves, or 404 naming
/// `served`, the model this gateway serves.
pub async fn one(session: &mut Session, fleet: &Registry, id: &str, served: &str) -> u16 {
    match cards(fleet).await.into_iter().find(|c| c["id"] == id) {
        Some(card) => respond(session, 200, Bytes::from(card.to_string()), &[]).await,
        None => respond_error(session, &ApiError::model_not_found(id, served)).await,
    }
}

/// The union of the healthy replicas' model cards (asked concurrently, each answer whole within
/// the deadline: a replica that stalls its body cannot hold the client's request).
async fn cards(fleet: &Registry) -> Vec<serde_json::Value> {
    let client = fleet.client();
    let asks = fleet
        .replicas()
        .iter()
        .filter_map(|r| {
            let (true, Some(addr)) = (r.is_healthy(), r.addr()) else {
                return None;
            };
            Some(client.fetch(addr, "/v1/models", Duration::from_secs(2)))
        })
        .collect::<Vec<_>>();
    let mut ids: Vec<serde_json::Value> = Vec::new();
    for body in futures::future::join_all(asks).await.into_iter().flatten() {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
            continue;
        };
        for m in v["data"].as_array().into_iter().flatten() {
            if !ids.iter().any(|x| x["id"] == m["id"]) {
                ids.push(m.clone());
            }
        }
    }
    ids
}
