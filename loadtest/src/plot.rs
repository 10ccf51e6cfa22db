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

/// One line per target: (name, the target's index — its colour in every plot —, points).
type Series = Vec<(String, usize, Vec<(f64, f64)>)>;

/// The SLO drawn on a plot, in its axis units.
#[derive(Clone, Copy)]
enum SloLine {
    /// A vertical line at this x (TTFT on a CDF).
    X(f64),
    /// A horizontal line at this y (p95 TTFT against throughput).
    Y(f64),
}

/// What a plot shows besides its series.
struct Plot<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    marks: &'a [(usize, (f64, f64))],
    y_max: Option<f64>,
    slo: Option<SloLine>,
    /// Where the legend goes: a corner the curves of this kind of plot leave empty.
    legend: SeriesLabelPosition,
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plot: &Plot<'_>,
    series: &Series,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let (title, x_desc, y_desc, marks, y_max) =
        (plot.title, plot.x_desc, plot.y_desc, plot.marks, plot.y_max);
    root.fill(&WHITE).map_err(err)?;
    let xs = series.iter().flat_map(|s| s.2.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|s| s.2.iter().map(|p| p.1));
    let slo_x = match plot.slo {
        Some(SloLine::X(x)) => x,
        _ => 0.0,
    };
    let slo_y = match plot.slo {
        Some(SloLine::Y(y)) => y,
        _ => 0.0,
    };
    let x_max = xs.fold(slo_x, f64::max).max(1e-3) * 1.05;
    let y_top = y_max.unwrap_or_else(|| ys.fold(slo_y, f64::max).max(1e-3) * 1.1);
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
    if let Some(line) = plot.slo {
        let grey = RGBColor(120, 120, 120);
        let pts = match line {
            SloLine::X(x) => vec![(x, 0.0), (x, y_top)],
            SloLine::Y(y) => vec![(0.0, y), (x_max, y)],
        };
        chart
            .draw_series(LineSeries::new(pts, grey.stroke_width(1)))
            .map_err(err)?
            .label("SLO")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey));
    }
    for (name, i, pts) in series.iter() {
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
        .position(plot.legend.clone())
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

fn both(dir: &Path, stem: &str, plot: &Plot<'_>, series: &Series) -> Result<Vec<PathBuf>, String> {
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root = BitMapBackend::new(&png, (960, 600)).into_drawing_area();
        draw(&root, plot, series)?;
    }
    {
        let root = SVGBackend::new(&svg, (960, 600)).into_drawing_area();
        draw(&root, plot, series)?;
    }
    Ok(vec![png, svg])
}

/// Writes report.json, report.md and the plots into `dir`; returns the files written, and why
/// the plots were left out when they were (no font, say).
pub fn write_report(
    r: &CompareReport,
    dir: &Path,
) -> std::io::Result<(Vec<PathBuf>, Option<String>)> {
    std::fs::create_dir_all(dir)?;
    let mut files = Vec::new();
    let json = dir.join("report.json");
    std::fs::write(&json, serde_json::to_vec_pretty(r)?)?;
    files.push(json);
    let md = dir.join("report.md");
    std::fs::write(&md, r.markdown())?;
    files.push(md);
    match write_all(r, dir) {
        Ok(mut p) => {
            files.append(&mut p);
            Ok((files, None))
        }
        Err(e) => Ok((files, Some(e))),
    }
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
                let colour = r.targets.iter().position(|t| t == &run.target).unwrap_or(0);
                (run.target.clone(), colour, pts)
            })
            .collect();
        let title = format!("TTFT CDF at {rate:.2} requests/s ({})", r.workload);
        files.extend(both(
            dir,
            &format!("ttft_cdf_{rate:.2}rps"),
            &Plot {
                title: &title,
                x_desc: "TTFT (s)",
                y_desc: "fraction of requests",
                marks: &[],
                y_max: Some(1.0),
                slo: r.slo.ttft_s().map(SloLine::X),
                // CDFs rise to 1 early: the lower right stays empty.
                legend: SeriesLabelPosition::LowerRight,
            },
            &series,
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
        series.push((t.clone(), i, pts));
    }
    let title = format!(
        "Throughput vs p95 TTFT over the rate sweep ({}); circle = knee",
        r.workload
    );
    files.extend(both(
        dir,
        "throughput_latency",
        &Plot {
            title: &title,
            x_desc: "achieved requests/s",
            y_desc: "p95 TTFT (s)",
            marks: &marks,
            y_max: None,
            slo: r.slo.ttft_s().map(SloLine::Y),
            // Latency climbs with throughput: the upper left stays empty.
            legend: SeriesLabelPosition::UpperLeft,
        },
        &series,
    )?);
    Ok(files)
}
