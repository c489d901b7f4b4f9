// Links libtorch (CUDA included) and sets its rpath: see link_libtorch.rs at the workspace root.
// The C++ layer is probattn-sys's.
include!("./link_libtorch.rs");

fn main() {
    link_libtorch();
}
