//! The runtime part of the library: devices and threads, memory statistics, the C allocator's
//! setting, distributed training, PyTorch interop and files; the C++ layer they call is the
//! `probattn-sys` crate. A folder of the source: each public module's path is at the crate root
//! (`probattn::device`, `probattn::interop`, ...).

pub mod allocator;
pub mod device;
pub mod distributed;
pub mod interop;
pub mod io;
pub mod memory;
pub mod precision;
