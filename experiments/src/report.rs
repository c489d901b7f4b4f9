//! What every experiment reports the same way: statistics over seeds, progress bars, and
//! markdown tables. (Result folders, JSON files and provenance: `provenance.rs`; plots: `plot.rs`.)

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};

/// Mean and sample standard deviation (0 for one value).
pub fn mean_std(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = if x.len() > 1 { x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

/// A bar over `len` steps on stderr: `prefix [=====>    ] pos/len message eta`.
pub fn progress_bar(len: u64, prefix: String) -> Result<ProgressBar> {
    // A distributed run draws rank 0's bars only.
    let bar = if crate::ranks::quiet() { ProgressBar::hidden() } else { ProgressBar::new(len) };
    let bar = bar.with_style(ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} eta {eta}")?.progress_chars("=> "));
    bar.set_prefix(prefix);
    Ok(bar)
}

/// A spinner on stderr for work of unknown length (early stopping): `prefix message [elapsed]`.
pub fn spinner(prefix: String) -> Result<ProgressBar> {
    let bar = if crate::ranks::quiet() { ProgressBar::hidden() } else { ProgressBar::new_spinner() };
    let bar = bar.with_style(ProgressStyle::with_template("{spinner} {prefix} {msg} [{elapsed}]")?);
    bar.set_prefix(prefix);
    Ok(bar)
}

/// A markdown table.
pub fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut t = format!("| {} |\n|{}\n", header.join(" | "), "---|".repeat(header.len()));
    for r in rows {
        t += &format!("| {} |\n", r.join(" | "));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_and_tables() {
        let (m, s) = mean_std(&[1.0, 2.0, 3.0]);
        assert_eq!((m, s), (2.0, 1.0));
        assert_eq!(mean_std(&[4.0]), (4.0, 0.0));
        assert_eq!(markdown_table(&["a", "b"], &[vec!["1".into(), "2".into()]]), "| a | b |\n|---|---|\n| 1 | 2 |\n");
    }
}
