// Shared body of every crate-root `build.rs` (each one `include!`s this file).
//
// Rust links with `--as-needed` by default. Nothing in our code calls into `libtorch_cuda.so`
// directly (its kernels register themselves when the library loads), so the linker drops it and
// CUDA is silently unavailable at run time. Linking `libtorch.so` (which depends on
// `libtorch_cuda.so` in CUDA builds) with `--no-as-needed` keeps it; the rpath lets the binaries
// and tests find libtorch without LD_LIBRARY_PATH. This is what tch-rs's own build.rs does.
// `DEP_TCH_LIBTORCH_LIB` is exported by torch-sys (`links = "tch"`), a direct dependency of
// every crate that includes this file.

fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os != "linux" && os != "windows" {
        return;
    }
    if let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.to_string_lossy());
    }
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
}
