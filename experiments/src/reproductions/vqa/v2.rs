//! VQA-v2 for users who have it: the official question and annotation files, and region
//! features from several detectors, one `.npz` per image with an `x` array `(boxes, dim)` (the
//! layout bottom-up-attention / MCAN tooling writes), one folder per detector.
//!
//! - Files: `--data DIR` holds the official `v2_OpenEnded_mscoco_{train2014,val2014}_questions.json`
//!   and `v2_mscoco_{train2014,val2014}_annotations.json`. The model trains on train2014 minus a
//!   held-out share of its images (`--val-fraction`, chosen by a fixed hash of the image ids), which selects the
//!   epoch; val2014 is the test split, scored by the official evaluation ([`crate::vqa_eval`]) on
//!   the results file written in the official format.
//! - Features: `--features DIR` once per detector, the primary first; an image's file is
//!   `<image_id>.npz` or `COCO_{train,val}2014_<12-digit id>.npz`. Every image of a detector must
//!   have the same box count (fixed-K features such as bottom-up-attention's 36 boxes; adaptive
//!   10-100 box sets are refused by name). They are held in memory when they fit in
//!   `--feature-memory-gb`, else read from disk batch by batch.
//! - Questions: lowercased, split into words at anything but letters, digits, `'` and `-`, the
//!   first 14 words (Pythia's length); the vocabulary is train2014's words, `<pad>` 0, `<unk>` 1.
//! - Answers: the `--answers` most frequent human answers of train2014 after the official
//!   normalisation (3,129 by default, the usual vocabulary size); a question's soft target for
//!   each answer is that answer's official accuracy against its ten human answers
//!   (`min(#matches / 3, 1)` averaged over the ten leave-one-out subsets), trained with
//!   binary cross-entropy as Pythia does.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Tensor};

use super::data::{Meta, Questions, Views, VqaData};
use super::features::{x_array, FeatureFolder};
use crate::report::progress_bar;
use crate::vqa_eval::{process_digit_article, process_punctuation, question_accuracy, Annotation, AnnotationsFile, QuestionsFile};

/// Pythia's question length.
pub const MAX_WORDS: usize = 14;
pub const PAD: i64 = 0;
pub const UNK: i64 = 1;

/// The official file names in `--data`.
pub fn official_files(dir: &Path, split: &str) -> (PathBuf, PathBuf) {
    (dir.join(format!("v2_OpenEnded_mscoco_{split}_questions.json")), dir.join(format!("v2_mscoco_{split}_annotations.json")))
}

/// One question with its annotation.
struct Item {
    image_id: u64,
    question_id: u64,
    words: Vec<String>,
    answer_type: String,
    humans: Vec<String>,
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {} (VQA-v2 needs the official files in --data)", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("{} is not in the official VQA-v2 format", path.display()))
}

/// The words of a question, as described in the module documentation.
pub fn words(question: &str) -> Vec<String> {
    question
        .to_lowercase()
        .split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '-'))
        .filter(|w| !w.is_empty())
        .take(MAX_WORDS)
        .map(str::to_string)
        .collect()
}

/// The official normalisation of an answer (what the evaluation compares).
pub fn normalize_answer(answer: &str) -> String {
    process_digit_article(&process_punctuation(answer.replace(['\n', '\t'], " ").trim()))
}

fn read_split(dir: &Path, split: &str) -> Result<Vec<Item>> {
    let (qp, ap) = official_files(dir, split);
    let questions: QuestionsFile = read_json(&qp)?;
    let annotations: AnnotationsFile = read_json(&ap)?;
    let mut by_id: HashMap<u64, Annotation> = HashMap::new();
    for a in annotations.annotations {
        ensure!(!a.answers.is_empty(), "{}: question {} has no human answers", ap.display(), a.question_id);
        let id = a.question_id;
        ensure!(by_id.insert(id, a).is_none(), "{}: question {id} is annotated twice", ap.display());
    }
    ensure!(!questions.questions.is_empty(), "{} has no questions", qp.display());
    questions
        .questions
        .into_iter()
        .map(|q| {
            let a = by_id
                .remove(&q.question_id)
                .with_context(|| format!("{}: question {} has no annotation in {}", qp.display(), q.question_id, ap.display()))?;
            let words = words(&q.question);
            ensure!(!words.is_empty(), "{}: question {} has no words", qp.display(), q.question_id);
            let image_id = q.image_id.with_context(|| format!("{}: question {} has no image_id", qp.display(), q.question_id))?;
            Ok(Item {
                image_id,
                question_id: q.question_id,
                words,
                answer_type: a.answer_type,
                humans: a.answers.into_iter().map(|h| h.answer).collect(),
            })
        })
        .collect()
}

