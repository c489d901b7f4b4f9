//! The Planetoid graphs: the canonical `ind.<name>.*` files, verified and converted by
//! python/probattn_tools/data/planetoid.py (Python pickles; read there with a restricted unpickler) into tensors.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use probattn::normalize::{EdgeList, Support};
use probattn_models::gat::Features;
use tch::{Device, Tensor};

use super::Dataset;
use crate::provenance::run_python;

/// A loaded graph on a device.
#[derive(Debug)]
pub struct Graph {
    /// Row-normalized features, stored sparse.
    pub features: Features,
    pub labels: Tensor,
    pub train: Tensor,
    pub val: Tensor,
    pub test: Tensor,
    pub support: Support,
    pub classes: i64,
}

impl Graph {
    pub fn nodes(&self) -> i64 {
        self.features.nodes()
    }
}

/// The default data folder: `planetoid/` under the data folder (`$PROBATTN_DATA`, else `data/`).
pub fn default_data_dir() -> PathBuf {
    crate::common::data_root().join("planetoid")
}

/// Reads, verifies (unless `verify` is false: a graph of the user's own) and converts the
/// dataset's `ind.*` files (python/probattn_tools/data/planetoid.py), then loads the tensors onto `device`.
pub fn load_graph(dataset: Dataset, data_dir: &Path, verify: bool, device: Device) -> Result<Graph> {
    let name = dataset.name();
    // A copy known to be incomplete lives in <name>_incomplete/; the converter then names the
    // missing file.
    let incomplete = data_dir.join(format!("{name}_incomplete"));
    let folder = if !data_dir.join(format!("ind.{name}.x")).exists() && incomplete.is_dir() { incomplete } else { data_dir.to_path_buf() };
    ensure!(
        folder.is_dir(),
        "data folder {} does not exist (run `python -m probattn_tools.data.planetoid download --dir {}`, or pass --data-dir)",
        folder.display(),
        folder.display()
    );
    let converted = std::env::temp_dir().join(format!("probattn-{name}-{}.safetensors", std::process::id()));
    let (dir, out) = (folder.to_string_lossy().to_string(), converted.to_string_lossy().to_string());
    let mut command = vec!["convert", "--dir", &dir, "--name", name, "--out", &out];
    if !verify {
        command.push("--unverified");
    }
    run_python("data.planetoid", &command).with_context(|| format!("loading {name}"))?;
    let tensors = probattn::io::read_safetensors(&converted);
    let _ = std::fs::remove_file(&converted);
    let tensors = tensors?;
    let get = |k: &str| tensors.get(k).map(|t| t.to_device(device)).with_context(|| format!("converted {name} lacks {k}"));
    let (features, labels) = (get("features")?, get("labels")?);
    let n = features.size()[0];
    let support = Support::Edges(EdgeList::new(get("edge_dst")?, get("edge_src")?, n, n)?);
    let classes = i64::try_from(labels.max())? + 1;
    let features = Features::sparse_from_dense(&features);
    Ok(Graph { features, labels, train: get("train_idx")?, val: get("val_idx")?, test: get("test_idx")?, support, classes })
}
