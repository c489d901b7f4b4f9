// Links libtorch (CUDA included) and sets its rpath (link_libtorch.rs at the workspace root), and
// compiles the C++ layer in csrc/ against the same libtorch that tch links.
include!("../link_libtorch.rs");

use std::path::PathBuf;

fn main() {
    link_libtorch();
    build_cxx_layer();
}

fn build_cxx_layer() {
    let files = [
        "csrc/common.cpp",
        "csrc/autocast.cpp",
        "csrc/pt2.cpp",
        "csrc/memory.cpp",
        "csrc/memory_cuda.cpp",
        "csrc/tiled.cpp",
        "csrc/fused_cuda.cpp",
        "csrc/fused_launch.cpp",
        "csrc/fused_cpu.cpp",
        "csrc/noise.cpp",
        "csrc/distributed.cpp",
        "csrc/boundary.h",
        "csrc/guard.h",
        "csrc/tiled.h",
        "csrc/fused_launch.h",
        "csrc/probattn.h",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=PROBATTN_GLOO_INCLUDE");
    println!("cargo:rerun-if-env-changed=PROBATTN_CUDA_INCLUDE");
    // torch-sys (`links = "tch"`) says where the libtorch it linked lives; its headers are beside.
    let lib = PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys did not export DEP_TCH_LIBTORCH_LIB"));
    let torch_dir = lib.parent().expect("libtorch's lib folder has a parent").to_path_buf();
    let include = torch_dir.join("include");
    assert!(
        include.join("torch/csrc/inductor/aoti_package/model_package_loader.h").is_file(),
        "{}: libtorch's C++ headers are not there (run ./download_libtorch.sh, or point LIBTORCH at a full libtorch)",
        include.display()
    );
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());

    let mut build = cc::Build::new();
    build.cpp(true).std("c++17").define("_GLIBCXX_USE_CXX11_ABI", abi.as_str()).opt_level(2).warnings(true);
    // -isystem: libtorch's headers' own warnings are not ours.
    for dir in [include.clone(), include.join("torch/csrc/api/include")] {
        build.flag("-isystem").flag(dir.to_str().expect("a UTF-8 include path"));
    }
    // CUDA's statistics go through c10's device-generic allocator interface: no CUDA header needed.
    distributed_flags(&mut build, &torch_dir);
    build.files(files.iter().filter(|f| f.ends_with(".cpp")));
    build.compile("probattn_cxx");

    println!("cargo:rustc-link-search=native={}", lib.display());
    for name in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={name}");
    }
    // dlopen, for the CUDA driver library (csrc/fused_launch.cpp opens it at run time).
    println!("cargo:rustc-link-lib=dylib=dl");

    // The CPU memory counter also as a shared library, for the Python side of `probattn bench`.
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let shared = out.join("libprobattn_memory.so");
    let mut command = build.get_compiler().to_command();
    command
        .args(["-shared", "-fPIC", "-o"])
        .arg(&shared)
        .arg("csrc/memory.cpp")
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lc10");
    let status = command.status().expect("running the C++ compiler");
    assert!(status.success(), "compiling csrc/memory.cpp as a shared library failed");
    println!("cargo:rustc-env=PROBATTN_MEMORY_LIB={}", shared.display());
}

/// c10d's Gloo process group needs gloo's headers, which the PyTorch wheel leaves out (the code is
/// inside libtorch_cpu): PROBATTN_GLOO_INCLUDE, else the system's (Debian's libgloo-dev, which
/// ./download_libtorch.sh installs). NCCL's process group needs nccl.h (the wheel's nvidia-nccl)
/// and CUDA's headers: the wheel's nvidia/cu13/include once ./download_libtorch.sh has added the
/// crt/ and nv/ folders it lacks (nvidia-cuda-crt, nvidia-cuda-cccl), or PROBATTN_CUDA_INCLUDE.
/// Without either the build still succeeds and joining such a process group says what is missing.
fn distributed_flags(build: &mut cc::Build, torch_dir: &std::path::Path) {
    let gloo = std::env::var_os("PROBATTN_GLOO_INCLUDE")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from("/usr/include"), PathBuf::from("/usr/local/include")])
        .find(|dir| dir.join("gloo/algorithm.h").is_file());
    match gloo {
        Some(dir) => {
            build.define("USE_C10D_GLOO", None).define("PROBATTN_GLOO", None);
            // The compiler's own search path already has the system folders (and naming one with
            // -isystem would break libstdc++'s #include_next).
            if !dir.starts_with("/usr/include") && !dir.starts_with("/usr/local/include") {
                build.flag("-isystem").flag(dir.to_str().expect("a UTF-8 include path"));
            }
        }
        None => println!(
            "cargo:warning=gloo's headers were not found (install Debian's libgloo-dev, or set PROBATTN_GLOO_INCLUDE): \
             distributed training is left out of this build"
        ),
    }
    let site = torch_dir.parent().map(std::path::Path::to_path_buf);
    let nccl = site.as_ref().map(|p| p.join("nvidia/nccl/include")).filter(|dir| dir.join("nccl.h").is_file());
    // The wheel's CUDA headers, completed by ./download_libtorch.sh with the crt/ and nv/ folders.
    let cuda = std::env::var_os("PROBATTN_CUDA_INCLUDE")
        .map(PathBuf::from)
        .or_else(|| site.as_ref().map(|p| p.join("nvidia/cu13/include")))
        .filter(|dir| dir.join("crt/host_config.h").is_file() && dir.join("nv/target").is_file());
    if let Some(dir) = site.as_ref().map(|p| p.join("nvidia/cu13/include")).filter(|d| d.is_dir()) {
        // Rebuilt when the set-up completes the folder.
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    if let (Some(nccl), Some(cuda)) = (nccl, cuda) {
        build.define("USE_C10D_NCCL", None).define("PROBATTN_NCCL", None);
        for dir in [nccl, cuda] {
            build.flag("-isystem").flag(dir.to_str().expect("a UTF-8 include path"));
        }
    }
}
