//! The Planetoid graphs: the canonical `ind.<name>.*` files, verified and converted by
//! python/planetoid.py (Python pickles; read there with a restricted unpickler) into tensors.

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

/// The default data folder: ../shared/data/planetoid when it exists, else data/planetoid.
pub fn default_data_dir() -> PathBuf {
    let shared = Path::new("../shared/data/planetoid");
    if shared.is_dir() {
        shared.into()
    } else {
        "data/planetoid".into()
    }
}

/// Reads, verifies and converts the dataset's `ind.*` files (python/planetoid.py), then loads
/// the tensors onto `device`.
pub fn load_graph(dataset: Dataset, data_dir: &Path, device: Device) -> Result<Graph> {
    let name = dataset.name();
    // A copy known to be incomplete lives in <name>_incomplete/; the converter then names the
    // missing file.
    let incomplete = data_dir.join(format!("{name}_incomplete"));
    let folder = if !data_dir.join(format!("ind.{name}.x")).exists() && incomplete.is_dir() { incomplete } else { data_dir.to_path_buf() };
    ensure!(
        folder.is_dir(),
        "data folder {} does not exist (run `python python/planetoid.py download --dir {}`, or pass --data-dir)",
        folder.display(),
        folder.display()
    );
    let converted = std::env::temp_dir().join(format!("probattn-{name}-{}.safetensors", std::process::id()));
    let (dir, out) = (folder.to_string_lossy().to_string(), converted.to_string_lossy().to_string());
    run_python("planetoid.py", &["convert", "--dir", &dir, "--name", name, "--out", &out]).with_context(|| format!("loading {name}"))?;
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
