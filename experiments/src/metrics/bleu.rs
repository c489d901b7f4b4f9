//! `probattn bleu`: corpus BLEU as sacreBLEU 2.x computes it (Post 2018), so that our numbers and
//! a PyTorch user's `sacrebleu` agree to the last digit.
//!
//! The default is sacreBLEU's default: the `13a` tokenizer (mteval-v13a's), cased, one reference
//! per segment (the closest reference length is then that reference's), 4-gram, exp smoothing
//! (NIST's: it only acts when an n-gram order has no match at all, which a real corpus never has,
//! so it equals unsmoothed BLEU there). `BLEU = BP · exp(¼ Σ_n log p_n)`, `p_n` the clipped n-gram
//! precisions over the corpus, `BP = exp(1 − ref_len / sys_len)` when the system is shorter.
//!
//! Papers on IWSLT14 (and fairseq's scorer) report BLEU on tokenized, lowercased text; it is often
//! 1-2 points above cased, detokenized sacreBLEU. `--tokenized-lowercase` computes that one: both
//! sides lowercased, then tokenized by `13a` (sacreBLEU's `-lc`). Every number carries its signature,
//! so the two are never confused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

/// The n-gram orders BLEU counts.
const MAX_ORDER: usize = 4;

/// Flags of `probattn bleu`.
#[derive(Args, Debug)]
pub struct BleuArgs {
    /// Reference file: one detokenized segment per line.
    #[arg(long = "ref")]
    pub reference: PathBuf,
    /// System output (hypotheses): one segment per line, as many lines as the reference.
    #[arg(long = "hyp")]
    pub hypothesis: PathBuf,
    /// Tokenized, lowercased BLEU (the papers' and fairseq's kind): lowercase both sides, then
    /// tokenize with 13a. Shorthand for --lowercase --tokenize 13a.
    #[arg(long)]
    pub tokenized_lowercase: bool,
    /// Lowercase hypotheses and references first (sacreBLEU's -lc).
    #[arg(long)]
    pub lowercase: bool,
    /// Tokenizer: 13a (sacreBLEU's default, mteval-v13a) or none (text already tokenized, split on
    /// whitespace, as multi-bleu.perl does).
    #[arg(long, value_enum, default_value_t = Tokenize::Thirteen)]
    pub tokenize: Tokenize,
    /// Smoothing: exp (sacreBLEU's default) or none.
    #[arg(long, value_enum, default_value_t = Smooth::Exp)]
    pub smooth: Smooth,
    /// Print JSON: {"bleu", "precisions", "bp", "sys_len", "ref_len", "signature"}.
    #[arg(long)]
    pub json: bool,
}

/// `--tokenize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
pub enum Tokenize {
    /// mteval-v13a's tokenization, as sacreBLEU's `13a`.
    #[value(name = "13a")]
    #[serde(rename = "13a")]
    Thirteen,
    /// Split on whitespace only.
    #[value(name = "none")]
    #[serde(rename = "none")]
    None,
}

/// `--smooth`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Smooth {
    /// NIST (mteval-v13a) smoothing, sacreBLEU's default: an order with no match gets
    /// `1 / (2^k · total)`, k counting such orders.
    Exp,
    /// None: an order with no match makes BLEU 0.
    None,
}

/// How BLEU is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BleuConfig {
    pub lowercase: bool,
    pub tokenize: Tokenize,
    pub smooth: Smooth,
}

impl Default for BleuConfig {
    /// sacreBLEU's default: cased, 13a, exp smoothing.
    fn default() -> Self {
        Self { lowercase: false, tokenize: Tokenize::Thirteen, smooth: Smooth::Exp }
    }
}

impl BleuConfig {
    /// Tokenized, lowercased BLEU (the papers' kind).
    pub fn tokenized_lowercase() -> Self {
        Self { lowercase: true, ..Self::default() }
    }

