//! The limiter agent as a library: the binary in `main.rs` is a thin shell over it, and the
//! privileged tests drive the same code.

pub mod cli;
pub mod loader;
pub mod maps;
