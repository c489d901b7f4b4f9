//! The reproductions of the papers' experiments: GAT node classification, Transformer and LSTM
//! translation, multi-view VQA fusion. What they share with the tools (translation's data and
//! decoding, the metrics) sits below both: `crate::seq2seq`, `crate::metrics`.

pub mod gat;
pub mod translate;
pub mod vqa;
