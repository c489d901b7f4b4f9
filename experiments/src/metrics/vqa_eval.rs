//! `probattn vqa-eval`: the official VQA accuracy of a results file, computed as the official
//! evaluation code (GT-Vision-Lab/VQA, `vqaEval.py`) computes it, quirks included:
//!
//! - the predicted answer: newlines and tabs become spaces, then trimmed, then punctuation
//!   processing and digit/article processing (below);
//! - the human answers get punctuation processing only, and only when the ten of them are not all
//!   the same string;
//! - accuracy of a question: for each human answer, `min(1, #matches among the other answers / 3)`,
//!   averaged (the leave-one-out average over the 10 choose 9 subsets);
//! - overall, per answer type and per question type: `100 ·` the mean, rounded to 2 decimals.
//!
//! Punctuation: each of `; / [ ] " { } ( ) = + \ _ - > < @ ` , ? !` is deleted when the text has
//! it next to a space or has a comma between digits, else replaced by a space; then at most 32
//! periods not followed by a digit are deleted (the official `periodStrip.sub("", text,
//! re.UNICODE)` passes `re.UNICODE`, 32, as the count). Digits and articles: lowercase, split on
//! whitespace, number words `none`, `zero` .. `ten` to digits, `a`, `an`, `the` dropped,
//! contractions restored (`dont` → `don't`), joined by single spaces.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};

/// Flags of `probattn vqa-eval`.
#[derive(Args, Debug)]
pub struct VqaEvalArgs {
    /// The official questions file (`{"questions": [{"question_id", "image_id", "question"}]}`).
    #[arg(long)]
    pub questions: PathBuf,
    /// The official annotations file (`{"annotations": [{"question_id", "question_type",
    /// "answer_type", "answers": [{"answer"}, ...]}]}`).
    #[arg(long)]
    pub annotations: PathBuf,
    /// The results, official format: `[{"question_id", "answer"}]`, one per question.
    #[arg(long)]
    pub results: PathBuf,
    /// Print `{"overall", "perAnswerType", "perQuestionType"}` as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The official question and annotation files, as far as the evaluation and `probattn vqa
/// --dataset vqa-v2` read them.
#[derive(Deserialize)]
pub(crate) struct QuestionsFile {
    pub questions: Vec<Question>,
}

#[derive(Deserialize)]
pub(crate) struct Question {
    pub question_id: u64,
    /// Not read by the evaluation (files without it score the same).
    #[serde(default)]
    pub image_id: Option<u64>,
    #[serde(default)]
    pub question: String,
}

#[derive(Deserialize)]
pub(crate) struct AnnotationsFile {
    pub annotations: Vec<Annotation>,
}

#[derive(Deserialize)]
pub(crate) struct Annotation {
    pub question_id: u64,
    pub question_type: String,
    pub answer_type: String,
    pub answers: Vec<HumanAnswer>,
}

#[derive(Deserialize)]
pub(crate) struct HumanAnswer {
    pub answer: String,
}

#[derive(Deserialize)]
struct Prediction {
    question_id: u64,
    answer: String,
}

/// The official evaluation's numbers (0-100, rounded to 2 decimals).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Accuracy {
    pub overall: f64,
    #[serde(rename = "perAnswerType")]
    pub per_answer_type: BTreeMap<String, f64>,
    #[serde(rename = "perQuestionType")]
    pub per_question_type: BTreeMap<String, f64>,
}

