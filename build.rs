//! Records the commit the binary is built from, for `spark-tool --version` ("unknown" outside a
//! git checkout, e.g. a crate tarball).

use std::process::Command;

fn main() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let suffix = if dirty { "+changes" } else { "" };
    println!("cargo:rustc-env=SPARK_COMMIT={commit}{suffix}");
    println!(
        "cargo:rustc-env=SPARK_PROFILE={}",
        std::env::var("PROFILE").unwrap_or_default()
    );
    // A new commit (HEAD moves, or the branch it names does) rebuilds the string.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{r}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