    /// sacreBLEU's signature of this configuration (`nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`
    /// is what sacreBLEU 2.6.0 prints for the default; we name our implementation instead of its
    /// version).
    pub fn signature(&self) -> String {
        let case = if self.lowercase { "lc" } else { "mixed" };
        let tok = match self.tokenize {
            Tokenize::Thirteen => "13a",
            Tokenize::None => "none",
        };
        let smooth = match self.smooth {
            Smooth::Exp => "exp",
            Smooth::None => "none",
        };
        format!("nrefs:1|case:{case}|eff:no|tok:{tok}|smooth:{smooth}|version:probattn-{}", env!("CARGO_PKG_VERSION"))
    }

    /// The tokens of one segment: trailing whitespace stripped, optionally lowercased, tokenized.
    pub fn tokens(&self, segment: &str) -> Vec<String> {
        let s = segment.trim_end_matches(is_python_space);
        let s = if self.lowercase { s.to_lowercase() } else { s.to_string() };
        let s = match self.tokenize {
            Tokenize::Thirteen => tokenize_13a(&s),
            Tokenize::None => s,
        };
        s.split(is_python_space).filter(|t| !t.is_empty()).map(str::to_string).collect()
    }
}

/// Python's `str.isspace` (what `str.split()` splits on): Unicode whitespace plus the four ASCII
/// information separators U+001C..U+001F, which Rust's `char::is_whitespace` leaves out.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// mteval-v13a's tokenization, as sacreBLEU's `Tokenizer13a` writes it: unescape four entities,
/// then four regular expressions applied one after another, each left to right without overlaps:
/// 1. `([\{-\~\[-\` -\&\(-\+\:-\@\/])` → ` \1 ` (punctuation and symbols);
/// 2. `([^0-9])([\.,])` → `\1 \2 ` (period and comma unless after a digit);
/// 3. `([\.,])([^0-9])` → ` \1 \2` (period and comma unless before a digit);
/// 4. `([0-9])(-)` → `\1 \2 ` (a dash after a digit).
///
/// The result is not whitespace-normalized; split it on whitespace.
pub fn tokenize_13a(line: &str) -> String {
    let mut line = line.replace("<skipped>", "").replace("-\n", "").replace('\n', " ");
    if line.contains('&') {
        line = line.replace("&quot;", "\"").replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">");
    }
    let chars: Vec<char> = format!(" {line} ").chars().collect();
    // 1: single characters, so no overlap question arises.
    let symbol = |c: char| matches!(c, '{'..='~' | '['..='`' | ' '..='&' | '('..='+' | ':'..='@' | '/');
    let mut s1 = Vec::with_capacity(chars.len() * 2);
    for &c in &chars {
        if symbol(c) {
            s1.extend([' ', c, ' ']);
        } else {
            s1.push(c);
        }
    }
    let digit = |c: char| c.is_ascii_digit();
    let period_comma = |c: char| c == '.' || c == ',';
    // 2, 3, 4: two-character patterns, matched left to right; a match consumes both characters.
    let s2 = rewrite_pairs(&s1, |a, b| !digit(a) && period_comma(b), |a, b| vec![a, ' ', b, ' ']);
    let s3 = rewrite_pairs(&s2, |a, b| period_comma(a) && !digit(b), |a, b| vec![' ', a, ' ', b]);
    let s4 = rewrite_pairs(&s3, |a, b| digit(a) && b == '-', |a, b| vec![a, ' ', b, ' ']);
    s4.into_iter().collect()
}

/// `re.sub` for a pattern of two single-character classes: scans left to right, and where
/// `matches(a, b)` holds for the next two characters, writes `replace(a, b)` and moves past both.
fn rewrite_pairs(s: &[char], matches: impl Fn(char, char) -> bool, replace: impl Fn(char, char) -> Vec<char>) -> Vec<char> {
    let mut out = Vec::with_capacity(s.len() + s.len() / 4);
    let mut i = 0;
    while i < s.len() {
        if i + 1 < s.len() && matches(s[i], s[i + 1]) {
            out.extend(replace(s[i], s[i + 1]));
            i += 2;
        } else {
            out.push(s[i]);
            i += 1;
        }
    }
    out
}

