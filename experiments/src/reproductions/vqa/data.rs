//! The data of `probattn vqa`: the tensors python/probattn_tools/data/vqa.py writes, the detectors
//! (TorchScript) and the region features they give, cached once per data and detector set.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use probattn::interop::TorchScript;

use super::features::FeatureFolder;
use serde::{Deserialize, Serialize};
use tch::{Device, IValue, Kind, Tensor};

/// `meta.json` beside `data.safetensors`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    pub dataset: String,
    pub vocab: Vec<String>,
    pub answers: Vec<String>,
    pub types: Vec<String>,
    #[serde(default)]
    pub relational_types: Vec<String>,
    #[serde(default)]
    pub sha256: Option<String>,
    #[serde(default)]
    pub generator: serde_json::Value,
}

/// One split's questions (on the CPU).
#[derive(Debug)]
pub struct Questions {
    /// `(Q,)` rows of the image tensor.
    pub image: Tensor,
    /// `(Q, L)` word ids, 0 = padding.
    pub tokens: Tensor,
    /// `(Q,)` answer ids.
    pub answer: Tensor,
    /// `(Q,)` question type ids (`Meta::types`; VQA-v2: answer types).
    pub kind: Tensor,
    /// VQA-v2: `(Q, answers)` float soft scores, each answer's official accuracy against the
    /// human answers (`answer` is then the best-scored one, or 0 when none is in the vocabulary).
    pub target: Option<Tensor>,
    /// VQA-v2: `(Q,)` the official question ids, for results files.
    pub question_id: Option<Tensor>,
}

