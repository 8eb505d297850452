//! The charts of the reports, drawn by plotters into SVG strings that the pages inline.
//!
//! Each chart takes plain numbers (the page modules compute them from the reports, and their tests
//! check those numbers); nothing here knows about parity or quantization. Log axes are drawn as
//! log10 of the value on a linear axis with `1e-k` tick labels, so one code path serves both
//! scales and a zero (identical logits) lands on the axis floor instead of at -∞.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::ReportError;

/// An SVG document (`<svg …>…</svg>`), ready to inline.
pub(crate) struct Svg(pub String);

impl maud::Render for Svg {
    fn render_to(&self, buffer: &mut String) {
        // plotters escapes every text and attribute it writes.
        buffer.push_str(&self.0);
    }
}

/// Okabe–Ito: distinguishable with the common colour-vision deficiencies.
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(213, 94, 0),
    RGBColor(120, 120, 120),
];

pub(crate) fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

const FONT: &str = "sans-serif";

/// How values map onto the value axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Axis {
    /// From `min` to `max`; `None`: from 0 (or the smallest value when negative) to 10 % above
    /// the largest value.
    Linear(Option<(f64, f64)>),
    /// Decades; values at or below `floor` (and zeros) are drawn at `floor`.
    Log { floor: f64 },
}

impl Axis {
    /// Where `v` lies on the drawn axis (log10 for a log axis).
    pub(crate) fn place(self, v: f64) -> f64 {
        match self {
            Axis::Linear(_) => v,
            Axis::Log { floor } => v.max(floor).log10(),
        }
    }

    /// The drawn range holding every finite value of `values`.
    fn range(self, values: impl Iterator<Item = f64>) -> (f64, f64) {
        let placed: Vec<f64> = values
            .filter(|v| v.is_finite())
            .map(|v| self.place(v))
            .collect();
        let (lo, hi) = placed
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
                (a.min(*v), b.max(*v))
            });
        match self {
            Axis::Linear(Some(r)) => r,
            Axis::Linear(None) => {
                if !hi.is_finite() {
                    return (0.0, 1.0);
                }
                let lo = lo.min(0.0);
                let hi = if hi > lo {
                    hi + 0.1 * (hi - lo)
                } else {
                    lo + 1.0
                };
                (lo, hi)
            }
            Axis::Log { floor } => {
                let f = floor.log10();
                if !hi.is_finite() {
                    return (f, f + 1.0);
                }
                let (lo, hi) = (lo.max(f).floor(), hi.ceil());
                (lo, if hi > lo { hi } else { lo + 1.0 })
            }
        }
    }

    fn label(self, v: f64) -> String {
        match self {
            Axis::Linear(_) => {
                let a = v.abs();
                if a != 0.0 && !(1e-2..1e5).contains(&a) {
                    format!("{v:.0e}")
                } else {
                    // Trim the float noise of tick positions (0.30000000000000004).
                    let s = format!("{v:.3}");
                    s.trim_end_matches('0').trim_end_matches('.').to_string()
                }
            }
            // Only whole decades are labelled; in-between ticks stay blank.
            Axis::Log { .. } if (v - v.round()).abs() < 1e-9 => format!("1e{}", v.round()),
            Axis::Log { .. } => String::new(),
        }
    }
}

fn plot_err(title: &str) -> impl Fn(String) -> ReportError + '_ {
    move |message| ReportError::Plot {
        plot: title.to_string(),
        message,
    }
}

/// Draw into a fresh SVG string of `size` pixels.
fn draw(
    title: &str,
    size: (u32, u32),
    f: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<(), String>,
) -> Result<Svg, ReportError> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE)
            .map_err(|e| plot_err(title)(e.to_string()))?;
        f(&root).map_err(plot_err(title))?;
        root.present().map_err(|e| plot_err(title)(e.to_string()))?;
    }
    Ok(Svg(out))
}

/// One line of a line chart.
pub(crate) struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// A vertical rule across a line chart (where the prompt ends, where greedy diverges).
pub(crate) struct Marker {
    pub label: String,
    pub x: f64,
}

pub(crate) struct LineChart<'a> {
    pub title: &'a str,
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub y: Axis,
    pub lines: &'a [Line],
    pub markers: &'a [Marker],
    pub size: (u32, u32),
}