const PUNCT: [char; 21] = [';', '/', '[', ']', '"', '{', '}', '(', ')', '=', '+', '\\', '_', '-', '>', '<', '@', '`', ',', '?', '!'];
const NUMBERS: [(&str, &str); 12] = [
    ("none", "0"),
    ("zero", "0"),
    ("one", "1"),
    ("two", "2"),
    ("three", "3"),
    ("four", "4"),
    ("five", "5"),
    ("six", "6"),
    ("seven", "7"),
    ("eight", "8"),
    ("nine", "9"),
    ("ten", "10"),
];
const ARTICLES: [&str; 3] = ["a", "an", "the"];
/// The official contraction map (keys with capitals, such as `Im`, never match: the text is
/// lowercased first, as in the official code).
const CONTRACTIONS: &[(&str, &str)] = &[
    ("aint", "ain't"),
    ("arent", "aren't"),
    ("cant", "can't"),
    ("couldve", "could've"),
    ("couldnt", "couldn't"),
    ("couldn'tve", "couldn't've"),
    ("couldnt've", "couldn't've"),
    ("didnt", "didn't"),
    ("doesnt", "doesn't"),
    ("dont", "don't"),
    ("hadnt", "hadn't"),
    ("hadnt've", "hadn't've"),
    ("hadn'tve", "hadn't've"),
    ("hasnt", "hasn't"),
    ("havent", "haven't"),
    ("hed", "he'd"),
    ("hed've", "he'd've"),
    ("he'dve", "he'd've"),
    ("hes", "he's"),
    ("howd", "how'd"),
    ("howll", "how'll"),
    ("hows", "how's"),
    ("Id've", "I'd've"),
    ("I'dve", "I'd've"),
    ("Im", "I'm"),
    ("Ive", "I've"),
    ("isnt", "isn't"),
    ("itd", "it'd"),
    ("itd've", "it'd've"),
    ("it'dve", "it'd've"),
    ("itll", "it'll"),
    ("let's", "let's"),
    ("maam", "ma'am"),
    ("mightnt", "mightn't"),
    ("mightnt've", "mightn't've"),
    ("mightn'tve", "mightn't've"),
    ("mightve", "might've"),
    ("mustnt", "mustn't"),
    ("mustve", "must've"),
    ("neednt", "needn't"),
    ("notve", "not've"),
    ("oclock", "o'clock"),
    ("oughtnt", "oughtn't"),
    ("ow's'at", "'ow's'at"),
    ("'ows'at", "'ow's'at"),
    ("'ow'sat", "'ow'sat"),
    ("shant", "shan't"),
    ("shed've", "she'd've"),
    ("she'dve", "she'd've"),
    ("she's", "she's"),
    ("shouldve", "should've"),
    ("shouldnt", "shouldn't"),
    ("shouldnt've", "shouldn't've"),
    ("shouldn'tve", "shouldn't've"),
    ("somebody'd", "somebodyd"),
    ("somebodyd've", "somebody'd've"),
    ("somebody'dve", "somebody'd've"),
    ("somebodyll", "somebody'll"),
    ("somebodys", "somebody's"),
    ("someoned", "someone'd"),
    ("someoned've", "someone'd've"),
    ("someone'dve", "someone'd've"),
    ("someonell", "someone'll"),
    ("someones", "someone's"),
    ("somethingd", "something'd"),
    ("somethingd've", "something'd've"),
    ("something'dve", "something'd've"),
    ("somethingll", "something'll"),
    ("thats", "that's"),
    ("thered", "there'd"),
    ("thered've", "there'd've"),
    ("there'dve", "there'd've"),
    ("therere", "there're"),
    ("theres", "there's"),
    ("theyd", "they'd"),
    ("theyd've", "they'd've"),
    ("they'dve", "they'd've"),
    ("theyll", "they'll"),
    ("theyre", "they're"),
    ("theyve", "they've"),
    ("twas", "'twas"),
    ("wasnt", "wasn't"),
    ("wed've", "we'd've"),
    ("we'dve", "we'd've"),
    ("weve", "we've"),
    ("werent", "weren't"),
    ("whatll", "what'll"),
    ("whatre", "what're"),
    ("whats", "what's"),
    ("whatve", "what've"),
    ("whens", "when's"),
    ("whered", "where'd"),
    ("wheres", "where's"),
    ("whereve", "where've"),
    ("whod", "who'd"),
    ("whod've", "who'd've"),
    ("who'dve", "who'd've"),
    ("wholl", "who'll"),
    ("whos", "who's"),
    ("whove", "who've"),
    ("whyll", "why'll"),
    ("whyre", "why're"),
    ("whys", "why's"),
    ("wont", "won't"),
    ("wouldve", "would've"),
    ("wouldnt", "wouldn't"),
    ("wouldnt've", "wouldn't've"),
    ("wouldn'tve", "wouldn't've"),
    ("yall", "y'all"),
    ("yall'll", "y'all'll"),
    ("y'allll", "y'all'll"),
    ("yall'd've", "y'all'd've"),
    ("y'alld've", "y'all'd've"),
    ("y'all'dve", "y'all'd've"),
    ("youd", "you'd"),
    ("youd've", "you'd've"),
    ("you'dve", "you'd've"),
    ("youll", "you'll"),
    ("youre", "you're"),
    ("youve", "you've"),
];

