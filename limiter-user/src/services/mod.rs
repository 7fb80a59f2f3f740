//! The agent's services, each taking only the handles it uses: the HTTP listener, the
//! Prometheus metrics, the sweeper, and the views they serve.

pub mod http;
pub mod metrics;
pub mod sweeper;
pub mod views;
