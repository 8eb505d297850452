//! How spark-tool writes what it produces, in one place.
//!
//! - A file appears atomically: written to a hidden sibling, fsynced, renamed ([`write_file`]).
//! - A folder (a quantized checkpoint, a phone export) is built in a staging folder and swapped in
//!   only when complete ([`Staging`]); an interrupted run leaves the destination as it was.
//! - A replace (`--force`) only ever removes a previous artifact of ours: every artifact folder
//!   carries [`MARKER`], which lists the entries we wrote, and a destination holding anything else
//!   is refused. Nothing is removed before the new artifact is in place.
//! - An output may not be, or contain, any of the command's inputs.
//! - A destination that is a mount point (`docker run -v host:/out`) cannot be renamed: the staging
//!   folder then lives inside it and the contents are swapped entry by entry.
//! - An interruption (Ctrl-C, SIGTERM, SIGHUP; [`exit_on_interrupt`]) removes what this process
//!   was writing, or keeps it with a note where it holds work to resume, and never cuts a replace
//!   short between its renames.

use std::collections::BTreeSet;
use std::io::{BufWriter, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::setting::Setting;

/// The file in every artifact folder that says it is ours and what we wrote.
pub const MARKER: &str = ".spark-tool-artifact.json";
/// The file that makes a folder a phone export (`phone::manifest`); here, below `checkpoint` and
/// `phone`, so that opening a checkpoint can refuse one without depending on the phone module.
pub const PHONE_MANIFEST: &str = "phone_manifest.json";

/// `dir` holds a phone export.
pub fn is_phone_export(dir: &Path) -> bool {
    dir.join(PHONE_MANIFEST).is_file()
}

/// The file in every staging folder that says we made it (so only ours are ever cleared).
const STAGING_MARKER: &str = ".spark-tool-staging";
/// Where a replace puts the previous artifact, inside the staging folder, until the new one is in.
const PREVIOUS: &str = "previous";
/// The staging folder's name inside a destination that is a mount point.
const INNER_STAGING: &str = ".spark-tool.partial";
/// The lock file of [`INNER_STAGING`] (see [`StagingLock`]).
const INNER_LOCK: &str = ".spark-tool.partial.lock";

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Refused(String),
}

pub fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ArtifactError + '_ {
    move |source| ArtifactError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What an interruption does with an output this process is writing.
#[derive(Clone, Debug, PartialEq)]
enum OnInterrupt {
    /// Nothing in it can be resumed: remove it.
    Remove,
    /// Keep it and print this note (what it holds, how to continue).
    Keep(String),
}

/// The outputs under construction, for [`exit_on_interrupt`]. Its lock also marks a commit's
/// renames, which an interruption waits for.
static IN_PROGRESS: Mutex<Vec<(PathBuf, OnInterrupt)>> = Mutex::new(Vec::new());

fn in_progress() -> MutexGuard<'static, Vec<(PathBuf, OnInterrupt)>> {
    IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner())
}

fn track(path: &Path, what: OnInterrupt) {
    let mut list = in_progress();
    match list.iter_mut().find(|(p, _)| p == path) {
        Some(entry) => entry.1 = what,
        None => list.push((path.to_path_buf(), what)),
    }
}

fn untrack_in(list: &mut Vec<(PathBuf, OnInterrupt)>, path: &Path) {
    list.retain(|(p, _)| p != path);
}

fn untrack(path: &Path) {
    untrack_in(&mut in_progress(), path);
}

/// Until dropped, an interruption removes `path` (a folder or file this process made and
/// removes itself when done, e.g. a temporary checkpoint).
#[must_use = "the path is tracked only while the guard lives"]
pub struct RemoveOnInterrupt(PathBuf);

pub fn remove_on_interrupt(path: &Path) -> RemoveOnInterrupt {
    track(path, OnInterrupt::Remove);
    RemoveOnInterrupt(path.to_path_buf())
}

impl Drop for RemoveOnInterrupt {
    fn drop(&mut self) {
        untrack(&self.0);
    }
}

