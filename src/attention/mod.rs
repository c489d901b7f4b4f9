//! The attention part of the library: the masks, one attention call (`seam`: `attend`), the normalizers
//! and their registry, the memory-efficient tiles and their plans, multi-head attention, the
//! repulsive heads, scores, diagnostics and Monte Carlo prediction. A folder of the source: each
//! public module's path is at the crate root (`probattn::mha`, `probattn::tiled`, ...).

pub mod backend;
pub(crate) mod call;
pub mod diagnostics;
pub mod fused_cuda;
pub mod mask;
pub mod mc;
pub mod mha;
pub mod normalize;
pub mod param;
pub(crate) mod plan;
pub mod repulsive;
pub mod scores;
pub(crate) mod seam;
pub mod tiled;

// `probattn::{attend, AttendOptions, ...}` through the crate root.
pub use seam::{attend, attend_with_choice, scaled_dot_product_scores, AttendOptions, Attended, Mode};
