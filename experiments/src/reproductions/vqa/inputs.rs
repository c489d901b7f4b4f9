//! What a `probattn vqa` run reads before it trains: the data and detectors (generated or trained
//! when absent), every detector's features, and the noise the uncertainty reports ask for.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind};

use super::args::detector_dir;
use super::data::{self, cached_features, detectors_in, DetectorSpec, Views, VqaData};
use super::v2;
use super::{Dataset, VqaArgs};
use crate::provenance::run_python;

/// Makes sure the data and detectors exist (generating them with the project's Python when
/// absent) and returns the detectors, primary first.
pub(super) fn prepare_inputs(args: &VqaArgs, data_dir: &Path, threads: i32) -> Result<Vec<DetectorSpec>> {
    if !data_dir.join("meta.json").exists() {
        let out = data_dir.to_string_lossy().to_string();
        eprintln!("{}: no data yet; writing it with python/probattn_tools/data/vqa.py", data_dir.display());
        let mut py: Vec<&str> = vec![args.dataset.name(), "--out", &out];
        if args.quick && args.dataset == Dataset::SortOfClevr {
            py.extend(["--train", "1000", "--val", "200", "--test", "200"]);
        }
        run_python("data.vqa", &py).context("generating the VQA data")?;
    }
    if !args.detector.is_empty() {
        ensure!(args.detector.len() >= 2, "--detector must be given at least twice (a primary and a secondary view), got once");
        return Ok(args.detector.iter().enumerate().map(|(i, p)| DetectorSpec { name: format!("view{i}"), path: p.clone() }).collect());
    }
    let (epochs, dir) = detector_dir(args, data_dir);
    if !dir.join("detectors.json").exists() {
        if args.detectors.is_some() {
            bail!(
                "{} has no detectors.json (write detectors with `python -m probattn_tools.data.vqa_detectors --data {} --out {}`)",
                dir.display(),
                data_dir.display(),
                dir.display()
            );
        }
        eprintln!("{}: no detectors yet; training them with python/probattn_tools/data/vqa_detectors.py (minutes)", dir.display());
        let (d, o, t) = (data_dir.to_string_lossy().to_string(), dir.to_string_lossy().to_string(), threads.to_string());
        let (e, b) = (epochs.to_string(), args.detector_boxes.to_string());
        run_python("data.vqa_detectors", &["--data", &d, "--out", &o, "--epochs", &e, "--boxes", &b, "--threads", &t])
            .context("training the detectors")?;
    }
    detectors_in(&dir, data_dir)
}

/// The questions and the views of every detector: VQA-v2's precomputed features, or the generated
/// data with the features of probattn's detectors (extracted once, then cached); and a note of
/// where the features came from, for results.json.
pub(super) fn load_data(
    args: &VqaArgs,
    data_dir: &Path,
    device: Device,
    start: Instant,
) -> Result<(VqaData, Views, Vec<DetectorSpec>, String)> {
    Ok(if args.dataset == Dataset::VqaV2 {
        ensure!(
            args.data.is_some(),
            "--dataset vqa-v2 needs --data DIR holding the official question and annotation files (train2014, val2014)"
        );
        ensure!(!args.quick, "--quick runs on the generated datasets (sort-of-clevr, easy-vqa), not vqa-v2");
        ensure!(
            args.detector.is_empty(),
            "--detector runs TorchScript detectors on images; VQA-v2 takes precomputed features (--features)"
        );
        let opts = v2::V2Options {
            features: &args.features,
            answers: args.answers,
            val_fraction: args.val_fraction,
            feature_memory_gb: args.feature_memory_gb,
        };
        let (data, views) = v2::load(data_dir, &opts, device)?;
        let detectors: Vec<DetectorSpec> =
            args.features.iter().enumerate().map(|(i, f)| DetectorSpec { name: format!("view{i}"), path: f.clone() }).collect();
        let note =
            format!("precomputed .npz features: {}", args.features.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "));
        (data, views, detectors, note)
    } else {
        ensure!(args.features.is_empty(), "--features goes with --dataset vqa-v2");
        let detectors = prepare_inputs(args, data_dir, tch::get_num_threads())?;
        let data = VqaData::load(data_dir)?;
        ensure!(
            data.meta.dataset == args.dataset.name(),
            "{} holds {} data, not {} (--dataset)",
            data_dir.display(),
            data.meta.dataset,
            args.dataset.name()
        );
        let (features, cache, hit) = cached_features(&data, &detectors, device)?;
        eprintln!("features: {} ({}, {:.1} s)", cache.display(), if hit { "cached" } else { "extracted" }, start.elapsed().as_secs_f64());
        let note =
            format!("{} ({})", cache.display(), detectors.iter().map(|d| d.path.display().to_string()).collect::<Vec<_>>().join(", "));
        (data, Views::Memory(features.views), detectors, note)
    })
}

/// `--image-noise`: every view again from noised images (for the clean-vs-noisy uncertainty
/// report); `--noisy-view` with `--noise-std`: Gaussian noise on one view's features, in place.
/// Views in memory move to the device here.
pub(super) fn add_noise(
    args: &VqaArgs,
    data: &VqaData,
    views: &mut Views,
    detectors: &[DetectorSpec],
    device: Device,
) -> Result<Option<(f64, Views)>> {
    let noisy_image = match args.image_noise {
        None => None,
        Some(std) => {
            ensure!(std > 0.0 && std.is_finite(), "--image-noise must be a positive number, got {std}");
            let images = data.images.as_ref().context("--image-noise needs images to run the detectors on (not --dataset vqa-v2)")?;
            tch::manual_seed(1_000_033);
            let noised = (images.to_kind(Kind::Float) / 255.0 + images.to_kind(Kind::Float).randn_like() * std).clamp(0.0, 1.0);
            let noised = (noised * 255.0).round().to_kind(Kind::Uint8);
            let features = data::extract(&noised, detectors, device, 256)?;
            Some((std, Views::Memory(features.views.into_iter().map(|v| v.to_device(device)).collect())))
        }
    };
    if let (Some(k), Some(std)) = (args.noisy_view, args.noise_std) {
        let Views::Memory(v) = views else {
            bail!("--noisy-view needs the features in memory (raise --feature-memory-gb)");
        };
        ensure!(k < v.len(), "--noisy-view {k}: there are only {} views (0 = primary)", v.len());
        tch::manual_seed(1_000_003);
        v[k] = &v[k] + v[k].randn_like() * std;
    }
    if let Views::Memory(v) = views {
        for t in v.iter_mut() {
            *t = t.to_device(device);
        }
    }
    Ok(noisy_image)
}
