//! `probattn plot`: training curves of several runs on one chart, one metric of their
//! `metrics.jsonl` against the epoch (or another column). The runs' own folders each plot their
//! own curves; this draws a tuning grid or a table's rows side by side.
//!
//! A run folder is what `translate`, `vqa` or `gat` wrote: `metrics.jsonl` at its top (gat, vqa),
//! or one per seed under `seed-*/` (translate). Every line carries its `seed`; the lines of each
//! seed make one curve. Runs given the same `--label` are one group, and `--mean-seeds` averages a
//! group's seeds at the x values they all reached (a table's row, one folder a seed). A `null` value (a column that a run does not fill, as `kl` without BAM) is
//! left out of the curve.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use crate::plot::{line_chart, Series};

/// Flags of `probattn plot`.
#[derive(Args, Debug)]
pub struct PlotArgs {
    /// Run folders (with metrics.jsonl at the top or under seed-*/) or metrics.jsonl files.
    #[arg(required = true, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    /// The column to plot (valid_bleu, valid_loss, train_loss, kl for translate; val_acc,
    /// train_loss for gat and vqa); an unknown one is refused with the columns the runs have.
    #[arg(long)]
    pub metric: String,
    /// The column on the x axis: epoch, updates (translate) or seconds.
    #[arg(long, default_value = "epoch")]
    pub x: String,
    /// The SVG file to write (atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// A run's name in the legend, once per run in the order given (default: the folder's name).
    #[arg(long = "label", value_name = "LABEL")]
    pub labels: Vec<String>,
    /// Only the points at x >= FROM (the later epochs, say, where a grid's rows differ: the axes
    /// then fit those).
    #[arg(long, value_name = "FROM")]
    pub from: Option<f64>,
    /// One curve per run, the mean over its seeds at each x that every seed reached; runs given
    /// the same --label are one group (a table's seeds, each in its own folder).
    #[arg(long)]
    pub mean_seeds: bool,
    /// The chart's title (default: "METRIC against X", after the curve's name when there is one
    /// curve, which then has no legend).
    #[arg(long)]
    pub title: Option<String>,
}

/// A curve's points, (x, y), in file order.
type Points = Vec<(f64, f64)>;

/// One run's `metrics.jsonl` lines, as JSON objects with the file and line they came from.
struct Lines {
    rows: Vec<(String, serde_json::Map<String, serde_json::Value>)>,
}

/// The metrics files of a run: the path itself when it is a file, else `metrics.jsonl` at the
/// folder's top and under each `seed-*/`, sorted.
fn metrics_files(run: &Path) -> Result<Vec<PathBuf>> {
    ensure!(run.exists(), "{} does not exist", run.display());
    if run.is_file() {
        ensure!(
            run.extension().is_some_and(|e| e == "jsonl"),
            "{} is a file but not a metrics .jsonl: give run folders (a glob `DIR/*/` names folders only)",
            run.display()
        );
        return Ok(vec![run.to_path_buf()]);
    }
    let files = folder_metrics(run)?;
    if files.is_empty() {
        // A `vqa --fusion all` folder, or a table's root: runs one level down.
        let mut runs: Vec<String> = std::fs::read_dir(run)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir() && folder_metrics(p).is_ok_and(|f| !f.is_empty()))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        runs.sort();
        let hint = if runs.is_empty() {
            "not a run folder, or a run before its first epoch".to_string()
        } else {
            format!("its folders {} are runs: give them (`{}/*/`)", runs.join(", "), run.display())
        };
        bail!("{} has no metrics.jsonl (at its top or under seed-*/): {hint}", run.display());
    }
    Ok(files)
}

/// `metrics.jsonl` at a folder's top and under each `seed-*/`, sorted; none when it has neither.
fn folder_metrics(folder: &Path) -> Result<Vec<PathBuf>> {
    let mut files = vec![];
    if folder.join("metrics.jsonl").is_file() {
        files.push(folder.join("metrics.jsonl"));
    }
    let mut seeds = vec![];
    for entry in std::fs::read_dir(folder).with_context(|| format!("reading {}", folder.display()))? {
        let path = entry?.path();
        let is_seed = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("seed-"));
        if is_seed && path.join("metrics.jsonl").is_file() {
            seeds.push(path.join("metrics.jsonl"));
        }
    }
    seeds.sort();
    files.extend(seeds);
    Ok(files)
}

fn read_lines(run: &Path) -> Result<Lines> {
    let mut rows = vec![];
    for file in metrics_files(run)? {
        let body = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        for (i, line) in body.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let place = format!("{}:{}", file.display(), i + 1);
            let value: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{place} is not a JSON line"))?;
            let serde_json::Value::Object(object) = value else { bail!("{place} is not a JSON object") };
            rows.push((place, object));
        }
    }
    Ok(Lines { rows })
}

/// The numeric columns of a run's lines, for the error that names an unknown one.
fn numeric_columns(lines: &Lines) -> Vec<String> {
    let mut names: Vec<String> =
        lines.rows.iter().flat_map(|(_, o)| o.iter().filter(|(_, v)| v.is_number()).map(|(k, _)| k.clone())).collect();
    names.sort();
    names.dedup();
    names
}

/// Seed → its (x, y) points, in file order; lines whose x or y is null are left out.
fn curves(lines: &Lines, x: &str, metric: &str) -> Result<BTreeMap<i64, Points>> {
    let mut by_seed: BTreeMap<i64, Points> = BTreeMap::new();
    for (place, row) in &lines.rows {
        let number = |name: &str| -> Result<Option<f64>> {
            match row.get(name) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(Some).with_context(|| format!("{place}: {name} is {v}, not a number")),
            }
        };
        let seed = row.get("seed").and_then(|s| s.as_i64()).unwrap_or(0);
        if let (Some(px), Some(py)) = (number(x)?, number(metric)?) {
            by_seed.entry(seed).or_default().push((px, py));
        }
    }
    Ok(by_seed)
}

