//! probattn-models: the architectures of the papers, built on the probattn attention seam.
//!
//! Planned, one file per model: GAT node classification (Velickovic et al. 2018, with BAM and
//! DNAS attention), the multi-view VQA fusion of Ding et al. 2020 (appendix B), and the
//! Transformer for translation (with repulsive multi-head attention). Nothing is here yet; the
//! crate exists so the workspace layout is fixed before the models land.

pub use probattn;