/// SplitMix64's output function (Steele, Lea, Flood 2014): a fixed, well-mixed hash of an id.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What `--dataset vqa-v2` reads, besides `--data`.
pub struct V2Options<'a> {
    pub features: &'a [PathBuf],
    pub answers: usize,
    pub val_fraction: f64,
    pub feature_memory_gb: f64,
}

/// How a split's questions become tensors: the training split's vocabularies, the answer types
/// and each image's row in the image table.
struct Encoding<'a> {
    word_ids: &'a HashMap<String, i64>,
    answer_ids: &'a HashMap<&'a str, i64>,
    /// The number of candidate answers.
    answers: usize,
    types: &'a [String],
    row_of: &'a HashMap<u64, i64>,
}

impl Encoding<'_> {
    /// Token ids `(N, MAX_WORDS)`, the best-scoring answer and the soft targets of each question
    /// (`tokens` and `target` are fresh, contiguous by construction, so `view` cannot fail).
    fn questions(&self, items: &[Item]) -> Result<Questions> {
        let n = items.len() as i64;
        let mut tokens = vec![PAD; items.len() * MAX_WORDS];
        let mut target = vec![0f32; items.len() * self.answers];
        let (mut best, mut kind, mut image, mut qid) = (vec![], vec![], vec![], vec![]);
        for (q, item) in items.iter().enumerate() {
            for (j, w) in item.words.iter().enumerate() {
                tokens[q * MAX_WORDS + j] = self.word_ids.get(w).copied().unwrap_or(UNK);
            }
            let mut top = (0.0f64, 0i64);
            let distinct: BTreeSet<String> = item.humans.iter().map(|h| normalize_answer(h)).collect();
            for a in distinct {
                if let Some(&id) = self.answer_ids.get(a.as_str()) {
                    let score = question_accuracy(&a, &item.humans);
                    target[q * self.answers + id as usize] = score as f32;
                    if score > top.0 {
                        top = (score, id);
                    }
                }
            }
            best.push(top.1);
            kind.push(self.types.iter().position(|t| *t == item.answer_type).unwrap_or(0) as i64);
            image.push(self.row_of[&item.image_id]);
            qid.push(item.question_id as i64);
        }
        ensure!(n > 0, "a VQA-v2 split has no questions");
        Ok(Questions {
            image: Tensor::from_slice(&image),
            tokens: Tensor::from_slice(&tokens).view([n, MAX_WORDS as i64]),
            answer: Tensor::from_slice(&best),
            kind: Tensor::from_slice(&kind),
            target: Some(Tensor::from_slice(&target).view([n, self.answers as i64])),
            question_id: Some(Tensor::from_slice(&qid)),
        })
    }
}

