//! Faults around the malformed-input corpus (tests/malformed.rs): weights changed in place under
//! a resumable run, SIGKILL at several points, a full disk, read-only locations and a mount point
//! as `--out`. Mounting needs root; without it the mount tests print that they were skipped, and
//! `SPARK_REQUIRE_MOUNT=1` (set by tools/test.sh when it has root) makes a skip a failure.
//!
//! Every input is a copy of the fixture.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use spark_tool::checkpoint::TensorStore;
use spark_tool::device::WeightFormat;
use spark_tool::quantize::{quantize, QuantizeError};

fn copy_fixture(to: &Path) -> PathBuf {
    let dst = to.join("model");
    common::copy_dir(&common::fixture("spark-tiny"), &dst);
    dst
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn spark(args: &[&std::ffi::OsStr]) -> Output {
    common::tool()
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

fn quantize_args<'a>(model: &'a Path, out: &'a Path) -> Vec<&'a std::ffi::OsStr> {
    let mut v: Vec<&std::ffi::OsStr> = vec!["quantize".as_ref(), model.as_os_str()];
    v.extend(["--out".as_ref(), out.as_os_str()]);
    for a in [
        "--format",
        "w4a16",
        "--samples",
        "8",
        "--seq-len",
        "64",
        "--no-compare",
        "--quiet",
    ] {
        v.push(a.as_ref());
    }
    v
}

#[test]
fn resume_refuses_weights_changed_in_place_at_the_same_size() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    let out = d.path().join("q");
    let mut o = common::quantize_options(&model, &out, WeightFormat::W4A16, 64);
    (o.recipe.samples, o.recipe.seq_len, o.compare) = (4, 64, false);
    o.stop_after_layers = Some(2);
    assert!(matches!(quantize(&o), Err(QuantizeError::Interrupted(2))));

    // Rewrite one weight of a layer not yet quantized, in place: same size, same names.
    let st = model.join("model.safetensors");
    let (start, len) = {
        let store = TensorStore::open_file(&st).unwrap();
        let e = store
            .get("model.layers.5.mlp.up_proj.weight")
            .expect("tensor");
        (e.start, e.end - e.start)
    };
    let before_len = std::fs::metadata(&st).unwrap().len();
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&st).unwrap();
        f.seek(SeekFrom::Start((start + len / 2) as u64)).unwrap();
        f.write_all(&0x3f80u16.to_le_bytes()).unwrap();
    }
    assert_eq!(std::fs::metadata(&st).unwrap().len(), before_len);

    o.stop_after_layers = None;
    o.resume = true;
    let e = quantize(&o).unwrap_err().to_string();
    assert!(e.contains("different model"), "{e}");
    // Starting over gives exactly what a fresh run on the changed weights gives.
    o.resume = false;
    quantize(&o).unwrap();
    let fresh_dir = d.path().join("fresh");
    let mut f = common::quantize_options(&model, &fresh_dir, WeightFormat::W4A16, 64);
    (f.recipe.samples, f.recipe.seq_len, f.compare) = (4, 64, false);
    quantize(&f).unwrap();
    assert!(
        std::fs::read(out.join("model.safetensors")).unwrap()
            == std::fs::read(fresh_dir.join("model.safetensors")).unwrap(),
        "a restarted run differs from a fresh one"
    );
}

/// `export-phone` of `model` to `out` as f32 (no calibration, so no ONNX Runtime needed).
fn export_args<'a>(model: &'a Path, out: &'a Path, context: &'a str) -> Vec<&'a std::ffi::OsStr> {
    let mut v: Vec<&std::ffi::OsStr> = vec!["export-phone".as_ref(), model.as_os_str()];
    v.extend([
        "--out".as_ref(),
        out.as_os_str(),
        "--context".as_ref(),
        context.as_ref(),
    ]);
    for a in ["--precision", "f32", "--quiet"] {
        v.push(a.as_ref());
    }
    v
}

fn os_refs(v: &[std::ffi::OsString]) -> Vec<&std::ffi::OsStr> {
    v.iter().map(|a| a.as_os_str()).collect()
}

