//! The `probattn` binary: parses the command line and dispatches to probattn_experiments.
//! Every error, a usage error (unknown flag, bad value) included, exits with status 1.

use clap::Parser;

fn main() -> std::process::ExitCode {
    // Rust ignores SIGPIPE, so printing into a closed pipe (`probattn ... | head`) would panic;
    // the default action ends the process quietly, as every Unix tool does.
    // SAFETY: restoring a signal's default disposition at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match probattn_experiments::Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version come this way too, to standard output with status 0.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            let _ = e.print();
            return std::process::ExitCode::FAILURE;
        }
    };
    match probattn_experiments::run(&cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
