//! Region features on disk, one `.npz` file per image and detector (VQA-v2's bottom-up features or
//! any detector's in the same layout): what the data loader and the VQA-v2 reader share.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use tch::{Kind, Tensor};

/// Reads every entry of the zip archive at `path` through, so that a damaged entry (a bad header,
/// a wrong CRC, a cut stream) is an error here. tch's `read_npz` unwraps its entry reads with the
/// same zip crate, and panics on what this returns as an error.
fn check_archive(path: &Path) -> Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))?;
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i)?;
        std::io::copy(&mut entry, &mut std::io::sink())?;
    }
    Ok(())
}

/// The `x (boxes, dim)` array of one `.npz` feature file.
pub(super) fn x_array(path: &Path) -> Result<Tensor> {
    let unreadable = || format!("{} is not a readable .npz file", path.display());
    check_archive(path).with_context(unreadable)?;
    let arrays = Tensor::read_npz(path).with_context(unreadable)?;
    let names: Vec<String> = arrays.iter().map(|(n, _)| n.clone()).collect();
    let x = arrays
        .into_iter()
        .find(|(n, _)| n == "x" || n == "x.npy")
        .map(|(_, t)| t)
        .with_context(|| format!("{} has no array 'x' (it has {names:?})", path.display()))?;
    ensure!(x.dim() == 2, "{}: x has shape {:?}; expected (boxes, dim)", path.display(), x.size());
    Ok(x)
}

/// Where the features of one detector live, and what shape they have.
#[derive(Debug)]
pub struct FeatureFolder {
    pub dir: PathBuf,
    /// `(boxes, dim)` of every image.
    pub shape: (i64, i64),
}

impl FeatureFolder {
    pub(super) fn file(&self, image_id: u64) -> Result<PathBuf> {
        let candidates =
            [format!("{image_id}.npz"), format!("COCO_train2014_{image_id:012}.npz"), format!("COCO_val2014_{image_id:012}.npz")];
        candidates
            .iter()
            .map(|c| self.dir.join(c))
            .find(|p| p.is_file())
            .with_context(|| format!("{}: no features for image {image_id} (looked for {})", self.dir.display(), candidates.join(", ")))
    }

    /// The `x` array of one image, `(boxes, dim)` float32, checked.
    pub fn read(&self, image_id: u64) -> Result<Tensor> {
        let path = self.file(image_id)?;
        let x = x_array(&path)?;
        let size = x.size();
        ensure!((size[0], size[1]) == self.shape, "{}: x has shape {size:?} where this detector's other images have {:?}: variable box counts are not supported (use fixed-K features, e.g. 36 boxes per image)", path.display(), self.shape);
        let x = x.to_kind(Kind::Float);
        probattn::check_finite(&format!("{} x", path.display()), &x)?;
        Ok(x)
    }
}
