//! The tokio runtime an operator command (`limiter check`, `status`, `ban`, the lists) runs
//! its few requests on: one thread, with IO and timers. `limiter run` builds its own, a
//! multi-threaded one for the agent's tasks.

use anyhow::{Context, Result};

/// A current-thread runtime with IO and timers, its error saying what failed to start.
pub fn command_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}
