//! Operator-facing configuration: turns the gateway and policy files under `config/` into
//! validated structs and reports `field / value / reason` when they are wrong. Pure data plus
//! validation, no I/O beyond reading the file the caller names and no async runtime.
//!
//! The gateway's configuration arrives with the gateway issue; the replica's flags live with the
//! replica because only the replica reads them.
#![forbid(unsafe_code)]
