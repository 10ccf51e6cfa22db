//! Operator-facing configuration: turns the gateway and policy files under `config/` into
//! validated structs and reports `field / value / reason` when they are wrong. Pure data plus
//! validation, no async runtime; the caller reads the file and hands over its text.
#![forbid(unsafe_code)]

pub mod api_keys;
pub mod batch;
pub mod cost;
pub mod drift;
pub mod error;
pub mod fleet;
pub mod gateway;
pub mod models;
pub mod peers;
pub mod policy;
pub mod routes;

pub use api_keys::{ApiKeys, Grant};
pub use error::{ConfigError, FieldError};
pub use gateway::GatewayConfig;
pub use models::ModelConfig;
pub use policy::PolicyConfig;
pub use routes::{HitSignals, PolicyFile, Priority, RouteConfig, SloConfig};
