//! Data compiled into the binary, so an installed spark-tool needs no checkout: the default
//! calibration set and parity's prompts and held-out text (2 MB in all, calibration/README.md).
//! Each is named by a pseudo-path `bundled:NAME`, which is what reports and provenance record
//! (with the bytes' sha256) instead of a path on the machine that built the binary.

use std::path::{Path, PathBuf};

const PREFIX: &str = "bundled:";

const FILES: [(&str, &[u8]); 3] = [
    (
        "spark-calib.jsonl",
        include_bytes!("../calibration/spark-calib.jsonl"),
    ),
    (
        "parity_prompts.json",
        include_bytes!("../calibration/parity_prompts.json"),
    ),
    (
        "heldout.jsonl",
        include_bytes!("../calibration/heldout.jsonl"),
    ),
];

/// The pseudo-path of bundled file `name` (one of the files above).
pub fn path(name: &str) -> PathBuf {
    debug_assert!(FILES.iter().any(|f| f.0 == name), "{name} is not bundled");
    PathBuf::from(format!("{PREFIX}{name}"))
}

/// The bytes of a bundled pseudo-path; `None` for any other path.
pub fn bytes(path: &Path) -> Option<&'static [u8]> {
    let name = path.to_str()?.strip_prefix(PREFIX)?;
    FILES.iter().find(|f| f.0 == name).map(|f| f.1)
}

/// The bytes at `path`: the bundled data for a pseudo-path, else the file's.
pub fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    match bytes(path) {
        Some(b) => Ok(b.to_vec()),
        None => std::fs::read(path),
    }
}

/// The text at `path`, as [`read`].
pub fn read_to_string(path: &Path) -> std::io::Result<String> {
    match bytes(path) {
        Some(b) => String::from_utf8(b.to_vec())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        None => std::fs::read_to_string(path),
    }
}

/// How an input file is recorded in an artifact: a bundled pseudo-path as it is, a user's file by
/// its name alone (with its sha256 beside it, where it is recorded), never a folder of the
/// machine that ran the command.
pub fn record_name(path: &Path) -> String {
    if bytes(path).is_some() {
        return path.display().to_string();
    }
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_names_read_the_embedded_bytes_and_others_read_files() {
        let p = path("parity_prompts.json");
        assert_eq!(p.to_str(), Some("bundled:parity_prompts.json"));
        let text = read_to_string(&p).unwrap();
        assert!(text.contains("\"prompts\""));
        assert!(bytes(Path::new("bundled:nosuch")).is_none());
        assert!(read(Path::new("bundled:nosuch")).is_err());
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("c.jsonl");
        std::fs::write(&f, "{\"text\": \"x\"}\n").unwrap();
        assert_eq!(read(&f).unwrap(), b"{\"text\": \"x\"}\n");
        assert_eq!(record_name(&f), "c.jsonl");
        assert_eq!(record_name(&p), "bundled:parity_prompts.json");
    }
}
