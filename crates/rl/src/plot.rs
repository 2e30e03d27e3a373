//! The curves of a training run as PNGs: the mean reward of each step's rollouts with
//! the held-out evaluations and their 95% confidence intervals; for distillation, the
//! mean reverse KL to the teacher per step.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

/// Draws `train` (step, mean rollout reward) and `evals` (step → mean, CI) to `png`.
pub fn reward_curve(
    train: &[(usize, f64)],
    evals: &BTreeMap<usize, (f64, (f64, f64))>,
    png: &Path,
    title: &str,
) -> Result<(), String> {
    if !agentstack_harness::compare::register_chart_font() {
        return Err("the embedded font does not load".into());
    }
    let fail = |e: &dyn std::fmt::Display| e.to_string();
    let last = train
        .iter()
        .map(|(s, _)| *s)
        .chain(evals.keys().copied())
        .max()
        .unwrap_or(1)
        .max(1);
    let values = train
        .iter()
        .map(|(_, r)| *r)
        .chain(evals.values().flat_map(|(m, (lo, hi))| [*m, *lo, *hi]))
        .filter(|x| x.is_finite());
    let (low, high) = values.fold((0.0f64, 1.0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let tmp = png.with_extension("partial.png");
    {
        let root = BitMapBackend::new(&tmp, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Reward: {title}"), ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..last as f64, low..high)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("reward")
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| fail(&e))?;
        chart
            .draw_series(LineSeries::new(
                train
                    .iter()
                    .filter(|(_, r)| r.is_finite())
                    .map(|(s, r)| (*s as f64, *r)),
                BLUE.mix(0.5).stroke_width(1),
            ))
            .map_err(|e| fail(&e))?
            .label("rollout mean (sampled)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE));
        chart
            .draw_series(LineSeries::new(
                evals.iter().map(|(s, (m, _))| (*s as f64, *m)),
                RED.stroke_width(2),
            ))
            .map_err(|e| fail(&e))?
            .label("held-out mean (95% CI)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RED));
        chart
            .draw_series(evals.iter().map(|(s, (m, (lo, hi)))| {
                ErrorBar::new_vertical(*s as f64, *lo, *m, *hi, RED.stroke_width(2), 8)
            }))
            .map_err(|e| fail(&e))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
    }
    std::fs::rename(&tmp, png).map_err(|e| fail(&e))
}

/// Draws one value per step (`points`: step, value), e.g. distillation's mean reverse
/// KL to the teacher, to `png`.
pub fn step_curve(
    points: &[(usize, f64)],
    png: &Path,
    title: &str,
    y_desc: &str,
) -> Result<(), String> {
    if !agentstack_harness::compare::register_chart_font() {
        return Err("the embedded font does not load".into());
    }
    let fail = |e: &dyn std::fmt::Display| e.to_string();
    let points: Vec<(f64, f64)> = points
        .iter()
        .filter(|(_, v)| v.is_finite())
        .map(|(s, v)| (*s as f64, *v))
        .collect();
    let last = points.iter().map(|(s, _)| *s).fold(1.0f64, f64::max);
    let (low, high) = points
        .iter()
        .fold((0.0f64, f64::MIN_POSITIVE), |(lo, hi), (_, v)| {
            (lo.min(*v), hi.max(*v))
        });
    let tmp = png.with_extension("partial.png");
    {
        let root = BitMapBackend::new(&tmp, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..last, low..high * 1.05)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| fail(&e))?;
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                BLUE.stroke_width(2),
            ))
            .map_err(|e| fail(&e))?;
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, BLUE.filled())))
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
    }
    std::fs::rename(&tmp, png).map_err(|e| fail(&e))
}
