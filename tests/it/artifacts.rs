//! A user's data is never lost: outputs that are or contain an input are refused, a replace
//! only removes a previous artifact of ours, and a destination that is a mount point (the
//! `docker run -v host:/out` case) is written inside, never removed.
//!
//! The inputs are copies of the fixture, so a regression cannot damage the repository.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use spark_tool::device::WeightFormat;
use spark_tool::export::{export_phone, ExportOptions, Precision};
use spark_tool::phone::QType;
use spark_tool::quantize::{quantize, QuantizeOptions};

fn copy_fixture(to: &Path) -> PathBuf {
    let dst = to.join("model");
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(common::fixture("spark-tiny")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
    dst
}

fn qopts(model: &Path, out: &Path) -> QuantizeOptions {
    let mut o = common::quantize_options(model, out, WeightFormat::W4A8, 128);
    (o.recipe.samples, o.recipe.seq_len, o.compare, o.force) = (4, 64, false, true);
    o
}

fn eopts() -> ExportOptions {
    ExportOptions {
        context: 128,
        precision: Precision::F32,
        kv: QType::Int16,
        parts: 1,
        calibration: Vec::new(),
        calib_samples: 1,
        calib_seq_len: 16,
        range_margin: 2.0,
        calibrator: spark_tool::export::Calibrator::Native,
        force: true,
        force_memory: false,
        progress: false,
        threads: 2,
    }
}

#[test]
fn force_never_deletes_the_input_or_a_folder_holding_it() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    let before = common::snapshot(d.path());
    for out in [model.clone(), d.path().to_path_buf(), model.join("..")] {
        let e = quantize(&qopts(&model, &out)).unwrap_err().to_string();
        assert!(e.contains("input"), "quantize --out {}: {e}", out.display());
        let e = export_phone(&model, &out, &eopts())
            .unwrap_err()
            .to_string();
        assert!(e.contains("input"), "export --out {}: {e}", out.display());
    }
    // The calibration file is an input too.
    let calib = d.path().join("calib.txt");
    std::fs::write(&calib, "some text").unwrap();
    let mut o = qopts(&model, &calib);
    o.recipe.calibration = vec![calib.clone()];
    assert!(quantize(&o).is_err());
    assert!(calib.is_file());
    std::fs::remove_file(&calib).unwrap();
    assert_eq!(common::snapshot(d.path()), before, "nothing was touched");
}

#[test]
fn logits_out_never_overwrites_the_model_or_a_foreign_file() {
    let d = tempfile::tempdir().unwrap();
    let model = copy_fixture(d.path());
    let run = |out: &Path| {
        common::tool()
            .arg("run")
            .arg(&model)
            .args(["--tokens", "1,2,3", "--max-new-tokens", "2", "--quiet"])
            .arg("--logits-out")
            .arg(out)
            .output()
            .unwrap()
    };
    let before = common::snapshot(&model);
    let o = run(&model.join("model.safetensors"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--logits-out") && err.contains("input"),
        "{err}"
    );
    assert_eq!(common::snapshot(&model), before);

    let foreign = d.path().join("notes.safetensors");
    std::fs::write(&foreign, "not ours").unwrap();
    let o = run(&foreign);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read(&foreign).unwrap(), b"not ours");

    // A previous logits file of ours is replaced.
    let ours = d.path().join("logits.safetensors");
    for _ in 0..2 {
        let o = run(&ours);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

/// A tmpfs mounted on a temporary folder, unmounted on drop.
struct Mount(PathBuf);

impl Mount {
    fn new(at: &Path) -> Option<Mount> {
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
            .arg(at)
            .output()
            .is_ok_and(|o| o.status.success());
        ok.then(|| Mount(at.to_path_buf()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_mount_point_destination_is_written_inside_and_never_removed() {
    let d = tempfile::tempdir().unwrap();
    let vol = d.path().join("vol");
    let Some(_mount) = Mount::new(&vol) else {
        // Mounting needs root; tools/test.sh sets SPARK_REQUIRE_MOUNT when it has it.
        assert!(
            std::env::var_os("SPARK_REQUIRE_MOUNT").is_none(),
            "SPARK_REQUIRE_MOUNT is set but tmpfs could not be mounted"
        );
        eprintln!("skipped: cannot mount a tmpfs here (not root)");
        return;
    };
    // Into the empty volume, then replacing our own export there, for both writers.
    export_phone(&common::fixture("spark-tiny"), &vol, &eopts()).unwrap();
    assert!(vol.join("phone_manifest.json").is_file());
    let mut o = eopts();
    o.context = 64;
    export_phone(&common::fixture("spark-tiny"), &vol, &o).unwrap();
    let m = std::fs::read_to_string(vol.join("phone_manifest.json")).unwrap();
    assert!(m.contains("\"context\": 64"), "replaced in place");
    let left: Vec<_> = std::fs::read_dir(&vol)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial") || n.contains("previous"))
        .collect();
    assert!(left.is_empty(), "staging removed: {left:?}");
    // A quantized checkpoint is a different artifact: the export there is not replaced.
    let e = quantize(&qopts(&common::fixture("spark-tiny"), &vol))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a gptq checkpoint"), "{e}");
    assert!(vol.join("phone_manifest.json").is_file());
    // The user's files on a volume are never removed.
    for e in std::fs::read_dir(&vol).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap();
        } else {
            std::fs::remove_file(p).unwrap();
        }
    }
    std::fs::write(vol.join("photo.jpg"), "user data").unwrap();
    let e = export_phone(&common::fixture("spark-tiny"), &vol, &eopts())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a spark-tool artifact"), "{e}");
    assert_eq!(std::fs::read(vol.join("photo.jpg")).unwrap(), b"user data");
    std::fs::remove_file(vol.join("photo.jpg")).unwrap();
    quantize(&qopts(&common::fixture("spark-tiny"), &vol)).unwrap();
    assert!(vol.join("model.safetensors").is_file());
}