impl Questions {
    pub fn len(&self) -> i64 {
        self.answer.size()[0]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub const SPLITS: [&str; 3] = ["train", "val", "test"];

/// A VQA data folder: images, questions per split, and its description.
#[derive(Debug)]
pub struct VqaData {
    pub dir: PathBuf,
    pub meta: Meta,
    /// `(N, 3, H, W)` uint8; None where the features come precomputed (VQA-v2).
    pub images: Option<Tensor>,
    /// The rows of the image table that `Questions::image` indexes.
    pub image_count: i64,
    pub splits: HashMap<String, Questions>,
}

impl VqaData {
    /// Reads `dir/meta.json` and `dir/data.safetensors`, checking every tensor and id range.
    pub fn load(dir: &Path) -> Result<Self> {
        let meta_path = dir.join("meta.json");
        let text = std::fs::read_to_string(&meta_path).with_context(|| format!("reading {}", meta_path.display()))?;
        let meta: Meta = serde_json::from_str(&text).with_context(|| format!("{} is not a VQA data description", meta_path.display()))?;
        let data_path = dir.join("data.safetensors");
        let mut tensors = probattn::io::read_safetensors(&data_path)?;
        let mut take = |name: &str| tensors.remove(name).with_context(|| format!("{} has no tensor '{name}'", data_path.display()));
        let images = take("images")?;
        ensure!(
            images.dim() == 4 && images.size()[1] == 3 && images.kind() == Kind::Uint8,
            "{}: images must be (N, 3, H, W) uint8, got {:?} {:?}",
            data_path.display(),
            images.size(),
            images.kind()
        );
        let n_images = images.size()[0];
        let mut splits = HashMap::new();
        for split in SPLITS {
            let q = Questions {
                image: take(&format!("{split}_image"))?,
                tokens: take(&format!("{split}_tokens"))?,
                answer: take(&format!("{split}_answer"))?,
                kind: take(&format!("{split}_type"))?,
                target: None,
                question_id: None,
            };
            let n = q.len();
            ensure!(n > 0, "{}: split {split} has no questions", data_path.display());
            for (name, t, max) in [
                ("image", &q.image, n_images),
                ("answer", &q.answer, meta.answers.len() as i64),
                ("type", &q.kind, meta.types.len() as i64),
            ] {
                ensure!(
                    t.size() == [n] && t.kind() == Kind::Int64,
                    "{}: {split}_{name} must be ({n},) int64, got {:?} {:?}",
                    data_path.display(),
                    t.size(),
                    t.kind()
                );
                let (lo, hi) = (i64::try_from(t.min())?, i64::try_from(t.max())?);
                ensure!(lo >= 0 && hi < max, "{}: {split}_{name} holds ids {lo}..={hi}, outside 0..{max}", data_path.display());
            }
            ensure!(
                q.tokens.dim() == 2 && q.tokens.size()[0] == n && q.tokens.kind() == Kind::Int64,
                "{}: {split}_tokens must be ({n}, L) int64, got {:?}",
                data_path.display(),
                q.tokens.size()
            );
            let (lo, hi) = (i64::try_from(q.tokens.min())?, i64::try_from(q.tokens.max())?);
            ensure!(
                lo >= 0 && hi < meta.vocab.len() as i64,
                "{}: {split}_tokens holds word ids {lo}..={hi}, outside the vocabulary of {}",
                data_path.display(),
                meta.vocab.len()
            );
            ensure!(
                bool::try_from(q.tokens.select(1, 0).ne(0).all())?,
                "{}: {split}_tokens has an empty question (no first word)",
                data_path.display()
            );
            splits.insert(split.to_string(), q);
        }
        Ok(Self { dir: dir.to_path_buf(), meta, images: Some(images), image_count: n_images, splits })
    }

    /// The relational flag of every question type.
    pub fn relational(&self) -> Vec<bool> {
        self.meta.types.iter().map(|t| self.meta.relational_types.contains(t)).collect()
    }
}

/// A detector given by the user or listed in `detectors.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DetectorSpec {
    pub name: String,
    pub path: PathBuf,
}

/// The three detectors of a folder written by python/probattn_tools/data/vqa_detectors.py, primary first (the
/// `patch` backbone, which learns colour, shape and position; see that script). They must have
/// been trained for the data in `data_dir`: the same data file (its sha256) and the view that
/// its meta.json asks for (`detector_context`); detectors left from an earlier conversion of the
/// data are refused by name rather than silently reused.
pub fn detectors_in(dir: &Path, data_dir: &Path) -> Result<Vec<DetectorSpec>> {
    let read = |path: &Path| -> Result<serde_json::Value> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
    };
    let manifest = dir.join("detectors.json");
    let json = read(&manifest)?;
    // An unreadable meta.json is reported by the data loader, with its own named error.
    let meta = read(&data_dir.join("meta.json")).unwrap_or_default();
    let stale = |what: &str| {
        format!(
            "{} were trained for other data than {} ({what} differs); delete {} to retrain them",
            dir.display(),
            data_dir.display(),
            dir.display()
        )
    };
    if let (Some(trained), Some(data)) = (json["data_sha256"].as_str(), meta["sha256"].as_str()) {
        ensure!(trained == data, stale("the data file's sha256"));
    }
    let wants_context = meta["detector_context"].as_str() == Some("global");
    ensure!(json["global_context"].as_bool().unwrap_or(false) == wants_context, stale("detector_context"));
    let list = json["detectors"].as_array().with_context(|| format!("{} has no 'detectors' list", manifest.display()))?;
    let mut specs: Vec<DetectorSpec> = list
        .iter()
        .map(|d| {
            let name = d["name"].as_str().context("a detector without a name")?;
            let file = d["file"].as_str().context("a detector without a file")?;
            Ok(DetectorSpec { name: name.into(), path: dir.join(file) })
        })
        .collect::<Result<_>>()
        .with_context(|| format!("reading {}", manifest.display()))?;
    if let Some(i) = specs.iter().position(|s| s.name == "patch") {
        let primary = specs.remove(i);
        specs.insert(0, primary);
    }
    Ok(specs)
}

/// Region features of every image, per view: `(N, regions, dim)` float32 on the CPU.
pub struct Features {
    pub views: Vec<Tensor>,
}