/// Spawn (with the signals in `ignored` set to be ignored, as `nohup` does), send `signal` as soon
/// as `now()` holds, and return the exit status and stderr, or `None` when the command finished
/// first.
fn signal_when(
    args: &[&std::ffi::OsStr],
    ignored: &'static [i32],
    signal: i32,
    now: &dyn Fn() -> bool,
) -> Option<(Option<i32>, String)> {
    use std::os::unix::process::CommandExt;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = common::tool();
    cmd.args(args)
        .env("RAYON_NUM_THREADS", "2")
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap());
    // SAFETY: only async-signal-safe calls (signal(2)) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // A background job of a script (as CI may run this) inherits SIGINT ignored: start
            // from the defaults, then ignore what the case asks.
            for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(s, libc::SIG_DFL);
            }
            for &s in ignored {
                libc::signal(s, libc::SIG_IGN);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    while !now() {
        if child.try_wait().unwrap().is_some() {
            return None;
        }
        assert!(
            Instant::now() < deadline,
            "{args:?}: still running after 300 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
    let status = child.wait().unwrap();
    let err = std::fs::read_to_string(log.path()).unwrap();
    Some((status.code(), err))
}

#[test]
fn an_interruption_keeps_finished_layers_with_a_note_and_removes_what_cannot_resume() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    // Calibration long enough that each layer takes a while: a loaded machine (the other tests
    // of this file run beside this one) must still see the run between two layers.
    let slow = |out: &Path| -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = quantize_args(&model, out)
            .into_iter()
            .map(Into::into)
            .collect();
        for (flag, value) in [("--samples", "32"), ("--seq-len", "256")] {
            let i = v.iter().position(|a| a == flag).unwrap();
            v[i + 1] = value.into();
        }
        v
    };
    let reference = d.path().join("reference");
    let o = spark(&os_refs(&slow(&reference)));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let same_as_reference = |out: &Path, what: &str| {
        assert!(
            std::fs::read(out.join("model.safetensors")).unwrap()
                == std::fs::read(reference.join("model.safetensors")).unwrap(),
            "{what}: differs from an uninterrupted run"
        );
    };
    // Ctrl-C once two layers are saved: exit 130, --out absent, the layers kept and named. (A
    // loaded machine may finish the fixture's 8 layers before the signal lands: try again.)
    let (out, staging) = (d.path().join("q"), d.path().join(".q.partial"));
    let layer1 = staging.join("layers/layer_001.safetensors");
    let mut landed = None;
    for _ in 0..3 {
        match signal_when(&os_refs(&slow(&out)), &[], libc::SIGINT, &|| {
            layer1.exists()
        }) {
            Some((code, err)) if !out.exists() => {
                landed = Some((code, err));
                break;
            }
            _ => std::fs::remove_dir_all(&out).unwrap(),
        }
    }
    let (code, err) = landed.expect("no Ctrl-C landed while quantize ran");
    assert_eq!(code, Some(130), "{err}");
    assert!(
        err.contains("interrupted: the finished layers are kept in")
            && err.contains(".q.partial")
            && err.contains("--resume"),
        "{err}"
    );
    assert!(layer1.exists());
    // A run without --resume starts over, and says what it discards and how to resume instead.
    let aside = tempfile::tempdir().unwrap();
    let kept = aside.path().join("kept");
    common::copy_dir(&staging, &kept);
    let o = spark(&os_refs(&slow(&out)));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("starting over")
            && err.contains("finished layer(s)")
            && err.contains("--resume"),
        "{err}"
    );
    same_as_reference(&out, "started over");
    std::fs::remove_dir_all(&out).unwrap();
    common::copy_dir(&kept, &staging);
    let mut args = slow(&out);
    args.push("--resume".into());
    let o = spark(&os_refs(&args));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    same_as_reference(&out, "resumed after Ctrl-C");
    std::fs::remove_dir_all(&out).unwrap();
    // A signal the parent ignores stays ignored (nohup): the run goes on to the end.
    let (code, err) = signal_when(
        &os_refs(&slow(&out)),
        &[libc::SIGHUP],
        libc::SIGHUP,
        &|| staging.exists(),
    )
    .expect("quantize was still starting");
    assert_eq!(code, Some(0), "{err}");
    same_as_reference(&out, "run through an ignored SIGHUP");
    // SIGTERM during an export (nothing to resume there): its staging folder is removed.
    let exp = d.path().join("phone");
    let exp_staging = d.path().join(".phone.partial");
    let eargs = export_args(&model, &exp, "2048");
    let mut landed = 0;
    for _ in 0..5 {
        let Some((code, err)) = signal_when(&eargs, &[], libc::SIGTERM, &|| exp_staging.exists())
        else {
            std::fs::remove_dir_all(&exp).unwrap();
            continue;
        };
        assert_eq!(code, Some(143), "{err}");
        if exp.exists() {
            // The signal landed after the rename that publishes --out: complete.
            assert!(exp.join(spark_tool::artifact::MARKER).is_file());
            std::fs::remove_dir_all(&exp).unwrap();
            continue;
        }
        assert!(err.contains("interrupted: removed the unfinished"), "{err}");
        landed += 1;
        break;
    }
    assert_eq!(landed, 1, "no SIGTERM landed while the export ran");
    assert_eq!(
        names(d.path()),
        ["model", "q", "reference"],
        "no staging left"
    );
}

