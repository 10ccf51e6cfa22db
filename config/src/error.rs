//! Validation errors name the field, the offending value and the reason, so an operator can fix
//! a file without reading code.

use std::fmt;

/// One problem with one field.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    /// Dotted path, e.g. `policy.fallback.load_factor`.
    pub field: String,
    pub value: String,
    pub reason: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {}: {}", self.field, self.value, self.reason)
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("cannot parse the file: {0}")]
    Parse(String),
    #[error("{} invalid field(s): {}", .0.len(), .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
}

/// Collects every problem of a file instead of stopping at the first.
#[derive(Debug, Default)]
pub struct Validator {
    errors: Vec<FieldError>,
}

impl Validator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a problem when `ok` is false.
    pub fn check(&mut self, ok: bool, field: &str, value: impl fmt::Display, reason: &str) {
        if !ok {
            self.errors.push(FieldError {
                field: field.to_string(),
                value: value.to_string(),
                reason: reason.to_string(),
            });
        }
    }

    pub fn finish(self) -> Result<(), ConfigError> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(self.errors))
        }
    }
}