/// Reads VQA-v2 from `dir` and the feature folders: the data (splits train / val / test as the
/// module documentation says) and the views.
pub fn load(dir: &Path, opts: &V2Options, device: Device) -> Result<(VqaData, Views)> {
    ensure!(
        opts.features.len() >= 2,
        "--dataset vqa-v2 needs --features at least twice (one folder of .npz files per detector, the primary first), got {}",
        opts.features.len()
    );
    ensure!(opts.answers >= 2, "--answers must be at least 2");
    ensure!(opts.val_fraction > 0.0 && opts.val_fraction < 1.0, "--val-fraction must lie in (0, 1), got {}", opts.val_fraction);
    let train_all = read_split(dir, "train2014")?;
    let test = read_split(dir, "val2014")?;

    // Hold out a share of train2014's images (not questions: an image's questions stay together).
    let train_images: BTreeSet<u64> = train_all.iter().map(|i| i.image_id).collect();
    let mut images: Vec<u64> = train_images.into_iter().collect();
    // A fixed order that depends on nothing but the ids: SplitMix64 of each id.
    images.sort_by_key(|&id| splitmix64(id));
    ensure!(images.len() >= 2, "train2014 has {} image(s); a validation share needs at least two", images.len());
    let held = ((images.len() as f64 * opts.val_fraction).round() as usize).clamp(1, images.len() - 1);
    let val_images: BTreeSet<u64> = images[..held].iter().copied().collect();
    let (val, train): (Vec<Item>, Vec<Item>) = train_all.into_iter().partition(|i| val_images.contains(&i.image_id));

    // Vocabularies from the training split alone.
    let mut vocab = vec!["<pad>".to_string(), "<unk>".to_string()];
    let mut word_ids: HashMap<String, i64> = HashMap::new();
    for w in train.iter().flat_map(|i| &i.words) {
        if !word_ids.contains_key(w) {
            word_ids.insert(w.clone(), vocab.len() as i64);
            vocab.push(w.clone());
        }
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    for h in train.iter().flat_map(|i| &i.humans) {
        *counts.entry(normalize_answer(h)).or_default() += 1;
    }
    let mut ranked: Vec<(String, usize)> = counts.into_iter().filter(|(a, _)| !a.is_empty()).collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let answers: Vec<String> = ranked.into_iter().take(opts.answers).map(|(a, _)| a).collect();
    let answer_ids: HashMap<&str, i64> = answers.iter().enumerate().map(|(i, a)| (a.as_str(), i as i64)).collect();
    let types: Vec<String> =
        train.iter().chain(&val).chain(&test).map(|i| i.answer_type.clone()).collect::<BTreeSet<_>>().into_iter().collect();

    // The image table: every image of every split, once.
    let image_ids: Vec<u64> = train.iter().chain(&val).chain(&test).map(|i| i.image_id).collect::<BTreeSet<_>>().into_iter().collect();
    let row_of: HashMap<u64, i64> = image_ids.iter().enumerate().map(|(r, &id)| (id, r as i64)).collect();

    let encoding = Encoding { word_ids: &word_ids, answer_ids: &answer_ids, answers: answers.len(), types: &types, row_of: &row_of };
    let splits: HashMap<String, Questions> = [("train", &train), ("val", &val), ("test", &test)]
        .into_iter()
        .map(|(s, items)| Ok((s.to_string(), encoding.questions(items)?)))
        .collect::<Result<_>>()?;

    let views = read_features(opts, &image_ids, device)?;

    let mut generator = BTreeMap::new();
    generator.insert("source", serde_json::json!(dir));
    generator.insert("val_fraction", serde_json::json!(opts.val_fraction));
    generator.insert("features", serde_json::json!(opts.features));
    let meta = Meta {
        dataset: "vqa-v2".into(),
        vocab,
        answers,
        types,
        relational_types: vec![],
        sha256: None,
        generator: serde_json::json!(generator),
    };
    if meta.answers.len() < opts.answers {
        eprintln!("VQA-v2: train2014 has {} distinct answers, fewer than --answers {}", meta.answers.len(), opts.answers);
    }
    if meta.answers.is_empty() {
        bail!("train2014 has no non-empty answers");
    }
    Ok((VqaData { dir: dir.to_path_buf(), meta, images: None, image_count: image_ids.len() as i64, splits }, views))
}

/// Every detector's features of `image_ids`, in memory when they fit `--feature-memory-gb`, else
/// read from disk batch by batch. The first image of each folder fixes its shape.
fn read_features(opts: &V2Options, image_ids: &[u64], device: Device) -> Result<Views> {
    let mut folders = vec![];
    for f in opts.features {
        ensure!(f.is_dir(), "--features {}: not a folder", f.display());
        let probe = FeatureFolder { dir: f.clone(), shape: (0, 0) };
        let x = x_array(&probe.file(image_ids[0])?)?;
        folders.push(FeatureFolder { dir: f.clone(), shape: (x.size()[0], x.size()[1]) });
    }
    let dims: Vec<i64> = folders.iter().map(|f| f.shape.1).collect();
    ensure!(dims.iter().all(|&d| d == dims[0]), "the detectors' feature sizes differ ({dims:?}): the fusion adds the secondary views' features, untransformed, to the primary's, so they must agree");
    let bytes: f64 = folders.iter().map(|f| (f.shape.0 * f.shape.1) as f64 * 4.0).sum::<f64>() * image_ids.len() as f64;
    let views = if bytes <= opts.feature_memory_gb * 1e9 {
        let bar = progress_bar((image_ids.len() * folders.len()) as u64, "reading VQA-v2 features".into())?;
        let mut views = vec![];
        for f in &folders {
            let mut xs = Vec::with_capacity(image_ids.len());
            for &id in image_ids {
                xs.push(f.read(id)?);
                bar.inc(1);
            }
            views.push(Tensor::stack(&xs, 0).to_device(device));
        }
        bar.finish_and_clear();
        Views::Memory(views)
    } else {
        eprintln!(
            "features: {:.1} GB exceed --feature-memory-gb {}: reading them from disk batch by batch",
            bytes / 1e9,
            opts.feature_memory_gb
        );
        Views::Files { folders, image_ids: image_ids.to_vec(), device }
    };
    Ok(views)
}
