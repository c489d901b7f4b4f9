// Links libtorch (CUDA included) and sets its rpath: see link_libtorch.rs at the workspace root.
include!("../../link_libtorch.rs");

fn main() {
    link_libtorch();
}