pub(crate) fn line_chart(c: &LineChart) -> Result<Svg, ReportError> {
    let xs = c.lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let (x0, x1) = Axis::Linear(None).range(xs.chain(c.markers.iter().map(|m| m.x)));
    let (y0, y1) =
        c.y.range(c.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)));
    draw(c.title, c.size, |root| {
        let e = |e: plotters::drawing::DrawingAreaErrorKind<_>| e.to_string();
        let mut chart = ChartBuilder::on(root)
            .caption(c.title, (FONT, 15))
            .margin(8)
            .x_label_area_size(34)
            .y_label_area_size(52)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(e)?;
        let y_axis = c.y;
        let y_fmt = move |v: &f64| y_axis.label(*v);
        chart
            .configure_mesh()
            .x_desc(c.x_desc)
            .y_desc(c.y_desc)
            .y_label_formatter(&y_fmt)
            .x_label_formatter(&|v| Axis::Linear(None).label(*v))
            .label_style((FONT, 11))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(e)?;
        for (i, l) in c.lines.iter().enumerate() {
            let col = color(i);
            let pts = l
                .points
                .iter()
                .filter(|p| p.1.is_finite())
                .map(|&(x, y)| (x, c.y.place(y)));
            chart
                .draw_series(LineSeries::new(pts, col.stroke_width(1)))
                .map_err(e)?
                .label(l.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], col));
        }
        for (i, m) in c.markers.iter().enumerate() {
            let col = color(c.lines.len() + i);
            chart
                .draw_series(LineSeries::new([(m.x, y0), (m.x, y1)], col.stroke_width(2)))
                .map_err(e)?
                .label(m.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], col));
        }
        if c.lines.len() + c.markers.len() > 1 {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font((FONT, 11))
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(180, 180, 180))
                .draw()
                .map_err(e)?;
        }
        Ok(())
    })
}

/// One bar: its value and, optionally, a min–max whisker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bar {
    pub value: f64,
    pub range: Option<(f64, f64)>,
}

impl From<f64> for Bar {
    fn from(value: f64) -> Self {
        Bar { value, range: None }
    }
}

/// One series of a grouped bar chart: a value (or none) per category.
pub(crate) struct Bars {
    pub label: String,
    pub values: Vec<Option<Bar>>,
}

pub(crate) struct BarChart<'a> {
    pub title: &'a str,
    pub value_desc: &'a str,
    pub axis: Axis,
    pub categories: &'a [String],
    pub series: &'a [Bars],
    /// Categories down the left (long names, e.g. prompts) instead of along the bottom.
    pub horizontal: bool,
    /// Width in pixels; the height follows from the categories when horizontal.
    pub width: u32,
}

/// Pixels per category row of a horizontal chart, per series.
const ROW_PX: u32 = 9;