/// The mean of several curves at each x that every one of them reached.
fn mean_curve(curves: &[&[(f64, f64)]]) -> Points {
    let Some(first) = curves.first() else { return vec![] };
    let mut xs: Vec<f64> = first.iter().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    xs.into_iter()
        .filter_map(|x| {
            let ys: Option<Vec<f64>> = curves.iter().map(|points| points.iter().find(|p| p.0 == x).map(|p| p.1)).collect();
            ys.map(|ys| (x, ys.iter().sum::<f64>() / ys.len() as f64))
        })
        .collect()
}

fn run_name(run: &Path) -> String {
    let folder = if run.is_file() { run.parent().unwrap_or(run) } else { run };
    folder.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| run.display().to_string())
}

/// The curves of `args.runs`, named for the legend: runs that share a name (their `--label`) make
/// one group, whose seeds are drawn one by one, or averaged into one curve with `--mean-seeds`.
pub fn series(args: &PlotArgs) -> Result<Vec<Series>> {
    ensure!(
        args.labels.is_empty() || args.labels.len() == args.runs.len(),
        "--label is given {} times for {} runs: give one per run, in the runs' order, or none",
        args.labels.len(),
        args.runs.len()
    );
    // Legend name → its (seed, points), in the order the names first come.
    let mut groups: Vec<(String, Vec<(i64, Points)>)> = vec![];
    for (i, run) in args.runs.iter().enumerate() {
        let lines = read_lines(run)?;
        let mut by_seed = curves(&lines, &args.x, &args.metric)?;
        if by_seed.is_empty() {
            let known = numeric_columns(&lines);
            let missing = if known.contains(&args.x) { &args.metric } else { &args.x };
            bail!("{} has no values of '{missing}'; its numeric columns: {}", run.display(), known.join(", "));
        }
        if let Some(from) = args.from {
            by_seed.values_mut().for_each(|points| points.retain(|p| p.0 >= from));
            by_seed.retain(|_, points| !points.is_empty());
            ensure!(!by_seed.is_empty(), "{} has no point at {} >= {from} (--from)", run.display(), args.x);
        }
        let name = args.labels.get(i).cloned().unwrap_or_else(|| run_name(run));
        match groups.iter_mut().find(|(n, _)| *n == name) {
            Some((_, curves)) => curves.extend(by_seed),
            None => groups.push((name, by_seed.into_iter().collect())),
        }
    }
    let mut out = vec![];
    for (name, curves) in groups {
        if curves.len() == 1 {
            out.extend(curves.into_iter().map(|(_, points)| Series { name: name.clone(), points }));
        } else if args.mean_seeds {
            let points = mean_curve(&curves.iter().map(|(_, p)| p.as_slice()).collect::<Vec<_>>());
            ensure!(!points.is_empty(), "{name}: its {} seeds share no value of '{}' to average at", curves.len(), args.x);
            out.push(Series { name: format!("{name} (mean of {} seeds)", curves.len()), points });
        } else {
            out.extend(curves.into_iter().map(|(seed, points)| Series { name: format!("{name} seed {seed}"), points }));
        }
    }
    Ok(out)
}

pub fn run(args: &PlotArgs) -> Result<()> {
    ensure!(args.out.extension().is_some_and(|e| e == "svg"), "--out {} must name an .svg file (the chart is SVG)", args.out.display());
    let series = series(args)?;
    // A chart of one curve has no legend: its name goes into the title.
    let title = args.title.clone().unwrap_or_else(|| match series.as_slice() {
        [one] => format!("{}: {} against {}", one.name, args.metric, args.x),
        _ => format!("{} against {}", args.metric, args.x),
    });
    line_chart(&args.out, &title, &args.x, &args.metric, &series)?;
    let curves = if series.len() == 1 { "curve" } else { "curves" };
    println!("wrote {}: {} {curves} of {} against {}", args.out.display(), series.len(), args.metric, args.x);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(body: &[&str]) -> Lines {
        let rows = body
            .iter()
            .enumerate()
            .map(|(i, l)| match serde_json::from_str(l).unwrap() {
                serde_json::Value::Object(o) => (format!("line {i}"), o),
                _ => unreachable!(),
            })
            .collect();
        Lines { rows }
    }

    #[test]
    fn seeds_make_curves_and_nulls_are_left_out() -> Result<()> {
        let l = lines(&[
            r#"{"seed":1,"epoch":1,"kl":null,"valid_bleu":3.0}"#,
            r#"{"seed":1,"epoch":2,"kl":0.5,"valid_bleu":5.0}"#,
            r#"{"seed":2,"epoch":1,"kl":0.25,"valid_bleu":4.0}"#,
        ]);
        let c = curves(&l, "epoch", "valid_bleu")?;
        assert_eq!(c[&1], vec![(1.0, 3.0), (2.0, 5.0)]);
        assert_eq!(c[&2], vec![(1.0, 4.0)]);
        assert_eq!(curves(&l, "epoch", "kl")?[&1], vec![(2.0, 0.5)]);
        // Only epoch 1 is reached by both seeds.
        assert_eq!(mean_curve(&[&c[&1], &c[&2]]), vec![(1.0, 3.5)]);
        assert!(curves(&lines(&[r#"{"epoch":1,"valid_bleu":"x"}"#]), "epoch", "valid_bleu").is_err());
        Ok(())
    }
}
