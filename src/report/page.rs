//! The page every report shares: one HTML file with its style inline and its charts as inline
//! SVG, so it opens from disk, from a CI artifact or an e-mail attachment with nothing fetched
//! and no script run. maud escapes every value put into it.

use maud::{html, Markup, PreEscaped, DOCTYPE};

use super::plots::Svg;

/// The `generator` of every page: how a later run recognises a page it may overwrite.
pub(crate) const GENERATOR: &str = "spark-tool report";

const CSS: &str = "
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; margin: 0 auto;
  max-width: 1180px; padding: 16px 24px 48px; color: #1d1d1f; background: #fff; }
h1 { font-size: 1.5em; margin: 0.4em 0 0.1em; }
h2 { font-size: 1.2em; margin: 1.6em 0 0.5em; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #555; margin: 0 0 12px; overflow-wrap: anywhere; }
.verdict { padding: 12px 16px; border-radius: 6px; font-size: 1.15em; margin: 12px 0; }
.verdict.pass { background: #e3f4e8; border-left: 6px solid #1a7f37; }
.verdict.fail { background: #fde8e8; border-left: 6px solid #c62828; }
.verdict.ungated { background: #fff4d6; border-left: 6px solid #b26a00; }
.verdict ul { margin: 6px 0 0; font-size: 0.9em; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 0.9em; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e6e6e6; text-align: left; vertical-align: top; }
th { background: #f5f5f7; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.ok { color: #1a7f37; font-weight: 600; }
.bad { color: #c62828; font-weight: 600; }
figure { margin: 8px 0 16px; }
figure svg { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.85em; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 8px; }
.note { color: #555; font-size: 0.9em; }
footer { margin-top: 32px; color: #888; font-size: 0.8em; }
";

/// A whole page: `title`, a line under it, then `body`.
pub(crate) fn render(title: &str, subtitle: &str, body: Markup) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="generator" content=(GENERATOR);
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) }
                style { (PreEscaped(CSS)) }
            }
            body {
                h1 { (title) }
                p.sub { (subtitle) }
                (body)
                footer { "spark-tool " (env!("CARGO_PKG_VERSION")) }
            }
        }
    }
    .into_string()
}

/// The verdict banner: green with `headline` when `passed`, red with the reasons otherwise.
/// `class`: pass, fail or ungated.
pub(crate) fn verdict(class: &str, headline: &str, reasons: &[String]) -> Markup {
    html! {
        div class=(format!("verdict {class}")) {
            strong { (headline) }
            @if !reasons.is_empty() {
                ul { @for r in reasons { li { (r) } } }
            }
        }
    }
}

/// A table cell: text, right-aligned number, or a pass/fail mark.
pub(crate) enum Cell {
    Text(String),
    Num(String),
    Ok(bool),
    Html(Markup),
}

impl From<&str> for Cell {
    fn from(s: &str) -> Self {
        Cell::Text(s.to_string())
    }
}

impl From<String> for Cell {
    fn from(s: String) -> Self {
        Cell::Text(s)
    }
}

/// A table with a header row.
pub(crate) fn table(head: &[&str], rows: impl IntoIterator<Item = Vec<Cell>>) -> Markup {
    html! {
        table {
            thead { tr { @for h in head { th { (h) } } } }
            tbody {
                @for row in rows {
                    tr {
                        @for c in row {
                            @match c {
                                Cell::Text(s) => td { (s) },
                                Cell::Num(s) => td.num { (s) },
                                Cell::Ok(true) => td.ok { "ok" },
                                Cell::Ok(false) => td.bad { "fails" },
                                Cell::Html(m) => td { (m) },
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A chart with its caption.
pub(crate) fn figure(svg: &Svg, caption: &str) -> Markup {
    html! {
        figure {
            (svg)
            @if !caption.is_empty() { figcaption { (caption) } }
        }
    }
}

/// `v` in scientific notation with 2 decimals (KL, errors), or "–" when not a number.
pub(crate) fn sci(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v.is_infinite() {
        if v > 0.0 { "∞" } else { "-∞" }.into()
    } else {
        format!("{v:.2e}")
    }
}

/// `v` with `digits` decimals, or "–"/"∞" when not finite.
pub(crate) fn fixed(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        sci(v)
    }
}

/// A byte count in MB or GB.
pub(crate) fn bytes(b: u64) -> String {
    if b >= 1_000_000_000 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.1} MB", b as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped_and_the_page_is_self_contained() {
        let page = render(
            "t <b>",
            "x & y",
            table(
                &["a"],
                [vec![Cell::Text("<script>alert(1)</script>".into())]],
            ),
        );
        assert!(page.starts_with("<!DOCTYPE html>"));
        assert!(page.contains("&lt;script&gt;") && !page.contains("<script"));
        assert!(page.contains("t &lt;b&gt;") && page.contains("x &amp; y"));
        assert!(page.contains(GENERATOR));
    }

    #[test]
    fn numbers_that_are_not_finite_read_as_such() {
        assert_eq!(sci(f64::NAN), "–");
        assert_eq!(fixed(f64::INFINITY, 1), "∞");
        assert_eq!(fixed(2.346, 2), "2.35");
        assert_eq!(sci(0.000123), "1.23e-4");
        assert_eq!(bytes(5_571_072), "5.6 MB");
    }
}