pub(crate) fn bar_chart(c: &BarChart) -> Result<Svg, ReportError> {
    let n = c.categories.len().max(1) as f64;
    let groups = c.series.len().max(1);
    let values = c.series.iter().flat_map(|s| {
        s.values.iter().flatten().flat_map(|b| {
            let (lo, hi) = b.range.unwrap_or((b.value, b.value));
            [b.value, lo, hi]
        })
    });
    let (v0, v1) = c.axis.range(values);
    // Category labels are drawn by hand (plotters places ticks at round numbers, not at the
    // category centres): room for the longest, at ~6.5 px per character of an 11 px font.
    let longest = c
        .categories
        .iter()
        .map(|s| s.chars().count())
        .max()
        .unwrap_or(0) as u32;
    let legend = if c.series.len() > 1 { 22 } else { 0 };
    let (size, cat_area) = if c.horizontal {
        // A row stays tall enough for its label when there are few series.
        let row = (ROW_PX * groups as u32 + 6).max(22);
        let h = 60 + legend + c.categories.len().max(1) as u32 * row;
        ((c.width, h), (longest * 13 / 2 + 10).clamp(30, 320))
    } else {
        ((c.width, 300 + legend), 30)
    };
    draw(c.title, size, |root| {
        let e = |e: plotters::drawing::DrawingAreaErrorKind<_>| e.to_string();
        let (root, legend_area) = root.split_vertically(size.1 - legend);
        let mut b = ChartBuilder::on(&root);
        b.caption(c.title, (FONT, 15)).margin(8);
        let axis = c.axis;
        let v_fmt = move |v: &f64| axis.label(*v);
        let blank = |_: &f64| String::new();
        // Bar `g` of category `i` spans [lo, hi] along the category axis (category 0 first).
        let slot = |i: usize, g: usize| {
            let w = 0.8 / groups as f64;
            let lo = i as f64 + 0.1 + g as f64 * w;
            (lo, lo + w)
        };
        let label_style = TextStyle::from((FONT, 11).into_font());
        // The first category at the top of a horizontal chart, at the left of a vertical one.
        let cat_at = |i: usize| {
            if c.horizontal {
                c.categories.len().max(1) - 1 - i
            } else {
                i
            }
        };
        // (category-axis, value-axis) → chart coordinates.
        let pt = |cat: f64, val: f64| if c.horizontal { (val, cat) } else { (cat, val) };
        let mut chart = if c.horizontal {
            b.x_label_area_size(30).y_label_area_size(cat_area);
            let mut chart = b.build_cartesian_2d(v0..v1, 0.0..n).map_err(e)?;
            chart
                .configure_mesh()
                .x_desc(c.value_desc)
                .x_label_formatter(&v_fmt)
                .y_label_formatter(&blank)
                .disable_y_mesh()
                .label_style((FONT, 11))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()
                .map_err(e)?;
            chart
        } else {
            b.x_label_area_size(cat_area).y_label_area_size(56);
            let mut chart = b.build_cartesian_2d(0.0..n, v0..v1).map_err(e)?;
            chart
                .configure_mesh()
                .y_desc(c.value_desc)
                .y_label_formatter(&v_fmt)
                .x_label_formatter(&blank)
                .disable_x_mesh()
                .label_style((FONT, 11))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()
                .map_err(e)?;
            chart
        };
        for (g, s) in c.series.iter().enumerate() {
            let col = color(g);
            // Read top-down, a horizontal chart lists the series in legend order too.
            let slot_g = if c.horizontal { groups - 1 - g } else { g };
            for (i, bar) in s.values.iter().enumerate() {
                let Some(bar) = bar else { continue };
                let (lo, hi) = slot(cat_at(i), slot_g);
                let v = axis.place(bar.value);
                chart
                    .draw_series([Rectangle::new([pt(lo, v0), pt(hi, v)], col.filled())])
                    .map_err(e)?;
                if let Some((a, z)) = bar.range {
                    let mid = (lo + hi) / 2.0;
                    let (a, z) = (axis.place(a), axis.place(z));
                    chart
                        .draw_series([PathElement::new(vec![pt(mid, a), pt(mid, z)], BLACK)])
                        .map_err(e)?;
                }
            }
        }
        if c.horizontal {
            let style = label_style.pos(Pos::new(HPos::Right, VPos::Center));
            for (i, name) in c.categories.iter().enumerate() {
                let (x, y) = chart.backend_coord(&(v0, cat_at(i) as f64 + 0.5));
                root.draw(&Text::new(name.as_str(), (x - 5, y), &style))
                    .map_err(e)?;
            }
        } else {
            // Vertical charts hold short labels (layer numbers, metric names); every label is
            // drawn unless they would overlap, then every k-th.
            let px_per_cat = (size.0 as f64 - 80.0) / n;
            let need = (longest as f64 * 6.5 + 4.0).max(1.0);
            let every = (need / px_per_cat).ceil().max(1.0) as usize;
            let style = label_style.pos(Pos::new(HPos::Center, VPos::Top));
            for (i, name) in c.categories.iter().enumerate().step_by(every) {
                let (x, y) = chart.backend_coord(&(i as f64 + 0.5, v0));
                root.draw(&Text::new(name.as_str(), (x, y + 6), &style))
                    .map_err(e)?;
            }
        }
        if c.series.len() > 1 {
            // The legend is a row under the chart: plotters' in-chart box would hide bars.
            let mut x = 60;
            for (g, s) in c.series.iter().enumerate() {
                legend_area
                    .draw(&Rectangle::new([(x, 6), (x + 12, 16)], color(g).filled()))
                    .map_err(e)?;
                legend_area
                    .draw(&Text::new(
                        s.label.as_str(),
                        (x + 16, 11),
                        label_style.pos(Pos::new(HPos::Left, VPos::Center)),
                    ))
                    .map_err(e)?;
                x += 30 + (s.label.chars().count() as i32 * 13 / 2);
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_axis_puts_zeros_on_the_floor_and_spans_whole_decades() {
        let a = Axis::Log { floor: 1e-8 };
        assert_eq!(a.place(0.0), -8.0);
        assert!((a.place(1e-3) + 3.0).abs() < 1e-12);
        assert_eq!(a.range([2e-5, 3e-2, 0.0].into_iter()), (-8.0, -1.0));
        assert_eq!(a.range([2e-5, 3e-2].into_iter()), (-5.0, -1.0));
        assert_eq!(a.label(-3.0), "1e-3");
        assert_eq!(a.label(-2.5), "");
    }

    #[test]
    fn bar_chart_draws_one_rect_per_bar_and_every_label() {
        let cats: Vec<String> = ["a<b", "c"].iter().map(|s| s.to_string()).collect();
        let series = [
            Bars {
                label: "one".into(),
                values: vec![Some(0.5.into()), None],
            },
            Bars {
                label: "two".into(),
                values: vec![Some(0.25.into()), Some(1.0.into())],
            },
        ];
        for horizontal in [false, true] {
            let svg = bar_chart(&BarChart {
                title: "t",
                value_desc: "v",
                axis: Axis::Linear(Some((0.0, 1.0))),
                categories: &cats,
                series: &series,
                horizontal,
                width: 600,
            })
            .unwrap()
            .0;
            assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
            // The name is escaped, never raw markup.
            assert!(svg.contains("a&lt;b") && !svg.contains("a<b"));
            // Background + plot-area rects, three bars, two legend swatches.
            let filled_bars = svg.matches("<rect").count();
            let empty = bar_chart(&BarChart {
                title: "t",
                value_desc: "v",
                axis: Axis::Linear(Some((0.0, 1.0))),
                categories: &cats,
                series: &[
                    Bars {
                        label: "one".into(),
                        values: vec![None, None],
                    },
                    Bars {
                        label: "two".into(),
                        values: vec![None, None],
                    },
                ],
                horizontal,
                width: 600,
            })
            .unwrap()
            .0
            .matches("<rect")
            .count();
            assert_eq!(filled_bars - empty, 3, "horizontal {horizontal}");
        }
    }
}
