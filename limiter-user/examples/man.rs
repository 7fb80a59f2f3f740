//! Writes the `limiter(1)` man page, generated from the command line's own definition so it
//! always matches `--help`: `cargo run -p limiter-user --example man -- OUT`.
//! `cargo xtask package` runs it; the .deb ships the result.

use clap::CommandFactory;
use limiter::cli::Cli;

fn main() -> std::io::Result<()> {
    let out = std::env::args_os()
        .nth(1)
        .ok_or_else(|| std::io::Error::other("usage: man OUT"))?;
    let mut page = Vec::new();
    clap_mangen::Man::new(Cli::command()).render(&mut page)?;
    std::fs::write(out, page)
}