/// When to kill a running command.
type KillPoint<'a> = Box<dyn Fn() -> bool + 'a>;

/// Spawn, SIGKILL as soon as `now()` holds, and return whether it was still running then.
fn kill_when(args: &[&std::ffi::OsStr], now: &dyn Fn() -> bool) -> bool {
    let mut child = common::tool()
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while !now() {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    true
}

fn kill_after(args: &[&std::ffi::OsStr], after: Duration) -> bool {
    let t = Instant::now();
    kill_when(args, &|| t.elapsed() >= after)
}

#[test]
fn sigkill_at_any_point_leaves_the_destination_alone_and_resume_finishes_identically() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    let before = common::snapshot(&model);
    let reference = d.path().join("reference");
    let o = spark(&quantize_args(&model, &reference));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let out = d.path().join("q");
    let staging = d.path().join(".q.partial");
    // Kill points by progress, not by time (load on a shared machine varies): at once, after the
    // first, the fourth and the last layer's state is saved, and during the final write.
    let layer = |i: usize| staging.join(format!("layers/layer_{i:03}.safetensors"));
    let points: [(&str, KillPoint); 5] = [
        ("at start", Box::new(|| true)),
        ("after layer 0", Box::new(|| layer(0).exists())),
        ("after layer 3", Box::new(|| layer(3).exists())),
        ("after layer 7", Box::new(|| layer(7).exists())),
        (
            "in the final write",
            Box::new(|| staging.join("staged").exists()),
        ),
    ];
    let mut killed = 0;
    for (frac, now) in &points {
        if kill_when(&quantize_args(&model, &out), now.as_ref()) {
            killed += 1;
            assert!(!out.exists(), "killed {frac}: --out appeared half-written");
        } else {
            // Finished before the kill: a complete artifact; start the next round afresh.
            assert!(out.join(spark_tool::artifact::MARKER).is_file());
            std::fs::remove_dir_all(&out).unwrap();
        }
        // Resuming from whatever the kill left finishes with the uninterrupted result.
        let mut args = quantize_args(&model, &out);
        args.push("--resume".as_ref());
        let o = spark(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(
            std::fs::read(out.join("model.safetensors")).unwrap()
                == std::fs::read(reference.join("model.safetensors")).unwrap(),
            "resumed after a kill {frac}: differs from an uninterrupted run"
        );
        std::fs::remove_dir_all(&out).unwrap();
        assert_eq!(names(d.path()), ["model", "reference"], "no staging left");
    }
    assert!(killed >= 3, "only {killed} kills landed while running");

    // export-phone: killed anywhere, --out never appears; the next run clears the staging.
    let exp = d.path().join("phone");
    let eargs = export_args(&model, &exp, "64");
    let t = Instant::now();
    assert!(spark(&eargs).status.success());
    let full = t.elapsed();
    std::fs::remove_dir_all(&exp).unwrap();
    for frac in [0.1, 0.5, 0.9] {
        let killed = kill_after(&eargs, full.mul_f64(frac));
        // A kill that lands after the one rename that publishes --out (while the process is
        // exiting) finds the artifact complete; before it, --out never exists.
        if exp.exists() {
            assert!(
                exp.join(spark_tool::artifact::MARKER).is_file(),
                "export killed at {frac} (kill landed: {killed}): --out appeared half-written"
            );
            std::fs::remove_dir_all(&exp).unwrap();
        }
        let o = spark(&eargs);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::remove_dir_all(&exp).unwrap();
        assert_eq!(names(d.path()), ["model", "reference"], "no staging left");
    }
    assert_eq!(
        common::snapshot(&model),
        before,
        "the model was never touched"
    );
}

/// A tmpfs mounted on a temporary folder, unmounted on drop.
struct Mount(PathBuf);

impl Mount {
    fn new(at: &Path, size: &str) -> Option<Mount> {
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            assert!(
                std::env::var_os("SPARK_REQUIRE_MOUNT").is_none(),
                "SPARK_REQUIRE_MOUNT is set but tmpfs could not be mounted"
            );
            eprintln!("skipped: cannot mount a tmpfs here (not root)");
            return None;
        }
        Some(Mount(at.to_path_buf()))
    }

    fn remount(&self, opts: &str) {
        let o = Command::new("mount")
            .args(["-o", &format!("remount,{opts}")])
            .arg(&self.0)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_fails_with_the_reason_and_leaves_nothing_unexplained() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    let vol = d.path().join("vol");
    // Room for the resume state of a few layers but not for the finished checkpoint.
    let Some(m) = Mount::new(&vol, "3m") else {
        return;
    };
    let out = vol.join("q");
    let o = spark(&quantize_args(&model, &out));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("No space left"), "{err}");
    assert!(!out.exists(), "{err}");
    let left = names(&vol);
    if !left.is_empty() {
        // Kept only with a message that says where, how big, and that --resume uses it.
        assert_eq!(left, [".q.partial"], "{err}");
        assert!(
            err.contains(".q.partial") && err.contains("--resume") && err.contains("delete"),
            "{err}"
        );
        // With room again, --resume finishes from it.
        m.remount("size=64m");
        let mut args = quantize_args(&model, &out);
        args.push("--resume".as_ref());
        let o = spark(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(names(&vol), ["q"]);
        std::fs::remove_dir_all(&out).unwrap();
        m.remount("size=3m");
    }
    // An export that does not fit leaves nothing at all.
    let exp = vol.join("phone");
    let o = spark(&[
        "export-phone".as_ref(),
        model.as_os_str(),
        "--out".as_ref(),
        exp.as_os_str(),
        "--precision".as_ref(),
        "f32".as_ref(),
        "--context".as_ref(),
        "64".as_ref(),
        "--quiet".as_ref(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("No space left"), "{err}");
    assert!(names(&vol).is_empty(), "export left {:?}", names(&vol));
}

#[test]
fn read_only_locations_are_refused_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    let vol = d.path().join("ro");
    let Some(m) = Mount::new(&vol, "8m") else {
        return;
    };
    m.remount("ro");
    let out = vol.join("q");
    let logits = vol.join("l.safetensors");
    let report = vol.join("r.json");
    let cases: Vec<(Vec<&std::ffi::OsStr>, &str)> = vec![
        (quantize_args(&model, &out), "--out"),
        (
            vec![
                "export-phone".as_ref(),
                model.as_os_str(),
                "--out".as_ref(),
                out.as_os_str(),
            ],
            "--out",
        ),
        (
            vec![
                "run".as_ref(),
                model.as_os_str(),
                "--tokens".as_ref(),
                "1,2".as_ref(),
                "--logits-out".as_ref(),
                logits.as_os_str(),
            ],
            "--logits-out",
        ),
        (
            vec![
                "parity".as_ref(),
                model.as_os_str(),
                model.as_os_str(),
                "--json".as_ref(),
                report.as_os_str(),
            ],
            "--json",
        ),
    ];
    for (args, flag) in cases {
        let t = Instant::now();
        let o = spark(&args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag) && err.contains("not writable"), "{err}");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "refused only after work"
        );
    }
    assert!(names(&vol).is_empty());
}

#[test]
fn a_mount_point_out_is_written_inside_from_the_cli() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    let vol = d.path().join("vol");
    let Some(_m) = Mount::new(&vol, "64m") else {
        return;
    };
    for force in [false, true] {
        let mut args = quantize_args(&model, &vol);
        if force {
            args.push("--force".as_ref());
        }
        let o = spark(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(vol.join("model.safetensors").is_file());
        assert!(
            names(&vol).iter().all(|n| !n.contains("partial")),
            "{:?}",
            names(&vol)
        );
    }
}