/// End the process after an interruption by `signal` (Ctrl-C, SIGTERM, SIGHUP), with status
/// 128 + `signal`: every output under construction is removed, or kept with its note printed
/// where it holds work to resume (`quantize`'s finished layers). A commit in progress finishes
/// its renames first, so a replaced artifact is never left half-swapped; the destinations
/// themselves are never touched.
pub fn exit_on_interrupt(signal: i32) -> ! {
    let list = in_progress();
    eprintln!();
    for (path, what) in list.iter() {
        match what {
            OnInterrupt::Keep(note) => eprintln!("interrupted: {note}"),
            OnInterrupt::Remove => match remove_unfinished(path) {
                Ok(()) => eprintln!("interrupted: removed the unfinished {}", path.display()),
                Err(e) => eprintln!(
                    "interrupted: could not remove the unfinished {}: {e}",
                    path.display()
                ),
            },
        }
    }
    if list.is_empty() {
        eprintln!("interrupted");
    }
    std::process::exit(128 + signal)
}

/// End the process quietly because its stdout or stderr was closed (`spark-tool inspect | head -1`):
/// outputs under construction are handled as after an interruption, without a word (there may be
/// nowhere to say it), and the status is the shell's for a process that SIGPIPE ended, as `ls`'s is.
pub fn exit_on_closed_output() -> ! {
    for (path, what) in in_progress().iter() {
        if matches!(what, OnInterrupt::Remove) {
            let _ = remove_unfinished(path);
        }
    }
    std::process::exit(128 + libc::SIGPIPE)
}

/// Remove a staging folder or file that other threads may still be writing into (a file they
/// create during the walk makes one pass fail: try again).
fn remove_unfinished(path: &Path) -> std::io::Result<()> {
    let mut last = Ok(());
    for _ in 0..5 {
        last = match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => Err(e),
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
            Ok(_) => std::fs::remove_file(path),
        };
        if last.is_ok() {
            return Ok(());
        }
    }
    last
}

/// A progress bar for `len` steps, hidden unless `enabled`.
pub fn progress_bar(enabled: bool, len: u64, what: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{bar:30}} {{pos}}/{{len}} {{msg}} [{{elapsed}}<{{eta}}]"
        ))
        .expect("static template"),
    );
    b
}

/// Write `path` atomically: `fill` writes into a hidden sibling, which is fsynced and renamed
/// over `path`; on any error the sibling is removed and `path` is untouched.
pub fn write_file(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> Result<(), ArtifactError> {
    let name = path
        .file_name()
        .ok_or_else(|| ArtifactError::Refused(format!("{} is not a file path", path.display())))?;
    let tmp = path.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    track(&tmp, OnInterrupt::Remove);
    let result = (|| -> std::io::Result<()> {
        let mut w = BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp)?);
        fill(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        let list = in_progress();
        let renamed = std::fs::rename(&tmp, path);
        drop(list);
        renamed
    })();
    untrack(&tmp);
    result.map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        ArtifactError::Io {
            path: path.display().to_string(),
            source,
        }
    })
}

/// [`write_file`] of a value as pretty JSON with a final newline.
pub fn write_json(path: &Path, v: &impl Serialize) -> Result<(), ArtifactError> {
    let text = serde_json::to_string_pretty(v).expect("serializable");
    write_file(path, |w| w.write_all((text + "\n").as_bytes()))
}

#[derive(Debug, Serialize, Deserialize)]
struct Marker {
    generator: String,
    version: String,
    kind: String,
    /// Top-level entries of the folder that we wrote.
    entries: BTreeSet<String>,
}

/// The folder holding `path`: its parent, or `.` for a bare name (whose parent is "").
pub fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn canonical(p: &Path) -> Option<PathBuf> {
    p.canonicalize().ok()
}

