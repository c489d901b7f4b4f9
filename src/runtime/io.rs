//! Files: safetensors reading with errors that name the file, and atomic writes (a temporary file
//! beside the target, then a rename), so a crash never leaves a half-written result behind.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use tch::{Device, Tensor};

use crate::{Error, Result};

/// Reads every tensor of a safetensors file, by name.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    if !path.exists() {
        return Err(not_found(path, "no such file"));
    }
    let named = Tensor::read_safetensors(path)
        .map_err(|e| Error::File { path: path.into(), message: format!("not a readable safetensors file ({e})") })?;
    Ok(named.into_iter().collect())
}

/// Writes named tensors as safetensors, atomically. Tensors are copied to contiguous CPU memory.
pub fn write_safetensors_atomic(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let cpu: Vec<(&str, Tensor)> = tensors.iter().map(|(name, t)| (*name, t.detach().to_device(Device::Cpu).contiguous())).collect();
    write_atomic(path, |tmp| Ok(Tensor::write_safetensors(&cpu, tmp)?))
}

/// Writes `contents` to `path` atomically.
pub fn write_bytes_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    write_atomic(path, |tmp| fs::write(tmp, contents).map_err(|error| Error::Io { path: tmp.into(), error }))
}

/// Runs `write` on a temporary path in `path`'s directory, then renames it over `path`; the
/// temporary file is removed when anything fails.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(not_found(&dir, "no such directory"));
    }
    let name = path.file_name().ok_or_else(|| Error::File { path: path.into(), message: "not a file name".into() })?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = write(&tmp).and_then(|()| fs::rename(&tmp, path).map_err(|error| Error::Io { path: path.into(), error }));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn not_found(path: &Path, what: &str) -> Error {
    Error::Io { path: path.into(), error: std::io::Error::new(std::io::ErrorKind::NotFound, what) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_clean_failure() {
        let dir = std::env::temp_dir().join(format!("probattn-io-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0]).view([3, 1]);
        write_safetensors_atomic(&path, &[("t", &t)]).unwrap();
        let back = read_safetensors(&path).unwrap();
        assert_eq!(Vec::<f64>::try_from(back["t"].view([-1])).unwrap(), vec![1.0, 2.0, 3.0]);

        let failed = write_atomic(&dir.join("u"), |_| Err(Error::Config("boom".into())));
        assert!(failed.is_err());
        let left: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("t.safetensors")], "temporary file left behind");

        fs::write(dir.join("bad.safetensors"), b"not safetensors").unwrap();
        let err = read_safetensors(&dir.join("bad.safetensors")).unwrap_err().to_string();
        assert!(err.contains("bad.safetensors") && err.contains("not a readable safetensors"), "{err}");
        let err = read_safetensors(&dir.join("missing.safetensors")).unwrap_err().to_string();
        assert!(err.contains("missing.safetensors: no such file"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