/// The sufficient statistics of corpus BLEU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BleuStats {
    pub sys_len: u64,
    pub ref_len: u64,
    /// Clipped n-gram matches, n = 1..4.
    pub correct: [u64; MAX_ORDER],
    /// Hypothesis n-grams, n = 1..4.
    pub total: [u64; MAX_ORDER],
}

impl BleuStats {
    /// Adds one segment pair.
    pub fn add(&mut self, hyp: &[String], reference: &[String]) {
        self.sys_len += hyp.len() as u64;
        self.ref_len += reference.len() as u64;
        let ref_counts = ngram_counts(reference);
        for (gram, count) in ngram_counts(hyp) {
            let n = gram.len() - 1;
            self.total[n] += count;
            if let Some(&r) = ref_counts.get(&gram) {
                self.correct[n] += count.min(r);
            }
        }
    }
}

fn ngram_counts(tokens: &[String]) -> HashMap<&[String], u64> {
    let mut counts = HashMap::new();
    for n in 1..=MAX_ORDER {
        for gram in tokens.windows(n) {
            *counts.entry(gram).or_insert(0) += 1;
        }
    }
    counts
}

/// A BLEU score with what it was computed from.
#[derive(Clone, Debug, Serialize)]
pub struct BleuScore {
    /// 0-100.
    pub bleu: f64,
    /// n-gram precisions, percent, n = 1..4 (after smoothing, as sacreBLEU reports them).
    pub precisions: [f64; MAX_ORDER],
    /// Brevity penalty.
    pub bp: f64,
    pub sys_len: u64,
    pub ref_len: u64,
    pub signature: String,
}

impl BleuScore {
    /// sacreBLEU's one-line format: `BLEU = 48.89 85.7/66.7/40.0/25.0 (BP = 1.000 ratio = 1.000
    /// hyp_len = 7 ref_len = 7)`.
    pub fn line(&self) -> String {
        let p = self.precisions.map(|p| format!("{p:.1}")).join("/");
        let ratio = if self.ref_len > 0 { self.sys_len as f64 / self.ref_len as f64 } else { 0.0 };
        format!(
            "BLEU = {:.2} {p} (BP = {:.3} ratio = {ratio:.3} hyp_len = {} ref_len = {})",
            self.bleu, self.bp, self.sys_len, self.ref_len
        )
    }
}

/// BLEU from its statistics, as sacreBLEU's `BLEU.compute_bleu` (no effective order).
pub fn score_from_stats(stats: &BleuStats, cfg: &BleuConfig) -> BleuScore {
    let (sys, reference) = (stats.sys_len as f64, stats.ref_len as f64);
    let bp = if sys < reference {
        if sys > 0.0 {
            (1.0 - reference / sys).exp()
        } else {
            0.0
        }
    } else {
        1.0
    };
    let mut precisions = [0.0; MAX_ORDER];
    let done = |bleu: f64, precisions: [f64; MAX_ORDER]| BleuScore {
        bleu,
        precisions,
        bp,
        sys_len: stats.sys_len,
        ref_len: stats.ref_len,
        signature: cfg.signature(),
    };
    if stats.correct.iter().all(|&c| c == 0) {
        return done(0.0, precisions);
    }
    let mut smooth_mteval = 1.0;
    for (p, (&correct, &total)) in precisions.iter_mut().zip(stats.correct.iter().zip(&stats.total)) {
        if total == 0 {
            break;
        }
        if correct == 0 {
            if cfg.smooth == Smooth::Exp {
                smooth_mteval *= 2.0;
                *p = 100.0 / (smooth_mteval * total as f64);
            }
        } else {
            *p = 100.0 * correct as f64 / total as f64;
        }
    }
    // sacreBLEU's my_log: log p, or −9999999999 for p = 0 (the score is then 0).
    let log_sum: f64 = precisions.iter().map(|&p| if p > 0.0 { p.ln() } else { -9_999_999_999.0 }).sum();
    done(bp * (log_sum / MAX_ORDER as f64).exp(), precisions)
}

