//! A translate run's checkpoints: what they hold besides the tensors (the training state, one
//! atomic file), writing and reading them with errors that name the file, and the average of the
//! last epochs' weights.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use probattn_models::translation::{baseline_name, Seq2Seq};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

use super::optim::Adam;
use super::{EpochMetrics, TranslateConfig};
use crate::harness::Plateau;

/// What the checkpoint carries besides tensors (stored in it as a JSON byte tensor, so the file
/// is one atomic unit).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct TrainState {
    pub(super) config: TranslateConfig,
    pub(super) seed: u64,
    /// Epochs completed.
    pub(super) epoch: usize,
    pub(super) updates: u64,
    /// The best validation BLEU, its epoch, and the epochs waited since (written as `best`,
    /// `best_epoch`, `waited`; checkpoints before the shared epoch loop wrote `best_bleu`).
    #[serde(flatten)]
    pub(super) plateau: Plateau,
    pub(super) train_seconds: f64,
    pub(super) train_tokens: u64,
    pub(super) history: Vec<EpochMetrics>,
}

/// Writes the training checkpoint: parameters, Adam's moments, and the state as JSON bytes.
pub(super) fn save_checkpoint(path: &Path, vs: &nn::VarStore, adam: &Adam, state: &TrainState) -> Result<()> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.extend(adam.state_tensors());
    let json = serde_json::to_vec(state)?;
    named.push(("train_state.json".into(), Tensor::from_slice(&json)));
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    probattn::io::write_safetensors_atomic(path, &refs).with_context(|| format!("writing checkpoint {}", path.display()))
}

/// Reads a checkpoint's tensors and its training state, with errors that name the file.
pub(super) fn read_checkpoint(path: &Path) -> Result<(HashMap<String, Tensor>, TrainState)> {
    let tensors = probattn::io::read_safetensors(path).with_context(|| format!("reading checkpoint {}", path.display()))?;
    let state = tensors
        .get("train_state.json")
        .with_context(|| format!("{} is not a probattn translate checkpoint (no train_state.json)", path.display()))?;
    let bytes: Vec<u8> = Vec::try_from(state).with_context(|| format!("{}: train_state.json", path.display()))?;
    let state: TrainState =
        serde_json::from_slice(&bytes).with_context(|| format!("{}: its train_state.json does not parse", path.display()))?;
    Ok((tensors, state))
}

/// Copies the model parameters of a checkpoint into `vs`, checking names and shapes.
pub(super) fn load_params(vs: &nn::VarStore, tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    for (name, mut t) in vs.variables() {
        let saved =
            tensors.get(&name).with_context(|| format!("{} lacks parameter {name}: a checkpoint of another model", path.display()))?;
        ensure!(saved.size() == t.size(), "{}: {name} has shape {:?}, the model {:?}", path.display(), saved.size(), t.size());
        tch::no_grad(|| t.copy_(saved));
    }
    Ok(())
}

/// The state of a run that has not started.
pub(super) fn fresh_state(cfg: &TranslateConfig, seed: u64) -> TrainState {
    TrainState {
        config: cfg.clone(),
        seed,
        epoch: 0,
        updates: 0,
        plateau: Plateau::default(),
        train_seconds: 0.0,
        train_tokens: 0,
        history: vec![],
    }
}

/// Replaces the parameters by the mean of the last `n` epochs' saved weights.
pub(super) fn average_last(vs: &mut nn::VarStore, dir: &Path, last_epoch: usize, n: usize) -> Result<()> {
    let first = last_epoch.saturating_sub(n) + 1;
    let files: Vec<PathBuf> = (first..=last_epoch).map(|e| dir.join(format!("weights_epoch{e}.safetensors"))).collect();
    let mut sums: HashMap<String, Tensor> = HashMap::new();
    for f in &files {
        for (name, t) in probattn::io::read_safetensors(f)? {
            let t = t.to_kind(Kind::Double);
            let entry = sums.entry(name).or_insert_with(|| t.zeros_like());
            *entry = &*entry + t;
        }
    }
    for (name, mut t) in vs.variables() {
        let s = sums.get(&name).with_context(|| format!("the averaged checkpoints lack {name}"))?;
        tch::no_grad(|| t.copy_(&(s / files.len() as f64).to_kind(t.kind())));
    }
    eprintln!("test with the average of epochs {first}..={last_epoch}");
    Ok(())
}

/// `probattn export`: the model weights of a translate checkpoint as a safetensors state dict under
/// the PyTorch baseline's names ([`baseline_name`]), which python/probattn_tools/baselines/translate.py loads with
/// `load_state_dict(strict=True)`. Returns the number of tensors written.
pub fn export_checkpoint(ckpt: &Path, out: &Path) -> Result<usize> {
    let (tensors, state) = read_checkpoint(ckpt)?;
    let lstm = state.config.model.lstm.is_some();
    ensure!(
        lstm || state.config.model.share_all_embeddings,
        "{}: the PyTorch baseline shares one embedding matrix; this model does not",
        ckpt.display()
    );
    let vs = nn::VarStore::new(Device::Cpu);
    Seq2Seq::new(&vs.root(), state.config.model.clone())?;
    load_params(&vs, &tensors, ckpt)?;
    // The LSTM baseline maps our names itself (a PyTorch module cannot be called `forward`).
    probattn::interop::export_params(&vs, out, |n| if lstm { n.to_string() } else { baseline_name(n).unwrap_or_else(|| n.to_string()) })?;
    Ok(vs.variables().len())
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use probattn::Variant;

    use super::*;
    use crate::translate::{Repulsive, TranslateArgs};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TranslateArgs,
    }

    /// Checkpoints written before the shared epoch loop named the best score `best_bleu`; a
    /// fresh state's −∞ goes through JSON as null and comes back.
    #[test]
    fn a_training_state_reads_back_and_older_checkpoints_still_parse() {
        let args = Cli::parse_from(["translate"]).args;
        let cfg = TranslateConfig::from_args(&args, 8000, Variant::Softmax, Repulsive::None).unwrap();
        let mut state = fresh_state(&cfg, 3);
        let back: TrainState = serde_json::from_value(serde_json::to_value(&state).unwrap()).unwrap();
        assert_eq!(back.plateau, Plateau::default());
        state.plateau = Plateau { best: 9.762104020478679, best_epoch: 9, waited: 1 };
        let mut old = serde_json::to_value(&state).unwrap();
        let fields = old.as_object_mut().unwrap();
        let best = fields.remove("best").unwrap();
        fields.insert("best_bleu".into(), best);
        let back: TrainState = serde_json::from_value(old).unwrap();
        assert_eq!((back.plateau, back.seed, back.config == cfg), (state.plateau, 3, true));
    }
}
