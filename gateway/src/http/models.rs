//! `GET /v1/models` and `GET /v1/models/{id}`: the served models as the gateway file names
//! them (each alias a card of its own whose `root` is the model), each card as a healthy
//! replica serving it describes it (`max_model_len` and the like) when one answers — asked of
//! all of them at once when a client asks (2 s for the whole answer, head and body, at most
//! 4 MiB; a replica that does not answer in time is left out).

use std::time::Duration;

use bytes::Bytes;
use pingora::proxy::Session;
use protocol::ApiError;
use serde_json::{json, Value};

use crate::fleet::registry::Registry;
use crate::http::session::{respond, respond_error};
use crate::models::Catalog;

/// `GET /v1/models`.
pub async fn list(session: &mut Session, fleet: &Registry, models: &Catalog) -> u16 {
    let body = json!({"object": "list", "data": served(fleet, models).await});
    respond(session, 200, Bytes::from(body.to_string()), &[]).await
}

/// `GET /v1/models/{id}`: the card of a served model or alias, or 404 naming them.
pub async fn one(session: &mut Session, fleet: &Registry, models: &Catalog, id: &str) -> u16 {
    match served(fleet, models)
        .await
        .into_iter()
        .find(|c| c["id"] == id)
    {
        Some(card) => respond(session, 200, Bytes::from(card.to_string()), &[]).await,
        None => {
            respond_error(
                session,
                &ApiError::model_not_found_among(id, &models.names()),
            )
            .await
        }
    }
}

/// The served models' cards: the replicas' own where one describes the model, the gateway's
/// otherwise; an alias is the model's card under its own id with `root` naming the model.
async fn served(fleet: &Registry, models: &Catalog) -> Vec<Value> {
    let known = cards(fleet).await;
    let mut out = Vec::new();
    for m in models.all() {
        let card = known
            .iter()
            .find(|c| c["id"] == m.cfg.name.as_str())
            .cloned()
            .unwrap_or_else(|| {
                json!({"id": m.cfg.name, "object": "model", "created": models.created, "owned_by": "kvgate"})
            });
        for alias in &m.cfg.aliases {
            let mut a = card.clone();
            a["id"] = json!(alias);
            a["root"] = json!(m.cfg.name);
            out.push(a);
        }
        out.insert(out.len() - m.cfg.aliases.len(), card);
    }
    out
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