/// Corpus BLEU of `hyps` against one reference each.
pub fn corpus_bleu<H: AsRef<str>, R: AsRef<str>>(hyps: &[H], refs: &[R], cfg: &BleuConfig) -> Result<BleuScore> {
    ensure!(hyps.len() == refs.len(), "{} hypotheses but {} references: one of each per line", hyps.len(), refs.len());
    let mut stats = BleuStats::default();
    for (h, r) in hyps.iter().zip(refs) {
        stats.add(&cfg.tokens(h.as_ref()), &cfg.tokens(r.as_ref()));
    }
    Ok(score_from_stats(&stats, cfg))
}

/// The lines of a UTF-8 text file (a final newline does not make an extra empty line).
pub fn read_lines(path: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{} is not UTF-8 text (byte {})", path.display(), e.utf8_error().valid_up_to()))?;
    Ok(text.lines().map(str::to_string).collect())
}

pub fn run(args: &BleuArgs) -> Result<()> {
    let mut cfg = BleuConfig { lowercase: args.lowercase, tokenize: args.tokenize, smooth: args.smooth };
    if args.tokenized_lowercase {
        ensure!(args.tokenize == Tokenize::Thirteen, "--tokenized-lowercase tokenizes with 13a; drop --tokenize none");
        cfg.lowercase = true;
    }
    let refs = read_lines(&args.reference).context("--ref")?;
    let hyps = read_lines(&args.hypothesis).context("--hyp")?;
    ensure!(
        hyps.len() == refs.len(),
        "--hyp {} has {} lines but --ref {} has {}: one hypothesis per reference line",
        args.hypothesis.display(),
        hyps.len(),
        args.reference.display(),
        refs.len()
    );
    ensure!(!refs.is_empty(), "--ref {} is empty", args.reference.display());
    let score = corpus_bleu(&hyps, &refs, &cfg)?;
    if args.json {
        println!("{}", serde_json::to_string(&score)?);
    } else {
        println!("{} {}", score.line(), score.signature);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(s: &str) -> String {
        tokenize_13a(s).split_whitespace().collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn thirteen_a_tokenizes_as_mteval() {
        assert_eq!(tok("Hello, world."), "Hello , world .");
        assert_eq!(tok("It costs 3.50 dollars, 1,000 times."), "It costs 3.50 dollars , 1,000 times .");
        assert_eq!(tok("a 5-year-old's \"toy\" (red)"), "a 5 - year-old's \" toy \" ( red )");
        assert_eq!(tok("x &amp; y &lt;z&gt;"), "x & y < z >");
        assert_eq!(tok("end.."), "end . .");
    }

    #[test]
    fn bleu_of_a_known_pair() -> Result<()> {
        // sacreBLEU 2.6.0: BLEU = 48.89 85.7/66.7/40.0/25.0 (BP = 1.000 ratio = 1.000 hyp_len = 7 ref_len = 7)
        let s = corpus_bleu(&["The cat sat on the mat."], &["The cat sat on a mat."], &BleuConfig::default())?;
        assert_eq!(s.line(), "BLEU = 48.89 85.7/66.7/40.0/25.0 (BP = 1.000 ratio = 1.000 hyp_len = 7 ref_len = 7)");
        let perfect = corpus_bleu(&["A dog runs."], &["A dog runs."], &BleuConfig::default())?;
        assert!((perfect.bleu - 100.0).abs() < 1e-12);
        // No 4-gram match: exp smoothing gives a small positive score, none gives 0.
        let none = BleuConfig { smooth: Smooth::None, ..Default::default() };
        assert_eq!(corpus_bleu(&["a b c d e"], &["a b c x e"], &none)?.bleu, 0.0);
        assert!(corpus_bleu(&["a b c d e"], &["a b c x e"], &BleuConfig::default())?.bleu > 0.0);
        assert!(corpus_bleu(&["a"], &["a", "b"], &BleuConfig::default()).is_err());
        Ok(())
    }
}
