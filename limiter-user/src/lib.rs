//! The limiter agent as a library: the binary in `main.rs` is a thin shell over it, and the
//! privileged tests drive the same code.

pub mod agent;
pub mod buckets;
pub mod cli;
pub mod config;
pub mod http;
pub mod loader;
pub mod maps;
pub mod metrics;
pub mod ops;
pub mod protocol;
pub mod sweeper;
pub mod views;

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
