//! Hub ids (`ORG/NAME[@REVISION]`) as model arguments: downloaded from a local server that serves
//! the fixture in the Hub's layout (started and stopped here, on 127.0.0.1), into a temporary
//! `HF_HOME`, then used from the cache with no server at all; a prepared cache folder offline.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A minimal Hub: `GET /api/models/{repo}/revision/main` lists the files, and
/// `GET /{repo}/resolve/main/{file}` serves one, with the headers the Hub's clients read (ETag,
/// X-Repo-Commit, Content-Range for ranged requests).
struct Hub {
    endpoint: String,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Hub {
    fn serve(repo: &str, dir: &Path) -> Hub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).unwrap())
            })
            .collect();
        let (stop, requests) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        let (s, n, repo) = (stop.clone(), requests.clone(), repo.to_string());
        let thread = std::thread::spawn(move || {
            // Bounded: the test stops it, and it never outlives two minutes.
            let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
            while !s.load(Ordering::Relaxed) && std::time::Instant::now() < until {
                match listener.accept() {
                    Ok((stream, _)) => {
                        n.fetch_add(1, Ordering::Relaxed);
                        stream.set_nonblocking(false).unwrap();
                        answer(stream, &repo, &files);
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                }
            }
        });
        Hub {
            endpoint,
            stop,
            requests,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop();
    }
}

fn answer(mut stream: std::net::TcpStream, repo: &str, files: &[(String, Vec<u8>)]) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut range = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                range = Some(v.trim().to_string());
            }
        }
    }
    let listing = format!("/api/models/{repo}/revision/main");
    let resolve = format!("/{repo}/resolve/main/");
    let (status, headers, body): (&str, Vec<String>, Vec<u8>) = if path == listing {
        let siblings: Vec<serde_json::Value> = files
            .iter()
            .map(|(n, _)| serde_json::json!({ "rfilename": n }))
            .collect();
        let body = serde_json::json!({ "sha": COMMIT, "siblings": siblings }).to_string();
        (
            "200 OK",
            vec!["Content-Type: application/json".into()],
            body.into_bytes(),
        )
    } else if let Some((_, bytes)) = path
        .strip_prefix(&resolve)
        .and_then(|f| files.iter().find(|(n, _)| n == f))
    {
        let etag = format!("{:x}", Sha256::digest(bytes));
        let mut headers = vec![
            format!("ETag: \"{etag}\""),
            format!("X-Repo-Commit: {COMMIT}"),
        ];
        match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
            Some(r) => {
                let (a, b) = r.split_once('-').unwrap();
                let start: usize = a.parse().unwrap();
                let end = b
                    .parse::<usize>()
                    .map_or(bytes.len() - 1, |e| e.min(bytes.len() - 1));
                headers.push(format!(
                    "Content-Range: bytes {start}-{end}/{}",
                    bytes.len()
                ));
                ("206 Partial Content", headers, bytes[start..=end].to_vec())
            }
            None => ("200 OK", headers, bytes.clone()),
        }
    } else {
        ("404 Not Found", vec![], b"not found".to_vec())
    };
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for h in headers {
        head.push_str(&h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(&body);
    let _ = stream.flush();
    // Drain what the client may still send before closing.
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_millis(50)));
    let _ = reader.read(&mut [0u8; 64]);
}

fn inspect(id: &str, hf_home: &Path, endpoint: &str, offline: bool) -> std::process::Output {
    let mut c = common::tool();
    c.args(["inspect", id, "--json"])
        .env("HF_HOME", hf_home)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_HUB_OFFLINE");
    if offline {
        c.env("HF_HUB_OFFLINE", "1");
    }
    c.output().unwrap()
}

fn parameters(o: &std::process::Output) -> u64 {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["parameters"].as_u64().unwrap()
}

#[test]
fn a_hub_id_downloads_into_the_cache_then_runs_offline() {
    let d = tempfile::tempdir().unwrap();
    let hf_home = d.path().join("hf");
    let fixture = common::fixture("spark-tiny");
    let want = parameters(
        &common::tool()
            .args(["inspect", "--json"])
            .arg(&fixture)
            .output()
            .unwrap(),
    );
    let mut hub = Hub::serve("spark-test/Spark-Tiny", &fixture);
    let o = inspect("spark-test/Spark-Tiny", &hf_home, &hub.endpoint, false);
    assert_eq!(parameters(&o), want);
    assert!(hub.requests.load(Ordering::Relaxed) > 0);
    // The standard cache layout, with the checkpoint's files only.
    let snapshot: PathBuf = hf_home.join(format!(
        "hub/models--spark-test--Spark-Tiny/snapshots/{COMMIT}"
    ));
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(snapshot.join(f).is_file(), "{f}");
    }
    assert!(!snapshot.join("TRAINING.md").exists());
    let endpoint = hub.endpoint.clone();
    hub.stop();
    // No server: the cache serves, online or offline, and run and parity take the id too.
    for offline in [false, true] {
        assert_eq!(
            parameters(&inspect(
                "spark-test/Spark-Tiny",
                &hf_home,
                &endpoint,
                offline
            )),
            want
        );
    }
    let o = common::tool()
        .args([
            "run",
            "spark-test/Spark-Tiny",
            "--prompt",
            "hello",
            "--max-new-tokens",
            "3",
        ])
        .env("HF_HOME", &hf_home)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // An id the cache lacks, offline: an error naming it and the variable, nothing written.
    let o = inspect("spark-test/Missing", &hf_home, &endpoint, true);
    let se = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{se}");
    assert!(
        se.contains("spark-test/Missing") && se.contains("HF_HUB_OFFLINE"),
        "{se}"
    );
    // Online with the server gone: the download's failure names the id and the endpoint.
    let o = inspect("spark-test/Missing", &hf_home, &endpoint, false);
    let se = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{se}");
    assert!(
        se.contains("spark-test/Missing") && se.contains(&endpoint),
        "{se}"
    );
}

#[test]
fn a_prepared_cache_folder_serves_offline_at_a_revision() {
    let d = tempfile::tempdir().unwrap();
    let hf_home = d.path().join("hf");
    let repo = hf_home.join("hub/models--org--spark-tiny");
    let snapshot = repo.join("snapshots/abc123");
    common::copy_dir(&common::fixture("spark-tiny"), &snapshot);
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/v1"), "abc123").unwrap();
    let o = inspect("org/spark-tiny@v1", &hf_home, "http://127.0.0.1:9", true);
    assert!(parameters(&o) > 0);
    // The same id at a revision the cache does not hold is refused offline.
    let o = inspect("org/spark-tiny", &hf_home, "http://127.0.0.1:9", true);
    assert_eq!(o.status.code(), Some(2));
    // A local folder of that name wins over the hub.
    let local = d.path().join("org/spark-tiny");
    common::copy_dir(&common::fixture("spark-tiny"), &local);
    let o = common::tool()
        .current_dir(d.path())
        .args(["inspect", "org/spark-tiny", "--json"])
        .env("HF_HOME", &hf_home)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(parameters(&o) > 0);
}
