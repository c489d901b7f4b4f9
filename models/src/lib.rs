//! probattn-models: the architectures of the papers, built on the probattn attention seam.
//!
//! - [`transformer`]: the encoder–decoder stack of the translation experiments (fairseq's
//!   `transformer_iwslt_de_en` sizes), with any normalizer and the repulsive hook.
//! - [`translation`]: the translation model around it (shared embeddings, positions), or
//!   around [`lstm`], the attentional LSTM of Deng et al. 2018 (the BAM paper's Table 4).
//! - [`gat`]: GAT node classification (Velickovic et al. 2018) with any normalizer.
//! - [`vqa`]: the multi-view VQA fusion of Ding et al. 2020 (Appendix B) and a Pythia-lite head.

// `x = x + y` stays: on tch tensors `x += y` is an in-place `add_`, which would overwrite a value
// autograd saved for the backward pass.
#![allow(clippy::assign_op_pattern)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod gat;
pub mod lstm;
pub mod transformer;
pub mod translation;
pub mod vqa;

pub use probattn;
