//! How the process's C allocator treats large freed blocks, which on CPU decides much of what
//! attention costs.
//!
//! libtorch allocates CPU tensors with `posix_memalign`. glibc serves every block above its mmap
//! threshold (at most 32 MiB) with a fresh `mmap` and returns it with `munmap` when freed, so each
//! full-size attention tensor (64 MiB at B = H = 8, S = 512 in float32) arrives as new pages that
//! fault in on first touch. A forward and backward pass allocates several such tensors; on a
//! 2-core virtual machine the page faults took about four times the kernels' own time (an `exp`
//! into a fresh tensor 28.7 ms, into an existing one 10.7 ms). [`retain_freed_memory`] makes glibc
//! keep freed memory and serve large blocks from it, as PyTorch's CUDA caching allocator does on
//! the GPU: the process then holds on to its peak memory instead of returning it. It governs
//! glibc's main arena, which serves the main thread (where tch code usually runs); other threads'
//! arenas still map blocks over 64 MiB directly.
//!
//! The `probattn` binary calls it at start-up (`--allocator retain`, the default) and gives child
//! processes (the PyTorch side of `probattn bench`) the same setting through glibc's
//! `MALLOC_MMAP_MAX_` and `MALLOC_TRIM_THRESHOLD_` variables, so comparisons stay like for like.

use std::sync::atomic::{AtomicBool, Ordering};

static RETAINED: AtomicBool = AtomicBool::new(false);

/// `M_TRIM_THRESHOLD = -1` disables trimming the heap's top (mallopt(3)); child processes get the
/// same through glibc's variable, which takes a size.
const TRIM_THRESHOLD: i32 = -1;
const CHILD_TRIM_THRESHOLD: &str = "4611686018427387904"; // 2^62 bytes: never reached

/// Makes glibc serve large blocks from its heap and keep freed memory for reuse (`mallopt`:
/// `M_MMAP_MAX = 0`, `M_TRIM_THRESHOLD = -1`, no trimming). Returns whether it took effect: false on
/// platforms without glibc, where nothing changes. Call it before allocating large tensors;
/// blocks already mapped stay as they are.
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; both are documented glibc options
        // and it reports failure by returning 0.
        let ok = unsafe { libc::mallopt(libc::M_MMAP_MAX, 0) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 };
        RETAINED.store(ok, Ordering::SeqCst);
        ok
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Whether [`retain_freed_memory`] took effect in this process.
pub fn freed_memory_retained() -> bool {
    RETAINED.load(Ordering::SeqCst)
}

/// The environment that gives a child process the same allocator behaviour as this one (empty
/// unless [`retain_freed_memory`] took effect).
pub fn child_env() -> Vec<(&'static str, String)> {
    if freed_memory_retained() {
        vec![("MALLOC_MMAP_MAX_", "0".into()), ("MALLOC_TRIM_THRESHOLD_", CHILD_TRIM_THRESHOLD.into())]
    } else {
        vec![]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_inherit_the_setting_only_once_it_took_effect() {
        let took = retain_freed_memory();
        assert_eq!(took, cfg!(all(target_os = "linux", target_env = "gnu")));
        assert_eq!(child_env().len(), if took { 2 } else { 0 });
        // Large allocations still work and are usable afterwards.
        let t = tch::Tensor::ones([64, 1024, 1024], (tch::Kind::Float, tch::Device::Cpu));
        assert_eq!(t.sum(tch::Kind::Double).double_value(&[]), (64 * 1024 * 1024) as f64);
    }
}
