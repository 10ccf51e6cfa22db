//! Plots of a compare report, each as PNG and SVG: the TTFT CDF per target at every rate, and
//! the throughput–latency curve (achieved requests/s against p95 TTFT) per target over the rate
//! sweep, the knee circled. Text needs a TrueType font: `KVGATE_FONT`, or DejaVu Sans /
//! Liberation Sans where distributions put them (Debian: `fonts-dejavu-core`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::compare::CompareReport;

const FONT_PATHS: [&str; 6] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
];

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// Registers the first font found, once.
fn font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let mut candidates: Vec<String> = std::env::var("KVGATE_FONT").into_iter().collect();
        candidates.extend(FONT_PATHS.iter().map(|s| s.to_string()));
        for c in &candidates {
            if let Ok(bytes) = std::fs::read(c) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(format!(
            "no TrueType font found for plot text (tried {candidates:?}); install fonts-dejavu-core or set KVGATE_FONT"
        ))
    })
    .clone()
}

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("{e:?}")
}

/// One line per target: (name, points).
type Series = Vec<(String, Vec<(f64, f64)>)>;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &Series,
    marks: &[(usize, (f64, f64))],
    y_max: Option<f64>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let xs = series.iter().flat_map(|s| s.1.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|s| s.1.iter().map(|p| p.1));
    let x_max = xs.fold(0.0f64, f64::max).max(1e-3) * 1.05;
    let y_top = y_max.unwrap_or_else(|| ys.fold(0.0f64, f64::max).max(1e-3) * 1.1);
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..y_top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        if pts.len() <= 32 {
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 3, c.filled())))
                .map_err(err)?;
        }
    }
    for &(i, p) in marks {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series([Circle::new(p, 9, c.stroke_width(2))])
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

#[allow(clippy::too_many_arguments)]
fn both(
    dir: &Path,
    stem: &str,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &Series,
    marks: &[(usize, (f64, f64))],
    y_max: Option<f64>,
) -> Result<Vec<PathBuf>, String> {
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root = BitMapBackend::new(&png, (960, 600)).into_drawing_area();
        draw(&root, title, x_desc, y_desc, series, marks, y_max)?;
    }
    {
        let root = SVGBackend::new(&svg, (960, 600)).into_drawing_area();
        draw(&root, title, x_desc, y_desc, series, marks, y_max)?;
    }
    Ok(vec![png, svg])
}

/// Writes every plot of `r` into `dir`.
pub fn write_all(r: &CompareReport, dir: &Path) -> Result<Vec<PathBuf>, String> {
    font()?;
    let mut files = Vec::new();
    for &rate in &r.rates {
        let series: Series = r
            .runs
            .iter()
            .zip(&r.ttft_samples_s)
            .filter(|(run, _)| run.rate == rate)
            .map(|(run, t)| {
                let mut v = t.clone();
                v.sort_by(f64::total_cmp);
                let n = v.len() as f64;
                let pts = v
                    .iter()
                    .enumerate()
                    .map(|(i, x)| (*x, (i + 1) as f64 / n))
                    .collect();
                (run.target.clone(), pts)
            })
            .collect();
        files.extend(both(
            dir,
            &format!("ttft_cdf_{rate:.2}rps"),
            &format!("TTFT CDF at {rate:.2} requests/s ({})", r.workload),
            "TTFT (s)",
            "fraction of requests",
            &series,
            &[],
            Some(1.0),
        )?);
    }
    let mut series: Series = Vec::new();
    let mut marks = Vec::new();
    for (i, t) in r.targets.iter().enumerate() {
        let mut runs: Vec<_> = r.runs.iter().filter(|x| &x.target == t).collect();
        runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        let pts: Vec<(f64, f64)> = runs
            .iter()
            .filter_map(|x| x.ttft_s.as_ref().map(|s| (x.requests_per_s, s.p95)))
            .collect();
        let knee = r.knees.iter().find(|k| &k.target == t).and_then(|k| k.rate);
        if let Some(k) = knee {
            if let Some(x) = runs.iter().find(|x| x.rate == k) {
                if let Some(s) = &x.ttft_s {
                    marks.push((i, (x.requests_per_s, s.p95)));
                }
            }
        }
        series.push((t.clone(), pts));
    }
    files.extend(both(
        dir,
        "throughput_latency",
        &format!(
            "Throughput vs p95 TTFT over the rate sweep ({}); circle = knee",
            r.workload
        ),
        "achieved requests/s",
        "p95 TTFT (s)",
        &series,
        &marks,
        None,
    )?);
    Ok(files)
}
