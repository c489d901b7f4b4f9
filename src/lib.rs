//! probattn: the probabilistic views of attention on libtorch.
//!
//! The crate in two parts, two folders of its source: `attention` (masks, `attend`, the backend
//! choice, the normalizers and their registry, the memory-efficient tiles, multi-head attention,
//! repulsive heads) and `runtime` (devices, memory, the allocator, distributed training, PyTorch
//! interop, files, the C++ boundary). Every public module has one path, at the crate root
//! ([`mha`], [`device`], ...). docs/architecture.md has the map.
//!
//! One seam serves every variant: scores go in, a [`normalize::Normalizer`] turns them into
//! weights over the allowed entries ([`Masks`], [`normalize::Support`]), and the weights mix the
//! values ([`attend`]). [`MultiHeadAttention`] wraps the seam in PyTorch's parameter layout.
//!
//! Variants so far: softmax (UNAS), DNAS, HNAS and Sinkhorn-N from Ding et al. 2020, "Attention
//! that does not Explain Away"; the Bayesian attention modules (BAM-WC, -WF, -LC, -LF, no-KL) of
//! Fan et al. 2020 around any of them ([`normalize::Bam`]); and repulsive multi-head attention
//! (An et al. 2020), an SVGD/SPOS gradient hook over the heads ([`repulsive::RepulsiveHook`]).

#![deny(unsafe_op_in_unsafe_fn)]
// Every `unsafe` block says why it is sound (a `// SAFETY:` comment), as probattn-sys/src/lib.rs does for each
// call into the C++ layer.
#![warn(clippy::undocumented_unsafe_blocks)]

// The two parts are folders of the source, not paths of the API: each public module has one
// path, at the crate root (`probattn::mha`, `probattn::device`, ...).
mod attention;
mod error;
mod runtime;

pub use attention::{backend, diagnostics, fused_cuda, mask, mc, mha, normalize, param, repulsive, scores, tiled};
pub(crate) use attention::{call, plan};
// The C++ layer, under the name the library has always used for it.
pub(crate) use probattn_sys as cxx;
pub use runtime::{allocator, device, distributed, interop, io, memory, precision};

pub use attention::{attend, attend_with_choice, scaled_dot_product_scores, AttendOptions, Attended, Mode};
pub use backend::Backend;
pub use device::DeviceSpec;
pub use error::{catch_out_of_memory, is_allocation_failure, libtorch_message, panic_message, Error, Result};
pub use mask::{Masks, ScoreShape};
pub use mha::{MhaConfig, MhaInput, MhaOutput, MultiHeadAttention};
pub use normalize::{Normalizer, NormalizerConfig, NormalizerFactory, Variant};

/// Rejects NaN and infinity in `t`, naming it and counting both.
pub fn check_finite(name: &str, t: &tch::Tensor) -> Result<()> {
    if bool::try_from(&t.f_isfinite()?.f_all()?)? {
        return Ok(());
    }
    let count = |m: tch::Tensor| i64::try_from(&m.sum(tch::Kind::Int64));
    let (nan, inf) = (count(t.isnan())?, count(t.isinf())?);
    Err(Error::NonFinite(format!("{name} holds {nan} NaN and {inf} infinite value(s) among {}", t.numel())))
}
