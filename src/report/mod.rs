//! Reports a person reads at a glance: a parity, quantize or bench result as one self-contained
//! HTML page (inline CSS and SVG charts, no script, nothing fetched) and, for a CI step summary,
//! parity as Markdown. Each page is drawn from the same values the command's JSON holds.
//!
//! Outputs follow the rules of `--json` (`crate::artifact`): written atomically, never over a
//! file that is not a previous report of ours, never over or inside an input.

pub mod bench;
mod page;
pub mod parity;
mod plots;
pub mod quantize;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::artifact::{self, ArtifactError};
use crate::setting::Setting;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file the report reads (a `--baseline`, a `--llamacpp-json`) is not what it should be.
    #[error("{path}: {message}")]
    Input { path: String, message: String },
    #[error("drawing the chart \"{plot}\": {message}")]
    Plot { plot: String, message: String },
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
}

/// The first line of every Markdown summary: how a later run recognises one it may overwrite
/// (an HTML comment, so a CI step summary does not show it).
pub(crate) const MARKDOWN_MARK: &str = "<!-- spark-tool report -->";

/// Whether `path` is a page this module wrote: its head names our generator.
pub fn is_our_html(path: &Path) -> bool {
    let mut head = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(4096).read_to_end(&mut head))
        .is_ok()
        && String::from_utf8_lossy(&head).contains(&format!(
            "<meta name=\"generator\" content=\"{}\">",
            page::GENERATOR
        ))
}

/// Whether `path` is a Markdown summary this module wrote, or empty: a CI system creates the step
/// summary file empty before the step runs, and an empty file holds nothing to lose.
pub fn is_our_markdown(path: &Path) -> bool {
    let mut head = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MARKDOWN_MARK.len() as u64).read_to_end(&mut head))
        .is_ok()
        && (head.is_empty() || head == MARKDOWN_MARK.as_bytes())
}

/// Refuse an `--html` path before any work: see [`artifact::check_output_file`].
pub fn check_html_path(path: &Path, inputs: &[&Path]) -> Result<(), ArtifactError> {
    artifact::check_output_file(path, inputs, Setting::Html, is_our_html)
}

/// Refuse a `--markdown` path before any work: see [`artifact::check_output_file`].
pub fn check_markdown_path(path: &Path, inputs: &[&Path]) -> Result<(), ArtifactError> {
    artifact::check_output_file(path, inputs, Setting::Markdown, is_our_markdown)
}

/// The file a path names, with its folder resolved (`a/../r.html` and `r.html` are one file).
fn resolved(p: &Path) -> PathBuf {
    let dir = crate::artifact::folder_of(p);
    match (dir.canonicalize(), p.file_name()) {
        (Ok(d), Some(n)) => d.join(n),
        _ => p.to_path_buf(),
    }
}

/// Refuse two outputs of one command that name the same file: the later would replace the earlier.
pub fn check_distinct(outputs: &[(Setting, &Path)]) -> Result<(), ArtifactError> {
    for (i, (fa, a)) in outputs.iter().enumerate() {
        for (fb, b) in &outputs[i + 1..] {
            if resolved(a) == resolved(b) {
                return Err(ArtifactError::Refused(format!(
                    "{fa} and {fb} both name {}; give each its own file",
                    a.display()
                )));
            }
        }
    }
    Ok(())
}

/// A JSON file another run wrote; the error names the file and `expected` (what it should hold).
fn read_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    expected: &str,
) -> Result<T, ReportError> {
    let bad = |message: String| ReportError::Input {
        path: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("expected {expected}: {e}")))
}

/// Write `text` to `path` atomically.
fn write_text(path: &Path, text: &str) -> Result<(), ReportError> {
    Ok(artifact::write_file(path, |w| {
        w.write_all(text.as_bytes())
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_reports_or_an_empty_summary_are_overwritten() {
        let d = tempfile::tempdir().unwrap();
        let html = d.path().join("r.html");
        std::fs::write(&html, "<html><body>someone's page</body></html>").unwrap();
        let e = check_html_path(&html, &[]).unwrap_err().to_string();
        assert!(e.contains("not a previous output"), "{e}");
        write_text(&html, &page::render("t", "s", maud::html! {})).unwrap();
        assert!(check_html_path(&html, &[]).is_ok());

        let md = d.path().join("s.md");
        std::fs::write(&md, "# my notes\n").unwrap();
        assert!(check_markdown_path(&md, &[]).is_err());
        std::fs::write(&md, "").unwrap();
        assert!(check_markdown_path(&md, &[]).is_ok());
        std::fs::write(&md, format!("{MARKDOWN_MARK}\n**PASS**\n")).unwrap();
        assert!(check_markdown_path(&md, &[]).is_ok());
        // A page of ours is not a summary of ours, nor the reverse.
        assert!(check_markdown_path(&html, &[]).is_err());
        assert!(check_html_path(&md, &[]).is_err());
    }

    #[test]
    fn two_outputs_naming_one_file_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("r.html");
        let b = d.path().join("sub/../r.html");
        std::fs::create_dir_all(d.path().join("sub")).unwrap();
        let e = check_distinct(&[(Setting::Json, &a), (Setting::Html, &b)]).unwrap_err();
        assert!(e.to_string().contains("both name"), "{e}");
        let c = d.path().join("r.md");
        assert!(check_distinct(&[(Setting::Json, &a), (Setting::Markdown, &c)]).is_ok());
    }
}
