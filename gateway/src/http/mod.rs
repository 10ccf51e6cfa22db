//! The pingora face of the gateway: accepting connections within a budget ([`accept`]), what
//! a client connection may cost before a request is read ([`conn`], with its
//! [`write_buffer`]), the API port's endpoint table ([`proxy`]), who may call it ([`auth`]),
//! how a body is read ([`body`]), the model list ([`models`]), and how the request path
//! answers the client ([`session`]).

pub mod accept;
pub mod auth;
pub mod body;
pub mod conn;
pub mod models;
pub mod proxy;
pub mod session;
pub mod write_buffer;
