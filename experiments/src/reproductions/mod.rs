//! The reproductions of the papers' experiments: GAT node classification, Transformer and LSTM
//! translation (with `seq2seq`, their data and decoding), multi-view VQA fusion.

pub mod gat;
pub mod seq2seq;
pub mod translate;
pub mod vqa;
