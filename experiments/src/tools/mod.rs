//! The tools: commands that are not reproductions of a paper's experiment (checking a variant
//! against your own code, timing, comparing with PyTorch modules, exports, the registry, curves of
//! several runs on one chart). The metric commands (`bleu`, `vqa-eval`) live with their metrics in
//! `crate::metrics`.

pub mod attend;
pub mod bench;
pub mod compare;
pub mod curves;
pub mod doctor;
pub mod export;
pub mod finetune;
pub mod variants;
