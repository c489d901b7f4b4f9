//! The runtime part of the library: devices and threads, memory statistics, the C allocator's
//! setting, distributed training, PyTorch interop, files, and the boundary with the C++ layer
//! (`cxx`, the only module that calls into `csrc/`). Each public module is also at the crate
//! root (`probattn::device`, `probattn::interop`, ...).

pub mod allocator;
pub(crate) mod cxx;
pub mod device;
pub mod distributed;
pub mod interop;
pub mod io;
pub mod memory;
