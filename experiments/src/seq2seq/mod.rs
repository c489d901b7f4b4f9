//! The sequence-to-sequence toolkit that `translate` trains with and `compare` checks a PyTorch
//! translation model with: parallel corpora, joint BPE, token batches (`data`), and beam and
//! greedy decoding with the model's incremental cache (`decode`).

pub mod data;
pub mod decode;