/// Runs each detector over every image (`(B, 3, H, W)` float in [0, 1] in, `(B, regions, dim)`
/// out), `batch` images at a time, under `no_grad`; checks what each returns.
pub fn extract(images: &Tensor, detectors: &[DetectorSpec], device: Device, batch: i64) -> Result<Features> {
    let n = images.size()[0];
    let mut views = vec![];
    for spec in detectors {
        let module = TorchScript::load(&spec.path, device).with_context(|| format!("detector {}", spec.name))?;
        let mut parts = vec![];
        let mut shape: Option<(i64, i64)> = None;
        for start in (0..n).step_by(batch as usize) {
            let len = batch.min(n - start);
            let x = images.narrow(0, start, len).to_device(device).to_kind(Kind::Float) / 255.0;
            let out = tch::no_grad(|| module.forward_tensors(&[IValue::Tensor(x)]))
                .with_context(|| format!("detector {} ({})", spec.name, spec.path.display()))?;
            let [(_, y)] = <[_; 1]>::try_from(out).map_err(|o: Vec<_>| {
                anyhow::anyhow!(
                    "detector {} ({}) returned {} tensors; expected one (B, regions, dim)",
                    spec.name,
                    spec.path.display(),
                    o.len()
                )
            })?;
            let s = y.size();
            if s.len() != 3 || s[0] != len {
                bail!(
                    "detector {} ({}) returned shape {s:?} for {len} images; expected ({len}, regions, dim)",
                    spec.name,
                    spec.path.display()
                );
            }
            match shape {
                Some(prev) if prev != (s[1], s[2]) => {
                    bail!("detector {} returned {:?} then {:?} regions x dim", spec.name, prev, (s[1], s[2]))
                }
                _ => shape = Some((s[1], s[2])),
            }
            probattn::check_finite(&format!("detector {} output", spec.name), &y)?;
            parts.push(y.to_kind(Kind::Float).to_device(Device::Cpu));
        }
        views.push(Tensor::cat(&parts, 0));
    }
    let dims: Vec<i64> = views.iter().map(|v| v.size()[2]).collect();
    ensure!(dims.iter().all(|&d| d == dims[0]), "the detectors' feature sizes differ ({dims:?}): the fusion adds the secondary views' features, untransformed, to the primary's, so they must agree");
    Ok(Features { views })
}

/// What identifies a feature cache: the data file and each detector file (path, size, mtime).
fn cache_key(data: &VqaData, detectors: &[DetectorSpec]) -> Result<String> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    data.meta.sha256.hash(&mut h);
    for d in detectors {
        let m = std::fs::metadata(&d.path).with_context(|| format!("detector {}: {}", d.name, d.path.display()))?;
        std::fs::canonicalize(&d.path)?.hash(&mut h);
        m.len().hash(&mut h);
        m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_nanos()).hash(&mut h);
    }
    Ok(format!("{:016x}", h.finish()))
}

/// The features of `data` under `detectors`, from `data/features/<key>.safetensors` when it
/// exists, else extracted and written there (atomically).
pub fn cached_features(data: &VqaData, detectors: &[DetectorSpec], device: Device) -> Result<(Features, PathBuf, bool)> {
    let path = data.dir.join("features").join(format!("{}.safetensors", cache_key(data, detectors)?));
    if path.exists() {
        let mut t = probattn::io::read_safetensors(&path)?;
        let views = (0..detectors.len())
            .map(|i| t.remove(&format!("view{i}")).with_context(|| format!("{} lacks view{i}; delete it to extract again", path.display())))
            .collect::<Result<Vec<_>>>()?;
        return Ok((Features { views }, path, true));
    }
    let images = data.images.as_ref().context("this data has no images to run detectors on")?;
    let features = extract(images, detectors, device, 256)?;
    std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
    let names: Vec<String> = (0..features.views.len()).map(|i| format!("view{i}")).collect();
    let pairs: Vec<(&str, &Tensor)> = names.iter().map(String::as_str).zip(features.views.iter()).collect();
    probattn::io::write_safetensors_atomic(&path, &pairs)?;
    Ok((features, path, false))
}

/// The region features of the image table, per view.
#[derive(Debug)]
pub enum Views {
    /// `(N_images, boxes, dim)` per view on the device.
    Memory(Vec<Tensor>),
    /// Read from disk batch by batch: the folders and the image id of every row.
    Files { folders: Vec<FeatureFolder>, image_ids: Vec<u64>, device: Device },
}

impl Views {
    /// `(boxes, dim)` of each view.
    pub fn shapes(&self) -> Vec<(i64, i64)> {
        match self {
            Self::Memory(v) => v.iter().map(|t| (t.size()[1], t.size()[2])).collect(),
            Self::Files { folders, .. } => folders.iter().map(|f| f.shape).collect(),
        }
    }

    /// The features of image-table rows `rows`, per view, on the device.
    pub fn gather(&self, rows: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Self::Memory(v) => Ok(v.iter().map(|t| t.index_select(0, &rows.to_device(t.device()))).collect()),
            Self::Files { folders, image_ids, device } => {
                let rows = Vec::<i64>::try_from(rows.to_device(Device::Cpu))?;
                folders
                    .iter()
                    .map(|f| {
                        let xs = rows.iter().map(|&r| f.read(image_ids[r as usize])).collect::<Result<Vec<_>>>()?;
                        Ok(Tensor::stack(&xs, 0).to_device(*device))
                    })
                    .collect()
            }
        }
    }
}
