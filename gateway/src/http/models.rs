//! `GET /v1/models` and `GET /v1/models/{id}`: the union of the model cards the healthy
//! replicas serve, asked of each replica when a client asks (2 s each at most; a replica that
//! does not answer in time is left out of the list).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
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

/// The union of the healthy replicas' model cards.
async fn cards(fleet: &Registry) -> Vec<serde_json::Value> {
    let mut ids: Vec<serde_json::Value> = Vec::new();
    let client = fleet.client();
    for r in fleet.replicas().iter() {
        let (true, Some(addr)) = (r.is_healthy(), r.addr()) else {
            continue;
        };
        let req = client.request(
            http::Method::GET,
            format!("http://{addr}/v1/models"),
            Bytes::new(),
        );
        let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), client.send(req)).await
        else {
            continue;
        };
        let Ok(body) = resp.into_body().collect().await else {
            continue;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body.to_bytes()) else {
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
