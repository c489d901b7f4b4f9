//! The metrics, below both the reproductions and the tools: corpus BLEU as sacreBLEU computes it
//! (translation's scores, `probattn bleu`) and the official VQA accuracy (the VQA v2 loader's
//! scores, `probattn vqa-eval`), each with the command that exposes it.

pub mod bleu;
pub mod vqa_eval;
