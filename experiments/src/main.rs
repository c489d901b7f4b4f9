//! The `probattn` binary: parses the command line and dispatches to probattn_experiments.
//! Every error, a usage error (unknown flag, bad value) included, exits with status 1.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

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
    // tch's operators panic when libtorch cannot allocate a tensor: such a panic is reported below
    // as the named error it is (status 1), not as a panic with a backtrace hint (status 101).
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !probattn::panic_message(info.payload()).is_some_and(probattn::is_allocation_failure) {
            default_hook(info);
        }
    }));
    let hint = "a smaller batch or sequence needs less, and so does --memory-efficient where the command has it";
    let result = probattn::catch_out_of_memory("the command's tensors do not fit", Some(hint), || probattn_experiments::run(&cli));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
