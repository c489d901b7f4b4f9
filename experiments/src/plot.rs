//! SVG line charts for every experiment's reports (plotters' SVG backend: no system libraries).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

/// One named curve of `(x, y)` points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Draws `series` into an SVG at `path` (written atomically), axes fitted to the data.
pub fn line_chart(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<()> {
    let all: Vec<(f64, f64)> =
        series.iter().flat_map(|s| s.points.iter().copied()).filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
    if all.is_empty() {
        return Ok(());
    }
    let (mut x0, mut x1) = all.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (mut y0, mut y1) = all.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if x1 <= x0 {
        (x0, x1) = (x0 - 0.5, x1 + 0.5);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-6);
    (y0, y1) = (y0 - pad, y1 + pad);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 440)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("plotting {title}: {e}"))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| anyhow!("plotting {title}: {e}"))?;
        // Epochs and updates are whole numbers: their ticks read 4, not 4.0 (other axes keep
        // plotters' own labels).
        let whole = all.iter().all(|p| p.0.fract() == 0.0);
        let x_tick = |v: &f64| {
            if v.fract().abs() < 1e-9 {
                format!("{v:.0}")
            } else {
                format!("{v:.2}").trim_end_matches('0').to_string()
            }
        };
        let mut mesh = chart.configure_mesh();
        mesh.x_desc(x_label).y_desc(y_label);
        if whole {
            mesh.x_label_formatter(&x_tick);
        }
        mesh.draw().map_err(|e| anyhow!("plotting {title}: {e}"))?;
        for (i, s) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| anyhow!("plotting {title}: {e}"))?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        if series.len() > 1 {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| anyhow!("plotting {title}: {e}"))?;
        }
        root.present().map_err(|e| anyhow!("plotting {title}: {e}"))?;
    }
    probattn::io::write_bytes_atomic(path, svg.as_bytes())?;
    Ok(())
}
