//! Comparing runs: a table of their summaries and a PNG chart of mean reward with
//! 95% confidence intervals, grouped by environment.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::register_font;
use serde_json::Value;

use crate::run::{RunError, Summary};

/// DejaVu Sans (Bitstream Vera license, see assets/DejaVuSans.LICENSE), embedded so
/// that charts render the same on every machine, with no system fonts.
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// One run, as compared.
#[derive(Debug, Clone)]
pub struct Compared {
    /// The run directory.
    pub dir: PathBuf,
    /// Its summary.
    pub summary: Summary,
    /// What distinguishes its configuration, in a few words (context policy,
    /// sampling, profile).
    pub label: String,
}

/// Reads the summaries of `dirs`.
pub fn load(dirs: &[PathBuf]) -> Result<Vec<Compared>, RunError> {
    dirs.iter()
        .map(|dir| {
            let read = |name: &str| -> Result<Value, RunError> {
                let path = dir.join(name);
                let text = std::fs::read_to_string(&path).map_err(|source| RunError::Io {
                    path: path.clone(),
                    source,
                })?;
                serde_json::from_str(&text).map_err(|e| RunError::Io {
                    path,
                    source: std::io::Error::other(e),
                })
            };
            let summary: Summary = serde_json::from_value(read("summary.json")?).map_err(|e| {
                RunError::Config(format!(
                    "{}: summary.json is not a run summary ({e}); is the run finished?",
                    dir.display()
                ))
            })?;
            let config = read("config.json")?;
            Ok(Compared {
                dir: dir.clone(),
                label: label(&config["config"]),
                summary,
            })
        })
        .collect()
}

/// The settings that usually differ between compared runs.
fn label(config: &Value) -> String {
    let play = &config["play"];
    let context = &play["context"];
    let mut parts = vec![short_model(config["model"].as_str().unwrap_or("?"))];
    if let Some(budget) = context["max_tokens"].as_u64() {
        parts.push(format!(
            "ctx {budget} {}",
            context["overflow"].as_str().unwrap_or("")
        ));
    }
    if context["keep_thinking"] == Value::Bool(false) {
        parts.push("strip-think".into());
    }
    let t = play["sampling"]["temperature"].as_f64().unwrap_or(0.0);
    if t > 0.0 {
        parts.push(format!("T={t}"));
    }
    if play["constrain"] == Value::Bool(true) {
        parts.push("constrained".into());
    }
    parts.join(", ")
}

fn short_model(model: &str) -> String {
    let base = model.rsplit(['/', ':']).next().unwrap_or(model);
    base.strip_suffix(".gguf").unwrap_or(base).to_owned()
}

/// A Markdown table of the runs.
pub fn table(runs: &[Compared]) -> String {
    let mut out = String::from(
        "| run | env | configuration | episodes | mean reward ± se | 95% CI | success | parse errors/turn |\n|---|---|---|--:|--:|--:|--:|--:|\n",
    );
    for r in runs {
        let s = &r.summary;
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.3} ± {:.3} | [{:.3}, {:.3}] | {:.1}% | {:.3} |\n",
            s.run_id,
            s.env,
            r.label,
            s.episodes,
            s.mean_reward,
            s.stderr,
            s.ci95.0,
            s.ci95.1,
            100.0 * s.success_rate,
            s.parse_error_rate
        ));
    }
    out
}

/// Registers the embedded font as plotters' `sans-serif` (every chart here uses it).
pub fn register_chart_font() -> bool {
    register_font("sans-serif", FontStyle::Normal, FONT).is_ok()
}

/// Draws mean reward with its 95% CI per run, grouped by environment, to `png`.
pub fn chart(runs: &[Compared], png: &Path) -> Result<(), RunError> {
    let fail = |e: &dyn std::fmt::Display| RunError::Io {
        path: png.to_owned(),
        source: std::io::Error::other(e.to_string()),
    };
    register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| fail(&"the embedded font does not load"))?;
    let mut runs: Vec<&Compared> = runs.iter().collect();
    runs.sort_by(|a, b| a.summary.env.cmp(&b.summary.env));
    let low = runs
        .iter()
        .map(|r| r.summary.ci95.0)
        .filter(|x| x.is_finite())
        .fold(0.0f64, f64::min);
    let high = runs
        .iter()
        .map(|r| r.summary.ci95.1)
        .filter(|x| x.is_finite())
        .fold(1.0f64, f64::max);
    let width = (220 + 120 * runs.len() as u32).clamp(640, 2400);
    let root = BitMapBackend::new(png, (width, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Mean episode reward (95% CI)", ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(90)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(runs.len() as f64 - 0.5), low..high)
        .map_err(|e| fail(&e))?;
    let labels: Vec<String> = runs
        .iter()
        .map(|r| format!("{}\n{}", r.summary.env, r.label))
        .collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(runs.len().max(1))
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("reward")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| fail(&e))?;
    let palette = [&BLUE, &RED, &GREEN, &MAGENTA, &CYAN, &BLACK];
    let mut envs: Vec<&str> = runs.iter().map(|r| r.summary.env.as_str()).collect();
    envs.dedup();
    for (i, r) in runs.iter().enumerate() {
        let color =
            palette[envs.iter().position(|e| *e == r.summary.env).unwrap_or(0) % palette.len()];
        let x = i as f64;
        let s = &r.summary;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(x - 0.3, 0.0), (x + 0.3, s.mean_reward)],
                color.mix(0.5).filled(),
            )))
            .map_err(|e| fail(&e))?;
        chart
            .draw_series(std::iter::once(ErrorBar::new_vertical(
                x,
                s.ci95.0,
                s.mean_reward,
                s.ci95.1,
                BLACK.stroke_width(2),
                12,
            )))
            .map_err(|e| fail(&e))?;
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}
