//! Hugging Face Hub ids as model arguments: `ORG/NAME[@REVISION]` resolves to a snapshot folder of
//! the standard Hugging Face cache (`$HF_HOME/hub`, default `~/.cache/huggingface/hub`), the one
//! `huggingface_hub` and `hf download` fill. A snapshot already complete in the cache is used
//! without a network request; otherwise the checkpoint's files are downloaded from `$HF_ENDPOINT`
//! (default the Hub), unless `HF_HUB_OFFLINE` is set. A path that exists is always a path.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{id} is not a path here, and HF_HUB_OFFLINE is set but the Hugging Face cache \
         ({cache}) has no complete snapshot of it (missing {missing}); unset HF_HUB_OFFLINE to \
         download it, or pass a checkpoint folder"
    )]
    Offline {
        id: String,
        cache: String,
        missing: String,
    },
    #[error("{id}: {what} from {endpoint} failed: {why}")]
    Download {
        id: String,
        what: String,
        endpoint: String,
        why: String,
    },
    #[error("{id} at {endpoint} holds no config.json and *.safetensors: not a checkpoint")]
    NotACheckpoint { id: String, endpoint: String },
    #[error("the Hugging Face cache cannot be found: set HF_HOME (no home folder)")]
    NoCache,
}

/// A hub id: `ORG/NAME` with an optional `@REVISION` (branch, tag or commit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl HubId {
    /// `arg` as a hub id, if it has the shape of one: two name segments of letters, digits, `-`,
    /// `_` and `.` (not starting with `.`), and a revision after `@`.
    pub fn parse(arg: &str) -> Option<HubId> {
        let (repo, revision) = match arg.split_once('@') {
            Some((r, rev)) if !rev.is_empty() && !rev.contains("..") => (r, rev),
            Some(_) => return None,
            None => (arg, "main"),
        };
        let segment = |s: &str| {
            !s.is_empty()
                && !s.starts_with('.')
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let (org, name) = repo.split_once('/')?;
        (segment(org) && segment(name)).then(|| HubId {
            repo: repo.to_string(),
            revision: revision.to_string(),
        })
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.repo.clone(), RepoType::Model, self.revision.clone())
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.revision == "main" {
            write!(f, "{}", self.repo)
        } else {
            write!(f, "{}@{}", self.repo, self.revision)
        }
    }
}

/// The files of a checkpoint that spark-tool reads, among `names` (a repository's file list).
fn wanted(names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|n| {
            !n.contains('/')
                && (n.ends_with(".safetensors")
                    || matches!(
                        n.as_str(),
                        "config.json"
                            | "generation_config.json"
                            | "model.safetensors.index.json"
                            | "tokenizer.json"
                            | "tokenizer_config.json"
                            | "special_tokens_map.json"
                    ))
        })
        .cloned()
        .collect()
}

/// The safetensors files a snapshot folder needs: the index's shards, or `model.safetensors`.
fn missing_weights(dir: &Path) -> Vec<String> {
    let index = dir.join("model.safetensors.index.json");
    let shards: Vec<String> = match std::fs::read_to_string(&index)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    {
        Some(v) => {
            let mut s: Vec<String> = v["weight_map"]
                .as_object()
                .map(|m| {
                    m.values()
                        .filter_map(|f| f.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            s.sort();
            s.dedup();
            s
        }
        None => vec!["model.safetensors".to_string()],
    };
    shards
        .into_iter()
        .filter(|f| !dir.join(f).is_file())
        .collect()
}

fn cache() -> Result<Cache, HubError> {
    if std::env::var_os("HF_HOME").is_none() && std::env::var_os("HOME").is_none() {
        return Err(HubError::NoCache);
    }
    Ok(Cache::from_env())
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The snapshot folder of `id` when the cache holds all it needs, else what is missing.
fn cached(id: &HubId) -> Result<Result<PathBuf, String>, HubError> {
    let repo = cache()?.repo(id.repo());
    let Some(config) = repo.get("config.json") else {
        return Ok(Err("config.json".into()));
    };
    let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
    let missing = missing_weights(&dir);
    Ok(if missing.is_empty() {
        Ok(dir)
    } else {
        Err(missing.join(", "))
    })
}

/// `arg` as the folder to open: itself when it exists or is not a hub id, else the hub id's
/// snapshot folder (from the cache, downloaded first where needed and allowed).
pub fn resolve(arg: &Path, progress: bool) -> Result<PathBuf, HubError> {
    let id = match arg.to_str().and_then(HubId::parse) {
        Some(id) if !arg.exists() => id,
        _ => return Ok(arg.to_path_buf()),
    };
    let missing = match cached(&id)? {
        Ok(dir) => return Ok(dir),
        Err(missing) => missing,
    };
    if offline() {
        return Err(HubError::Offline {
            id: id.to_string(),
            cache: cache()?.path().display().to_string(),
            missing,
        });
    }
    let api = ApiBuilder::from_env()
        .with_progress(progress)
        .build()
        .map_err(|e| download(&id, "starting the client", e))?;
    let repo = api.repo(id.repo());
    let info = repo
        .info()
        .map_err(|e| download(&id, "listing the repository", e))?;
    let names: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let files = wanted(&names);
    if !files.iter().any(|f| f == "config.json")
        || !files.iter().any(|f| f.ends_with(".safetensors"))
    {
        return Err(HubError::NotACheckpoint {
            id: id.to_string(),
            endpoint: endpoint(),
        });
    }
    let mut dir = None;
    for f in &files {
        if progress {
            eprintln!("{id}: {f}");
        }
        let p = repo
            .get(f)
            .map_err(|e| download(&id, &format!("downloading {f}"), e))?;
        dir = p.parent().map(Path::to_path_buf);
    }
    Ok(dir.expect("at least config.json was fetched"))
}

fn download(id: &HubId, what: &str, e: impl std::fmt::Display) -> HubError {
    HubError::Download {
        id: id.to_string(),
        what: what.to_string(),
        endpoint: endpoint(),
        why: e.to_string(),
    }
}

/// Where downloads come from: `HF_ENDPOINT`, as hf-hub reads it, or the Hub.
fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_parse_and_paths_do_not() {
        let id = HubId::parse("XHToken/Spark-X2.5-1.7B").unwrap();
        assert_eq!(
            (id.repo.as_str(), id.revision.as_str()),
            ("XHToken/Spark-X2.5-1.7B", "main")
        );
        let id = HubId::parse("org/name@v1.0").unwrap();
        assert_eq!(id.revision, "v1.0");
        assert_eq!(id.to_string(), "org/name@v1.0");
        for not in [
            "fixtures/spark-tiny/extra",
            "/abs/path",
            "./org/name",
            "../org/name",
            "name",
            "org/",
            "org/name@",
            "org/.hidden",
            "org/na me",
        ] {
            assert_eq!(HubId::parse(not), None, "{not}");
        }
    }

    #[test]
    fn only_the_checkpoints_files_are_fetched() {
        let names: Vec<String> = [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "README.md",
            "onnx/model.onnx",
            "original/consolidated.safetensors",
            "pytorch_model.bin",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            wanted(&names),
            [
                "config.json",
                "model-00001-of-00002.safetensors",
                "model.safetensors.index.json",
                "tokenizer.json"
            ]
        );
    }
}
