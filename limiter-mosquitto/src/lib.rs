//! A mosquitto 2.x plugin (plugin API version 5) that puts the limiter agent in front of the
//! broker's own checks.
//!
//! - On every CONNECT (`MOSQ_EVT_BASIC_AUTH`) it spends a token of the agent's `auth` action
//!   for the client's address. A refusal denies the login; an allowance answers what makes
//!   the broker decide as it would without the plugin ([`passes`], from the broker's own
//!   configuration read by [`broker_conf`]): it *defers* (`MOSQ_ERR_PLUGIN_DEFER`) where a
//!   password file or another plugin decides. The plugin never judges passwords.
//! - Logins that the password check then refuses are reported to the agent as auth failures
//!   (see [`plugin`] for how, with mosquitto 2.0's callbacks), so repeated guessing escalates
//!   to a kernel ban of the address.
//! - Every PUBLISH and SUBSCRIBE (`MOSQ_EVT_ACL_CHECK`) spends a token of `publish` or
//!   `subscribe` for the client's username; a refusal is `MOSQ_ERR_ACL_DENIED`, and an
//!   allowance leaves the broker's own ACL (or its absence) to decide, likewise.
//!
//! The broker's callbacks run on its single event loop, so each question waits at most
//! `plugin_opt_timeout` for an answer from a small tokio runtime of the plugin's own
//! ([`agent`]); without one, `plugin_opt_fail` decides.
//!
//! ```text
//! plugin /usr/lib/limiter/libmosquitto_limiter.so
//! plugin_opt_socket /run/limiter/limiter.sock
//! plugin_opt_actions auth,publish,subscribe
//! plugin_opt_fail open
//! plugin_opt_timeout 50
//! ```

pub mod agent_link;
pub mod broker_conf;
mod ffi;
pub mod options;
pub mod passes;
pub mod plugin;
