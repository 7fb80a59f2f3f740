//! Harness for the privileged tests and the benchmarks: network namespaces joined by veth
//! pairs, code run inside a namespace, frames built with etherparse, and the benchmarks'
//! reports.
//!
//! Every namespace and link gets a name unique to this process and test, and is removed on drop,
//! so a failing test leaves nothing behind.

pub mod agent;
pub mod fleet;
pub mod frames;
pub mod kernel;
pub mod model;
pub mod mosquitto;
pub mod netns;
pub mod packet;
pub mod redis;
pub mod report;
pub mod transfer;
