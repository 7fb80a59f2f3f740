//! Error types every layer shares: a bad setting, named, and an error with all its causes on
//! one line.

use std::fmt;

use thiserror::Error;

/// A setting that cannot be used; the agent exits with status 2 on it.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid setting `{setting}`: {message}")]
pub struct ConfigError {
    pub setting: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(setting: impl Into<String>, message: impl fmt::Display) -> Self {
        Self {
            setting: setting.into(),
            message: message.to_string(),
        }
    }
}

/// An error and every cause under it on one line, for logs and HTTP problem details, where a
/// bare top-level message ("map FLOWS") would hide what went wrong.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
