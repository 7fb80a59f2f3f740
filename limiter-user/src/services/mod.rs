//! The agent's services, each taking only the handles it uses: the HTTP listener, the
//! Prometheus metrics, the sweeper, `syn-cookies = auto`, the views they serve, the event log's
//! sink, the fleet's shared bans, the state file, the list files' watcher, and the service manager's word on
//! the agent's state.

pub mod event_sink;
pub mod fleet_bans;
pub mod http;
pub mod list_watch;
pub mod metrics;
pub mod saved_state;
mod sweep_rules;
pub mod sweeper;
pub mod syn_cookies;
pub mod systemd_notify;
pub mod view_builder;
