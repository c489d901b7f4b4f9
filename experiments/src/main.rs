//! The `probattn` binary: parses the command line and dispatches to probattn_experiments.
//! Every error, a usage error (unknown flag, bad value) included, exits with status 1.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

use std::sync::Mutex;

use clap::Parser;

/// The message and place of the last panic the hook saw, for `report_panic`.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

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
    // as the named error it is (status 1), not as a panic with a backtrace hint (status 101). Any
    // other panic that escapes is a bug, reported as one line with status 1 (`report_panic`); the
    // hook only keeps its message and place, since panics that the library catches pass it too.
    std::panic::set_hook(Box::new(|info| keep_panic(probattn::panic_message(info.payload()), info.location())));
    let hint = "a smaller batch or sequence needs less, and so does --memory-efficient where the command has it";
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        probattn::catch_out_of_memory("the command's tensors do not fit", Some(hint), || probattn_experiments::run(&cli))
    }));
    let result = match result {
        Ok(result) => result,
        Err(payload) => {
            report_panic(payload.as_ref());
            return std::process::ExitCode::FAILURE;
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The panic hook: keeps the panic's first line and place for [`report_panic`]. With
/// `RUST_BACKTRACE` set, Rust's own report (and backtrace) follows, for whoever asked for it.
fn keep_panic(message: Option<&str>, location: Option<&std::panic::Location>) {
    let message = message.unwrap_or("a panic without a message");
    let place = location.map(|l| format!(" ({}:{})", l.file(), l.line())).unwrap_or_default();
    let line = format!("{}{place}", probattn::libtorch_message(message));
    if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
        eprintln!("panic: {message}{place}\n{}", std::backtrace::Backtrace::force_capture());
    }
    if std::thread::current().name() != Some("main") && !probattn::is_allocation_failure(message) {
        // A worker's panic may never reach main: say it now, as the one line main would print.
        eprintln!("error: internal error in a worker thread: {line}");
    }
    if let Ok(mut last) = LAST_PANIC.lock() {
        *last = Some(line);
    }
}

/// A panic that reached `main`: a bug, not a user's mistake. One line on standard error and a
/// request to report it; no backtrace.
fn report_panic(payload: &(dyn std::any::Any + Send)) {
    let kept = LAST_PANIC.lock().ok().and_then(|mut last| last.take());
    let line = kept
        .unwrap_or_else(|| probattn::libtorch_message(probattn::panic_message(payload).unwrap_or("a panic without a message")).to_string());
    eprintln!(
        "error: internal error: {line}; this is a bug in probattn, not in your input: please report it, with the command \
         that led to it, at https://github.com/probattn/probattn/issues"
    );
}
