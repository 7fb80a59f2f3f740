//! The agent's services, each taking only the handles it uses: the HTTP listener, the
//! Prometheus metrics, the sweeper, `syn-cookies = auto`, the views they serve, and the
//! fleet's shared bans.

pub mod fleet_bans;
pub mod http;
pub mod metrics;
mod sweep_rules;
pub mod sweeper;
pub mod syn_cookies;
pub mod views;
