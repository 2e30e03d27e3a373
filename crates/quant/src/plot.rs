//! The size–quality chart: file size against mean and 99.9th-percentile KLD, one point
//! per mix, and the record of mixes it is drawn from.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::register_font;
use serde::{Deserialize, Serialize};

use crate::error::{QuantError, Result};

/// The chart's font (the one agentstack-harness embeds for its charts).
static FONT: &[u8] = include_bytes!("../../harness/assets/DejaVuSans.ttf");

/// One measured mix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Its name (`ours Q4_K_M size`, `llama.cpp Q2_K`).
    pub label: String,
    /// Which series it belongs to (points of a series are joined).
    pub series: String,
    /// File size in MiB.
    pub mib: f64,
    /// Mean KLD.
    pub mean_kld: f64,
    /// 99.9th-percentile KLD.
    pub p999_kld: f64,
}

/// Draws `points` to `png`: two panels (mean KLD, 99.9% KLD) against size, one colour per
/// series, log-scaled KLD.
pub fn draw(points: &[Point], png: &Path) -> Result<()> {
    let fail = |e: &dyn std::fmt::Display| QuantError::Io {
        path: png.to_owned(),
        source: std::io::Error::other(e.to_string()),
    };
    if points.is_empty() {
        return Err(QuantError::Invalid("no mixes to plot".into()));
    }
    register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| fail(&"the embedded font does not load"))?;
    let root = BitMapBackend::new(png, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let panels = root.split_evenly((1, 2));
    let (xmin, xmax) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), p| {
        (a.min(p.mib), b.max(p.mib))
    });
    let pad = ((xmax - xmin) * 0.08).max(1.0);
    let mut series: Vec<&str> = points.iter().map(|p| p.series.as_str()).collect();
    series.sort();
    series.dedup();
    let palette = [&BLUE, &RED, &GREEN, &MAGENTA, &BLACK, &CYAN];
    for (panel, (title, get)) in panels.iter().zip([
        ("mean KLD", (|p: &Point| p.mean_kld) as fn(&Point) -> f64),
        ("99.9% KLD", |p: &Point| p.p999_kld),
    ]) {
        let (ymin, ymax) = points
            .iter()
            .map(get)
            .filter(|v| *v > 0.0)
            .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{title} vs file size"), ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(
                (xmin - pad)..(xmax + pad),
                ((ymin * 0.7)..(ymax * 1.4)).log_scale(),
            )
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("file size (MiB)")
            .y_desc(title)
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(|e| fail(&e))?;
        for (i, s) in series.iter().enumerate() {
            let color = palette[i % palette.len()];
            let mut pts: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.series == *s)
                .map(|p| (p.mib, get(p).max(ymin)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| fail(&e))?
                .label(*s)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    pts.iter()
                        .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
                )
                .map_err(|e| fail(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(|e| fail(&e))?;
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("p.png");
        let p = |label: &str, series: &str, mib, m, t| Point {
            label: label.into(),
            series: series.into(),
            mib,
            mean_kld: m,
            p999_kld: t,
        };
        draw(
            &[
                p("a", "ours", 84.0, 0.2, 2.0),
                p("b", "ours", 90.0, 0.07, 1.0),
                p("c", "llama.cpp", 89.2, 0.073, 1.17),
            ],
            &png,
        )
        .unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000);
        assert!(draw(&[], &png).is_err());
    }
}
