use std::process::ExitCode;

use clap::Parser;
use limiter::cli::Cli;

fn main() -> ExitCode {
    limiter::cli::init_tracing();
    let cli = Cli::parse();
    match cli.execute() {
        Ok(code) => code,
        Err(error) => {
            tracing::error!("{error:#}");
            ExitCode::FAILURE
        }
    }
}
