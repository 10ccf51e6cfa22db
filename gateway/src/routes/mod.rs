//! The policy's routes at run time. [`store`] holds the active policy file turned into routes
//! (each with its built routing policy, pool and promise) and reloads it; [`runtime`] is each
//! route's live state (its [`queue`] of waiting requests, what it has in flight, its
//! [`goodput`] accounting), kept across reloads; [`admitted`] is a dispatched request's share of
//! its route's limits; [`admissible`] is the rule that says whether a replica can take a
//! request and still keep the route's promise; [`fleet_gauges`] turns the routes and their
//! pools into the autoscaling signal and the live cost per million tokens; [`model_scope`] is a
//! served model's share of the replicas, which narrows each route's pool for its requests.

pub mod admissible;
pub mod admitted;
pub mod fleet_gauges;
pub mod goodput;
pub mod model_scope;
pub mod queue;
pub mod runtime;
pub mod store;
