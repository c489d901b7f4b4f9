//! probattn-models: the architectures of the papers, built on the probattn attention seam.
//!
//! - [`transformer`]: the encoder–decoder stack of the translation experiments (fairseq's
//!   `transformer_iwslt_de_en` sizes), with any normalizer and the repulsive hook.
//!
//! Planned, one file per model: GAT node classification (Velickovic et al. 2018, with BAM and
//! DNAS attention) and the multi-view VQA fusion of Ding et al. 2020 (appendix B).

pub mod gat;
pub mod transformer;
pub mod translation;

pub use probattn;
