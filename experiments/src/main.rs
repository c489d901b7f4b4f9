//! The `probattn` binary: parses the command line and dispatches to probattn_experiments.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = probattn_experiments::Cli::parse();
    match probattn_experiments::run(&cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