/// Refuse an output that is, contains, or lies inside one of the inputs (a file or folder of
/// ours inside a user's model folder would change that folder).
pub fn check_not_input(out: &Path, inputs: &[&Path], flag: Setting) -> Result<(), ArtifactError> {
    // `out` may not exist yet: resolve its nearest existing ancestor and re-append the rest. A
    // symbolic link as the last component stays as it is: the write replaces the link, inside
    // the folder it sits in, not what it points to.
    let mut base = out.to_path_buf();
    let mut rest = Vec::new();
    if std::fs::symlink_metadata(out).is_ok_and(|m| m.file_type().is_symlink()) {
        if let Some(n) = out.file_name() {
            rest.push(n.to_os_string());
            base = folder_of(out).to_path_buf();
        }
    }
    let resolved = loop {
        if let Some(c) = canonical(&base) {
            break Some(c);
        }
        match (base.file_name(), base.parent()) {
            (Some(n), Some(_)) => {
                rest.push(n.to_os_string());
                base = folder_of(&base).to_path_buf();
            }
            _ => break None,
        }
    };
    let Some(mut out_c) = resolved else {
        return Ok(());
    };
    for n in rest.iter().rev() {
        out_c.push(n);
    }
    for input in inputs {
        let Some(in_c) = canonical(input) else {
            continue;
        };
        if in_c == out_c {
            return Err(ArtifactError::Refused(format!(
                "{flag} {} is the input {}; choose another output",
                out.display(),
                input.display()
            )));
        }
        if in_c.starts_with(&out_c) {
            return Err(ArtifactError::Refused(format!(
                "{flag} {} contains the input {}; choose an output outside it",
                out.display(),
                input.display()
            )));
        }
        if in_c.is_dir() && out_c.starts_with(&in_c) {
            return Err(ArtifactError::Refused(format!(
                "{flag} {} is inside the input {}; write it elsewhere",
                out.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// What a destination folder holds now.
enum Destination {
    Absent,
    /// Exists and holds nothing (besides our inner staging folder).
    Empty,
    /// A previous artifact of ours.
    Ours,
}

fn entries_of(dir: &Path) -> Result<BTreeSet<String>, ArtifactError> {
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let e = e.map_err(io_err(dir))?;
        out.insert(e.file_name().to_string_lossy().into_owned());
    }
    Ok(out)
}

fn read_marker(dir: &Path) -> Option<Marker> {
    let text = std::fs::read_to_string(dir.join(MARKER)).ok()?;
    serde_json::from_str(&text).ok()
}

fn inspect(out: &Path, kind: &str) -> Result<Destination, ArtifactError> {
    let meta = match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Destination::Absent),
        Err(e) => return Err(io_err(out)(e)),
        Ok(m) => m,
    };
    if meta.file_type().is_symlink() {
        // Replacing would act on the link, not on what it points to: never guess.
        return Err(ArtifactError::Refused(format!(
            "{} is a symbolic link; give the folder it points to, or another output",
            out.display()
        )));
    }
    if !meta.is_dir() {
        return Err(ArtifactError::Refused(format!(
            "{} exists and is not a folder; spark-tool only replaces a previous {kind} of its own",
            out.display()
        )));
    }
    let mut entries = entries_of(out)?;
    entries.remove(INNER_STAGING);
    entries.remove(INNER_LOCK);
    if entries.is_empty() {
        return Ok(Destination::Empty);
    }
    let Some(marker) = read_marker(out) else {
        return Err(ArtifactError::Refused(format!(
            "{} exists and is not a spark-tool artifact (no {MARKER}); it is never replaced, not even with {} — \
             choose another output or remove it yourself",
            out.display(),
            Setting::Force
        )));
    };
    if marker.kind != kind {
        return Err(ArtifactError::Refused(format!(
            "{} is a spark-tool {}, not a {kind}; not replacing it",
            out.display(),
            marker.kind
        )));
    }
    let foreign: Vec<&String> = entries
        .iter()
        .filter(|e| e.as_str() != MARKER && !marker.entries.contains(*e))
        .collect();
    if !foreign.is_empty() {
        return Err(ArtifactError::Refused(format!(
            "{} is a previous {kind} but also holds files spark-tool did not write ({}); \
             move them away or choose another output",
            out.display(),
            foreign
                .iter()
                .take(5)
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(Destination::Ours)
}

fn is_mount_point(dir: &Path) -> bool {
    let parent = dir
        .canonicalize()
        .ok()
        .and_then(|c| c.parent().map(Path::to_path_buf));
    match (std::fs::metadata(dir), parent.map(std::fs::metadata)) {
        (Ok(d), Some(Ok(p))) => d.dev() != p.dev(),
        _ => false,
    }
}

/// A folder artifact under construction (or a single-file one, [`Staging::plan_file`]).
pub struct Staging {
    out: PathBuf,
    root: PathBuf,
    kind: String,
    force: bool,
    /// For a file artifact: how to recognise a previous file of ours.
    file_is_ours: Option<fn(&Path) -> bool>,
    _lock: StagingLock,
}

/// An exclusive lock (flock) on a staging folder's name, held by the run that plans it until it
/// is done: two runs writing one output would otherwise clear each other's staging folder (the
/// second run's `reset` removes the first one's layers mid-run). The lock file sits beside the
/// staging folder and is removed with the lock; a killed run's file is taken over by the next.
struct StagingLock {
    path: PathBuf,
    _file: Option<std::fs::File>,
}

impl StagingLock {
    fn take(root: &Path, out: &Path) -> Result<Self, ArtifactError> {
        let mut name = root.file_name().unwrap_or_default().to_os_string();
        name.push(".lock");
        let path = root.with_file_name(name);
        let busy = || {
            ArtifactError::Refused(format!(
                "another spark-tool run is writing {} (it holds {}); wait for it to end or \
                 choose another {}",
                out.display(),
                path.display(),
                Setting::Out
            ))
        };
        // The file the path names when we hold its lock (a holder that is ending removes its
        // file: a lock on that unlinked file would lock nothing).
        let current = |f: &std::fs::File| match (std::fs::metadata(&path), f.metadata()) {
            (Ok(p), Ok(f)) => p.ino() == f.ino() && p.dev() == f.dev(),
            _ => false,
        };
        for _ in 0..50 {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io_err(&path))?;
            match file.try_lock() {
                Ok(()) if current(&file) => {
                    track(&path, OnInterrupt::Remove);
                    return Ok(StagingLock {
                        path,
                        _file: Some(file),
                    });
                }
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) if current(&file) => return Err(busy()),
                Err(std::fs::TryLockError::WouldBlock) => {}
                // A filesystem without flock (some network mounts): go on unlocked, as before.
                Err(std::fs::TryLockError::Error(e))
                    if e.kind() == std::io::ErrorKind::Unsupported =>
                {
                    return Ok(StagingLock { path, _file: None });
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(io_err(&path)(e)),
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Err(busy())
    }
}

impl Drop for StagingLock {
    fn drop(&mut self) {
        if self._file.is_some() {
            untrack(&self.path);
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Staging {
    /// Check that `out` may receive a `kind` artifact (absent, empty, or with `force` a previous
    /// one of ours) and is none of `inputs`; choose the staging folder. Creates nothing but
    /// `out`'s parent.
    pub fn plan(
        out: &Path,
        kind: &str,
        inputs: &[&Path],
        force: bool,
    ) -> Result<Self, ArtifactError> {
        check_not_input(out, inputs, Setting::Out)?;
        let name = out
            .file_name()
            .filter(|n| *n != "." && *n != "..")
            .ok_or_else(|| {
                ArtifactError::Refused(format!(
                    "{} {} has no folder name",
                    Setting::Out,
                    out.display()
                ))
            })?
            .to_string_lossy()
            .into_owned();
        // A file where a folder of the path should be: say which, not just "Not a directory".
        let parent = folder_of(out);
        if let Some(file) = parent
            .ancestors()
            .find(|a| a.exists())
            .filter(|a| !a.is_dir())
        {
            return Err(ArtifactError::Refused(format!(
                "{} {}: {} is a file, not a folder",
                Setting::Out,
                out.display(),
                file.display()
            )));
        }
        match inspect(out, kind)? {
            Destination::Ours if !force => {
                return Err(ArtifactError::Refused(format!(
                    "{} exists; pass {} to replace it (it is only replaced once the new {kind} is complete)",
                    out.display(),
                    Setting::Force
                )))
            }
            _ => {}
        }
        let parent = folder_of(out);
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        let inside = out.is_dir() && is_mount_point(out);
        // Refused now rather than when the first file is written, after the compute.
        let holder = if inside { out } else { parent };
        if !writable(holder) {
            return Err(ArtifactError::Refused(format!(
                "{} {}: {} is not writable",
                Setting::Out,
                out.display(),
                holder.display()
            )));
        }
        let root = if inside {
            out.join(INNER_STAGING)
        } else {
            parent.join(format!(".{name}.partial"))
        };
        Ok(Staging {
            _lock: StagingLock::take(&root, out)?,
            out: out.to_path_buf(),
            root,
            kind: kind.into(),
            force,
            file_is_ours: None,
        })
    }

    /// Like [`Staging::plan`] for an artifact that is one file: `out` may be absent, or with
    /// `force` a previous file of ours (`is_ours`); the staging folder is a hidden sibling.
    pub fn plan_file(
        out: &Path,
        kind: &str,
        inputs: &[&Path],
        force: bool,
        is_ours: fn(&Path) -> bool,
    ) -> Result<Self, ArtifactError> {
        check_output_file(out, inputs, Setting::Out, is_ours)?;
        if out.exists() && !force {
            return Err(ArtifactError::Refused(format!(
                "{} exists; pass {} to replace it (it is only replaced once the new {kind} is complete)",
                out.display(),
                Setting::Force
            )));
        }
        let parent = folder_of(out);
        let name = out
            .file_name()
            .expect("checked: a file path")
            .to_string_lossy();
        let root = parent.join(format!(".{name}.partial"));
        Ok(Staging {
            _lock: StagingLock::take(&root, out)?,
            out: out.to_path_buf(),
            root,
            kind: kind.into(),
            force,
            file_is_ours: Some(is_ours),
        })
    }

    /// Put the finished file `built` (inside the staging folder) at `out` by one rename, which
    /// replaces a previous file of ours atomically, then remove the staging folder.
    pub fn commit_file(&self, built: &Path) -> Result<(), ArtifactError> {
        let is_ours = self.file_is_ours.expect("commit_file on a file staging");
        // The destination may have changed while we worked: check it again.
        if self.out.exists() && (!self.force || !is_ours(&self.out)) {
            return Err(ArtifactError::Refused(format!(
                "{} appeared while working and is not a {} of ours to replace; not replacing it",
                self.out.display(),
                self.kind,
            )));
        }
        let mut list = in_progress();
        std::fs::rename(built, &self.out).map_err(io_err(&self.out))?;
        // Removed under the lock: an interruption never finds it half gone, marker first.
        let removed = std::fs::remove_dir_all(&self.root).map_err(io_err(&self.root));
        untrack_in(&mut list, &self.root);
        removed
    }

    /// On an interruption ([`exit_on_interrupt`]), keep the staging folder and print `note`
    /// (what it holds and how to continue) instead of removing it.
    pub fn keep_on_interrupt(&self, note: String) {
        track(&self.root, OnInterrupt::Keep(note));
    }

    /// The staging folder (holds the artifact being built and any resume state).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether a staging folder of ours is there (an interrupted run to resume).
    pub fn exists(&self) -> bool {
        self.root.join(STAGING_MARKER).is_file()
    }

    /// An empty staging folder: a previous one of ours is cleared; a folder of that name that is
    /// not ours is refused.
    pub fn reset(&self) -> Result<(), ArtifactError> {
        if self.root.exists() {
            // A kill between creating the folder and writing its marker leaves it empty: an
            // empty folder holds nothing of anyone's, so it is taken (remove_dir only removes
            // empty ones).
            if !self.exists() && std::fs::remove_dir(&self.root).is_ok() {
                return self.reset();
            }
            if !self.exists() {
                return Err(ArtifactError::Refused(format!(
                    "{} exists and was not made by spark-tool; remove it or choose another output",
                    self.root.display()
                )));
            }
            // Ours: from here an interruption finishes this removal rather than leave it half done.
            track(&self.root, OnInterrupt::Remove);
            std::fs::remove_dir_all(&self.root).map_err(io_err(&self.root))?;
        }
        track(&self.root, OnInterrupt::Remove);
        std::fs::create_dir_all(&self.root).map_err(io_err(&self.root))?;
        std::fs::write(self.root.join(STAGING_MARKER), b"").map_err(io_err(&self.root))
    }

    /// Remove the staging folder (after a failure: no half-written artifact stays behind),
    /// unless a failed replace left the previous artifact in it (its error says where).
    pub fn discard(&self) {
        if self.root.join(PREVIOUS).exists() {
            return;
        }
        untrack(&self.root);
        if self.exists() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    /// Put the finished artifact folder `built` (inside the staging folder) at `out`, replacing a
    /// previous artifact of ours only once the new one is complete, then remove the staging folder.
    pub fn commit(&self, built: &Path) -> Result<(), ArtifactError> {
        let mut entries = entries_of(built)?;
        entries.remove(MARKER);
        let marker = Marker {
            generator: "spark-tool".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            kind: self.kind.clone(),
            entries,
        };
        write_json(&built.join(MARKER), &marker)?;
        // An interruption waits for these renames (it never sees the previous artifact aside).
        let mut list = in_progress();
        // The destination may have changed while we worked: check it again.
        match inspect(&self.out, &self.kind)? {
            Destination::Absent => {
                std::fs::rename(built, &self.out).map_err(io_err(&self.out))?;
            }
            Destination::Ours if !self.force => {
                return Err(ArtifactError::Refused(format!(
                    "{} appeared while working; not replacing it",
                    self.out.display()
                )))
            }
            _ => {
                let aside = self.root.join(PREVIOUS);
                // Where a failure leaves the previous artifact aside, it is the user's to
                // recover: an interruption keeps it and says where.
                let keep_aside = |list: &mut Vec<(PathBuf, OnInterrupt)>| {
                    let note = format!(
                        "the previous {} of {} is kept in {}",
                        self.kind,
                        self.out.display(),
                        aside.display()
                    );
                    untrack_in(list, &self.root);
                    list.push((self.root.clone(), OnInterrupt::Keep(note)));
                };
                match std::fs::rename(&self.out, &aside) {
                    Ok(()) => {
                        if let Err(e) = std::fs::rename(built, &self.out) {
                            if std::fs::rename(&aside, &self.out).is_err() {
                                keep_aside(&mut list);
                                return Err(ArtifactError::Io {
                                    path: format!(
                                        "{} (the previous {} is kept in {})",
                                        self.out.display(),
                                        self.kind,
                                        aside.display()
                                    ),
                                    source: e,
                                });
                            }
                            return Err(io_err(&self.out)(e));
                        }
                    }
                    // A mount point (EBUSY) or a destination on another device (EXDEV):
                    // swap its contents instead of the folder itself.
                    Err(_) => {
                        if let Err(e) = swap_contents(&self.out, built, &aside) {
                            keep_aside(&mut list);
                            return Err(e);
                        }
                    }
                }
            }
        }
        // Removed under the lock: an interruption never finds it half gone, marker first.
        let removed = std::fs::remove_dir_all(&self.root).map_err(io_err(&self.root));
        untrack_in(&mut list, &self.root);
        removed
    }
}

impl Drop for Staging {
    /// A staging folder this value no longer works on is no longer this process's to clean up
    /// (a quantize failure may keep it for `--resume`).
    fn drop(&mut self) {
        untrack(&self.root);
    }
}

/// Move `out`'s entries into `aside` (the marker first, so `out` never claims to be complete
/// while mixed), then `built`'s entries into `out` (the marker last).
fn swap_contents(out: &Path, built: &Path, aside: &Path) -> Result<(), ArtifactError> {
    std::fs::create_dir_all(aside).map_err(io_err(aside))?;
    let mut old: Vec<String> = entries_of(out)?
        .into_iter()
        .filter(|e| e != INNER_STAGING && e != INNER_LOCK && e != MARKER)
        .collect();
    if out.join(MARKER).exists() {
        old.insert(0, MARKER.into());
    }
    for e in &old {
        std::fs::rename(out.join(e), aside.join(e)).map_err(io_err(&out.join(e)))?;
    }
    let mut new: Vec<String> = entries_of(built)?
        .into_iter()
        .filter(|e| e != MARKER)
        .collect();
    new.push(MARKER.into());
    for e in &new {
        std::fs::rename(built.join(e), out.join(e)).map_err(|source| ArtifactError::Io {
            path: format!(
                "{} (moving into {}; the previous contents are kept in {})",
                built.join(e).display(),
                out.display(),
                aside.display()
            ),
            source,
        })?;
    }
    Ok(())
}

/// Whether we may create files in `dir` (a read-only mount answers no even for root).
pub fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: a valid NUL-terminated path; access(2) only reads it.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// Refuse to write a single output file over anything but a previous output of ours: `is_ours`
/// recognises one. The file may not be, or lie inside, any of `inputs`.
pub fn check_output_file(
    path: &Path,
    inputs: &[&Path],
    flag: Setting,
    is_ours: impl FnOnce(&Path) -> bool,
) -> Result<(), ArtifactError> {
    check_not_input(path, inputs, flag)?;
    // The file is written at the very end: a folder that cannot receive it is refused now.
    let parent = folder_of(path);
    if !parent.is_dir() {
        return Err(ArtifactError::Refused(format!(
            "{flag} {}: the folder {} does not exist",
            path.display(),
            parent.display()
        )));
    }
    if !writable(parent) {
        return Err(ArtifactError::Refused(format!(
            "{flag} {}: the folder {} is not writable",
            path.display(),
            parent.display()
        )));
    }
    if path.is_dir() {
        return Err(ArtifactError::Refused(format!(
            "{flag} {} is a folder; give a file path",
            path.display()
        )));
    }
    if path.exists() && !is_ours(path) {
        return Err(ArtifactError::Refused(format!(
            "{flag} {} exists and is not a previous output of spark-tool; not overwriting it",
            path.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(st: &Staging, files: &[(&str, &str)]) -> PathBuf {
        st.reset().unwrap();
        let b = st.root().join("built");
        std::fs::create_dir_all(&b).unwrap();
        for (n, t) in files {
            std::fs::write(b.join(n), t).unwrap();
        }
        b
    }

    #[test]
    fn new_artifact_appears_with_its_marker_and_staging_is_gone() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("a");
        let st = Staging::plan(&out, "thing", &[], false).unwrap();
        let b = build(&st, &[("x", "1")]);
        st.commit(&b).unwrap();
        assert_eq!(std::fs::read_to_string(out.join("x")).unwrap(), "1");
        let m = read_marker(&out).unwrap();
        assert_eq!(m.entries, BTreeSet::from(["x".to_string()]));
        assert!(!st.root().exists());
    }

    #[test]
    fn replace_needs_force_and_only_replaces_ours() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("a");
        let st = Staging::plan(&out, "thing", &[], false).unwrap();
        let b = build(&st, &[("x", "1")]);
        st.commit(&b).unwrap();
        drop(st);
        let e = Staging::plan(&out, "thing", &[], false).err().unwrap();
        assert!(e.to_string().contains(&Setting::Force.to_string()), "{e}");
        let st = Staging::plan(&out, "thing", &[], true).unwrap();
        let b = build(&st, &[("y", "2")]);
        st.commit(&b).unwrap();
        assert!(!out.join("x").exists() && out.join("y").is_file());
        // A file of the user's inside our artifact: refused, and it survives.
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let e = Staging::plan(&out, "thing", &[], true).err().unwrap();
        assert!(e.to_string().contains("notes.txt"), "{e}");
        assert!(out.join("notes.txt").is_file());
        // Another kind of artifact of ours is not replaced either.
        std::fs::remove_file(out.join("notes.txt")).unwrap();
        let e = Staging::plan(&out, "other", &[], true).err().unwrap();
        assert!(e.to_string().contains("not a other"), "{e}");
    }

    #[test]
    fn one_run_at_a_time_writes_an_output() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("a");
        let first = Staging::plan(&out, "thing", &[], false).unwrap();
        first.reset().unwrap();
        // A second run planning the same output is refused at once, before it clears anything.
        let e = Staging::plan(&out, "thing", &[], true).err().unwrap();
        assert!(
            e.to_string().contains("another spark-tool run is writing"),
            "{e}"
        );
        assert!(first.exists(), "the first run's staging folder was cleared");
        let lock = d.path().join(".a.partial.lock");
        assert!(lock.is_file());
        // Once the first is done, its lock file goes and the output is free again.
        let b = build(&first, &[("x", "1")]);
        first.commit(&b).unwrap();
        drop(first);
        assert!(!lock.exists());
        let again = Staging::plan(&out, "thing", &[], true).unwrap();
        drop(again);
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "only the artifact is left"
        );
    }

    #[test]
    fn a_folder_that_is_not_ours_is_never_replaced() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("user");
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("data.bin"), "precious").unwrap();
        let e = Staging::plan(&out, "thing", &[], true).err().unwrap();
        assert!(e.to_string().contains("not a spark-tool artifact"), "{e}");
        assert!(out.join("data.bin").is_file());
        // A file in its place is refused too.
        let f = d.path().join("file");
        std::fs::write(&f, "x").unwrap();
        assert!(Staging::plan(&f, "thing", &[], true).is_err());
        // An empty folder is fine without --force: nothing to lose.
        let empty = d.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let st = Staging::plan(&empty, "thing", &[], false).unwrap();
        let b = build(&st, &[("x", "1")]);
        st.commit(&b).unwrap();
        assert!(empty.join("x").is_file());
    }

    #[test]
    fn outputs_may_not_be_or_contain_an_input() {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("models/m");
        std::fs::create_dir_all(&model).unwrap();
        for out in [
            model.clone(),
            d.path().join("models"),
            d.path().to_path_buf(),
        ] {
            let e = Staging::plan(&out, "thing", &[&model], true).err().unwrap();
            assert!(e.to_string().contains("input"), "{e}");
        }
        // Through a relative path with `..` too.
        let sneaky = model.join("../m");
        assert!(Staging::plan(&sneaky, "thing", &[&model], true).is_err());
        assert!(model.is_dir());
        // An artifact folder inside the model folder would change the user's folder: refused,
        // while a sibling is fine.
        let e = Staging::plan(&model.join("q"), "thing", &[&model], false)
            .err()
            .unwrap();
        assert!(e.to_string().contains("inside the input"), "{e}");
        assert!(!model.join("q").exists());
        Staging::plan(&d.path().join("models/q"), "thing", &[&model], false).unwrap();
        // A symbolic link as the destination is named as one (a replace would act on the link).
        let link = d.path().join("link");
        std::fs::create_dir(d.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &link).unwrap();
        let e = Staging::plan(&link, "thing", &[&model], true)
            .err()
            .unwrap();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // A file output that is a link inside the input folder would be replaced there: refused,
        // wherever the link points.
        let inside = model.join("r.json");
        std::os::unix::fs::symlink(d.path().join("elsewhere/r.json"), &inside).unwrap();
        let e = check_output_file(&inside, &[&model], Setting::Json, |_| true).unwrap_err();
        assert!(e.to_string().contains("inside the input"), "{e}");
        // A file inside an input, or over a file that is not ours, is refused.
        std::fs::write(model.join("model.safetensors"), "w").unwrap();
        let e = check_output_file(
            &model.join("model.safetensors"),
            &[&model],
            Setting::Out,
            |_| true,
        )
        .unwrap_err();
        assert!(e.to_string().contains("inside the input"), "{e}");
        let other = d.path().join("mine.bin");
        std::fs::write(&other, "x").unwrap();
        assert!(check_output_file(&other, &[&model], Setting::Out, |_| false).is_err());
        assert!(check_output_file(&other, &[&model], Setting::Out, |_| true).is_ok());
        assert!(
            check_output_file(&d.path().join("new.bin"), &[&model], Setting::Out, |_| {
                false
            })
            .is_ok()
        );
    }

    #[test]
    fn staging_folder_of_someone_else_is_not_cleared() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("a");
        let st = Staging::plan(&out, "thing", &[], false).unwrap();
        std::fs::create_dir_all(st.root()).unwrap();
        std::fs::write(st.root().join("theirs"), "x").unwrap();
        assert!(st.reset().is_err());
        st.discard();
        assert!(st.root().join("theirs").is_file());
    }

    /// A kill between creating the staging folder and writing its marker leaves it empty; the
    /// next run takes it (nothing in it to lose) and marks it.
    #[test]
    fn an_empty_unmarked_staging_folder_is_taken() {
        let d = tempfile::tempdir().unwrap();
        let st = Staging::plan(&d.path().join("a"), "thing", &[], false).unwrap();
        std::fs::create_dir_all(st.root()).unwrap();
        assert!(!st.exists());
        st.reset().unwrap();
        assert!(st.exists());
    }

    #[test]
    fn swap_contents_keeps_the_previous_until_the_new_is_in() {
        let d = tempfile::tempdir().unwrap();
        let (out, built, aside) = (d.path().join("o"), d.path().join("b"), d.path().join("p"));
        for (dir, f) in [(&out, "old"), (&built, "new")] {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(f), f).unwrap();
            std::fs::write(dir.join(MARKER), f).unwrap();
        }
        swap_contents(&out, &built, &aside).unwrap();
        assert!(out.join("new").is_file() && !out.join("old").exists());
        assert_eq!(std::fs::read_to_string(out.join(MARKER)).unwrap(), "new");
        assert!(aside.join("old").is_file());
    }

    #[test]
    fn write_file_is_all_or_nothing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.json");
        write_file(&p, |w| w.write_all(b"one")).unwrap();
        let e = write_file(&p, |w| {
            w.write_all(b"two")?;
            Err(std::io::Error::other("disk full"))
        });
        assert!(e.is_err());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "one");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