/// The official `processPunctuation`.
pub fn process_punctuation(text: &str) -> String {
    let digit_comma_digit = text.as_bytes().windows(3).any(|w| w[0].is_ascii_digit() && w[1] == b',' && w[2].is_ascii_digit());
    let mut out = text.to_string();
    for p in PUNCT {
        let delete = text.contains(&format!("{p} ")) || text.contains(&format!(" {p}")) || digit_comma_digit;
        out = out.replace(p, if delete { "" } else { " " });
    }
    // `(?!<=\d)(\.)(?!\d)`: a period not followed by a digit; at most 32 of them.
    let chars: Vec<char> = out.chars().collect();
    let mut kept = String::with_capacity(out.len());
    let mut removed = 0;
    for (i, &c) in chars.iter().enumerate() {
        let next_is_digit = chars.get(i + 1).is_some_and(|n| n.is_ascii_digit());
        if c == '.' && !next_is_digit && removed < 32 {
            removed += 1;
            continue;
        }
        kept.push(c);
    }
    kept
}

/// The official `processDigitArticle`.
pub fn process_digit_article(text: &str) -> String {
    let numbers: HashMap<&str, &str> = NUMBERS.into_iter().collect();
    let contractions: HashMap<&str, &str> = CONTRACTIONS.iter().copied().collect();
    let lower = text.to_lowercase();
    let words: Vec<&str> =
        lower.split_whitespace().map(|w| numbers.get(w).copied().unwrap_or(w)).filter(|w| !ARTICLES.contains(w)).collect();
    words.iter().map(|w| contractions.get(w).copied().unwrap_or(w)).collect::<Vec<_>>().join(" ")
}

/// The accuracy of one answer against the human answers, as the official loop computes it.
pub fn question_accuracy(answer: &str, humans: &[String]) -> f64 {
    let clean = |s: &str| s.replace(['\n', '\t'], " ").trim().to_string();
    let answer = process_digit_article(&process_punctuation(&clean(answer)));
    // The official code strips the human answers only in its later versions; this one compares
    // them as given, with punctuation processing when they disagree.
    let distinct: HashSet<&String> = humans.iter().collect();
    let humans: Vec<String> = if distinct.len() > 1 { humans.iter().map(|h| process_punctuation(h)).collect() } else { humans.to_vec() };
    let per_left_out: Vec<f64> = (0..humans.len())
        .map(|i| {
            let matches = humans.iter().enumerate().filter(|&(j, h)| j != i && *h == answer).count();
            (matches as f64 / 3.0).min(1.0)
        })
        .collect();
    per_left_out.iter().sum::<f64>() / per_left_out.len() as f64
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<T> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {what} {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("{what} {} is not in the official format", path.display()))
}

/// Python's `round(x, 2)` for the values here (correctly rounded to two decimals).
fn round2(x: f64) -> f64 {
    format!("{x:.2}").parse().unwrap_or(x)
}

/// Scores `results` against `annotations` (whose question ids `questions` must hold).
pub fn evaluate(questions: &Path, annotations: &Path, results: &Path) -> Result<Accuracy> {
    let questions: QuestionsFile = read_json(questions, "--questions")?;
    let annotations_file: AnnotationsFile = read_json(annotations, "--annotations")?;
    let predictions: Vec<Prediction> = read_json(results, "--results")?;
    let asked: HashSet<u64> = questions.questions.iter().map(|q| q.question_id).collect();
    let mut gts: BTreeMap<u64, &Annotation> = BTreeMap::new();
    for a in &annotations_file.annotations {
        ensure!(gts.insert(a.question_id, a).is_none(), "--annotations: question {} is annotated twice", a.question_id);
        ensure!(!a.answers.is_empty(), "--annotations: question {} has no human answers", a.question_id);
        ensure!(asked.contains(&a.question_id), "--annotations: question {} is not in --questions", a.question_id);
    }
    let mut answers: HashMap<u64, &str> = HashMap::new();
    for p in &predictions {
        ensure!(gts.contains_key(&p.question_id), "--results: question {} is not in --annotations", p.question_id);
        ensure!(answers.insert(p.question_id, &p.answer).is_none(), "--results: question {} is answered twice", p.question_id);
    }
    if let Some(missing) = gts.keys().find(|q| !answers.contains_key(q)) {
        bail!("--results answers {} of the {} annotated questions (question {missing} has no answer): the official evaluation needs every one", answers.len(), gts.len());
    }
    let mut all = vec![];
    let (mut by_answer, mut by_question): (BTreeMap<String, Vec<f64>>, BTreeMap<String, Vec<f64>>) = Default::default();
    for (id, a) in &gts {
        let humans: Vec<String> = a.answers.iter().map(|h| h.answer.clone()).collect();
        let acc = question_accuracy(answers[id], &humans);
        all.push(acc);
        by_answer.entry(a.answer_type.clone()).or_default().push(acc);
        by_question.entry(a.question_type.clone()).or_default().push(acc);
    }
    let pct = |v: &[f64]| round2(100.0 * v.iter().sum::<f64>() / v.len() as f64);
    Ok(Accuracy {
        overall: pct(&all),
        per_answer_type: by_answer.iter().map(|(k, v)| (k.clone(), pct(v))).collect(),
        per_question_type: by_question.iter().map(|(k, v)| (k.clone(), pct(v))).collect(),
    })
}

pub fn run(args: &VqaEvalArgs) -> Result<()> {
    let acc = evaluate(&args.questions, &args.annotations, &args.results)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&acc)?);
        return Ok(());
    }
    println!("Overall Accuracy is: {:.2}", acc.overall);
    println!("Per Answer Type Accuracy is the following:");
    for (k, v) in &acc.per_answer_type {
        println!("{k} : {v:.2}");
    }
    println!("Per Question Type Accuracy is the following:");
    for (k, v) in &acc.per_question_type {
        println!("{k} : {v:.2}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_official_normalisation() {
        assert_eq!(process_digit_article(&process_punctuation("Two dogs.")), "2 dogs");
        assert_eq!(process_digit_article(&process_punctuation("the cat's toy")), "cat's toy");
        assert_eq!(process_digit_article("dont know"), "don't know");
        assert_eq!(process_punctuation("1,000"), "1000");
        assert_eq!(process_punctuation("yes, it is"), "yes it is");
        assert_eq!(process_punctuation("left-right"), "left right");
        assert_eq!(process_punctuation("3.5 m."), "3.5 m");
        // The official map has 120 entries; a lost line would show here.
        assert_eq!(CONTRACTIONS.len(), 120);
    }

    #[test]
    fn leave_one_out_soft_accuracy() {
        let humans = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // 3 of 10 say "red": each left-out subset with 3 matches gives 1, with 2 gives 2/3.
        let h = humans(&["red", "red", "red", "blue", "blue", "blue", "blue", "blue", "blue", "blue"]);
        assert!((question_accuracy("red", &h) - (7.0 * 1.0 + 3.0 * 2.0 / 3.0) / 10.0).abs() < 1e-12);
        assert_eq!(question_accuracy("Blue", &h), 1.0);
        assert_eq!(question_accuracy("green", &h), 0.0);
    }
}
