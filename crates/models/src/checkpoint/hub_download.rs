//! The `hub-download` feature: a hub name missing from the local cache
//! (or there without what a decoder folder needs) is downloaded into it
//! through hf-hub's blocking API, in the layout `huggingface_hub` writes
//! (`blobs/`, `snapshots/<commit>/`, `refs/<revision>`), then found there
//! as without the feature. Only the files a decoder folder reads are
//! fetched: never the repo's pickles, ONNX or GGUF exports.
//!
//! The environment is read as `huggingface_hub` reads it: `HF_HUB_OFFLINE`
//! (else `TRANSFORMERS_OFFLINE`) set to 1, ON, YES or TRUE forbids any
//! download, `HF_ENDPOINT` replaces `https://huggingface.co`, and the token
//! of a gated or private repo is `HF_TOKEN`, else the file `HF_TOKEN_PATH`,
//! else `HF_HOME/token` (`~/.cache/huggingface/token`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use super::folder::{Weights, INDEX_NAME};
use super::hub_cache::{is_commit_hash, snapshot_in};
use crate::formats::files::{read_text, MAX_CONFIG_BYTES};
use crate::formats::safetensors::read_index;

/// The files a decoder folder must have: without them nothing is fetched.
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];

/// The files a decoder folder reads where the repo has them.
const OPTIONAL: [&str; 4] = [
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Where and whether to download, from the environment ([`Hub::from_env`]).
#[derive(Debug, Clone)]
pub(crate) struct Hub {
    /// The hub's address, without a trailing '/'.
    pub endpoint: String,
    /// The bearer token sent, for gated and private repos.
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE`: the cache only, never the network.
    pub offline: bool,
    /// hf-hub's progress bars on standard error.
    pub progress: bool,
}

impl Hub {
    /// The settings `huggingface_hub` would take from this environment.
    pub(crate) fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into());
        let token = var("HF_TOKEN")
            .or_else(|| var("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let path = var("HF_TOKEN_PATH").map(PathBuf::from).or_else(|| {
                    var("HF_HOME")
                        .map(PathBuf::from)
                        .or_else(|| var("XDG_CACHE_HOME").map(|c| Path::new(&c).join("huggingface")))
                        .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache").join("huggingface")))
                        .map(|home| home.join("token"))
                })?;
                let text = read_text(&path, "Hugging Face token", 64 << 10).ok()?;
                Some(text.trim().to_string()).filter(|t| !t.is_empty())
            });
        Self {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token,
            offline: var("HF_HUB_OFFLINE")
                .or_else(|| var("TRANSFORMERS_OFFLINE"))
                .is_some_and(|v| is_true(&v)),
            progress: std::io::stderr().is_terminal(),
        }
    }
}

/// `huggingface_hub`'s reading of a boolean variable (`_is_true`).
fn is_true(value: &str) -> bool {
    ["1", "ON", "YES", "TRUE"].contains(&value.to_ascii_uppercase().as_str())
}

/// The snapshot of `org/name` at `revision` in `cache`: the one there when
/// it holds what a decoder folder needs, else (unless `hub.offline`) the
/// one downloaded. An incomplete snapshot under `HF_HUB_OFFLINE` is
/// returned as is, for the loader to name what it lacks.
pub(crate) fn resolve_or_download(
    cache: &Path,
    org: &str,
    name: &str,
    revision: &str,
    hub: &Hub,
) -> std::result::Result<PathBuf, String> {
    let found = snapshot_in(cache, org, name, revision);
    let why = match found {
        Ok(snapshot) if hub.offline || is_complete(&snapshot) => return Ok(snapshot),
        Ok(snapshot) => format!(
            "the Hugging Face cache's snapshot '{}' lacks files a model folder needs",
            snapshot.display()
        ),
        Err(why) if hub.offline => {
            return Err(format!(
                "{why}, and HF_HUB_OFFLINE is set, so nothing is downloaded \
                 (unset it to download {org}/{name})"
            ))
        }
        Err(why) => why,
    };
    download(cache, org, name, revision, hub).map_err(|e| format!("{why}; downloading it failed: {e}"))?;
    snapshot_in(cache, org, name, revision)
}

/// Whether `snapshot` holds the files a decoder folder must have, its
/// weights all there (every shard its index lists).
fn is_complete(snapshot: &Path) -> bool {
    REQUIRED.iter().all(|f| snapshot.join(f).is_file())
        && match Weights::find(snapshot) {
            Ok(Weights::File(_)) => true,
            Ok(Weights::Sharded(index)) => read_text(&index, "index", MAX_CONFIG_BYTES)
                .and_then(|text| read_index(&text, &index.display().to_string()))
                .is_ok_and(|(shards, _)| shards.iter().all(|s| snapshot.join(s).is_file())),
            Err(_) => false,
        }
}

/// Of the files a repo `listed`, those a decoder folder reads besides its
/// weights (in download order), and where its weights are: the shard
/// index if it has one, else `model.safetensors`. A repo without
/// config.json, tokenizer.json or safetensors weights is refused before
/// anything is fetched.
fn choose(listed: &[String]) -> std::result::Result<(Vec<&'static str>, &'static str), String> {
    let has = |f: &str| listed.iter().any(|l| l == f);
    if let Some(missing) = REQUIRED.iter().find(|f| !has(f)) {
        return Err(format!("the repo has no {missing}, which multihead needs"));
    }
    let weights = if has(INDEX_NAME) {
        INDEX_NAME
    } else if has("model.safetensors") {
        "model.safetensors"
    } else {
        return Err(format!(
            "the repo has no model.safetensors or {INDEX_NAME} (pickled weights are not read)"
        ));
    };
    let files = REQUIRED
        .into_iter()
        .chain(OPTIONAL.into_iter().filter(|f| has(f)))
        .collect();
    Ok((files, weights))
}

/// Downloads into `cache` what [`choose`] picks of `org/name` at
/// `revision`, all from the one commit the hub resolves `revision` to,
/// skipping what that commit's snapshot already holds; `refs/<revision>`
/// then names that commit. Errors name the repo, the revision and the file.
fn download(
    cache: &Path,
    org: &str,
    name: &str,
    revision: &str,
    hub: &Hub,
) -> std::result::Result<(), String> {
    let at = format!("{org}/{name} at revision '{revision}'");
    let api = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_endpoint(hub.endpoint.clone())
        .with_token(hub.token.clone())
        .with_progress(hub.progress)
        .with_user_agent("multihead", env!("CARGO_PKG_VERSION"))
        .build()
        .map_err(|e| format!("{at}: {e}"))?;
    let repo = api.repo(Repo::with_revision(
        format!("{org}/{name}"),
        RepoType::Model,
        revision.to_string(),
    ));
    let info = repo.info().map_err(|e| format!("{at}: listing its files: {e}"))?;
    if !is_commit_hash(&info.sha) {
        return Err(format!(
            "{at}: the hub's commit '{}' is not a commit hash",
            info.sha
        ));
    }
    let listed: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let (files, weights) = choose(&listed).map_err(|e| format!("{at}: {e}"))?;
    let repo_dir = cache.join(format!("models--{org}--{name}"));
    let snapshot = repo_dir.join("snapshots").join(&info.sha);
    let fetch = |file: &str| -> std::result::Result<PathBuf, String> {
        let local = snapshot.join(file);
        if local.is_file() {
            return Ok(local);
        }
        let got = repo
            .download(file)
            .map_err(|e| format!("{at}: file '{file}': {e}"))?;
        if got.parent() != Some(snapshot.as_path()) {
            return Err(format!(
                "{at}: file '{file}' came from another commit than {} ({}): the revision moved \
                 during the download; run again",
                info.sha,
                got.display()
            ));
        }
        Ok(got)
    };
    for file in files {
        fetch(file)?;
    }
    let weights_file = fetch(weights)?;
    if weights == INDEX_NAME {
        let text = read_text(&weights_file, "index", MAX_CONFIG_BYTES).map_err(|e| format!("{at}: {e}"))?;
        let (shards, _) = read_index(&text, &format!("{at}: {INDEX_NAME}")).map_err(|e| e.to_string())?;
        for shard in &shards {
            fetch(shard)?;
        }
    }
    // hf-hub writes the reference with each file it downloads; written
    // here too for a snapshot that already held them all. A commit hash
    // needs none (hf-hub still writes one named by the hash).
    if !is_commit_hash(revision) {
        let reference = repo_dir.join("refs").join(revision);
        let write = || {
            std::fs::create_dir_all(reference.parent().unwrap_or(&repo_dir))?;
            std::fs::write(&reference, &info.sha)
        };
        write().map_err(|e| format!("{at}: writing '{}': {e}", reference.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_decoder_folder_s_files_are_chosen_from_the_repo_s_list() {
        let listed = names(&[
            ".gitattributes",
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "pytorch_model.bin",
            "onnx/model.onnx",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.json",
        ]);
        let (files, weights) = choose(&listed).unwrap();
        assert_eq!(
            files,
            [
                "config.json",
                "tokenizer.json",
                "generation_config.json",
                "tokenizer_config.json"
            ]
        );
        assert_eq!(weights, "model.safetensors");
        // The index wins over a model.safetensors beside it, as in
        // `Weights::find`.
        let mut sharded = listed.clone();
        sharded.push(INDEX_NAME.into());
        sharded.push("chat_template.jinja".into());
        sharded.push("special_tokens_map.json".into());
        let (files, weights) = choose(&sharded).unwrap();
        assert_eq!(weights, INDEX_NAME);
        assert_eq!(files.len(), 6);
        for (drop, want) in [
            ("tokenizer.json", "no tokenizer.json"),
            ("config.json", "no config.json"),
            (
                "model.safetensors",
                "no model.safetensors or model.safetensors.index.json",
            ),
        ] {
            let fewer: Vec<String> = listed.iter().filter(|f| *f != drop).cloned().collect();
            let err = choose(&fewer).unwrap_err();
            assert!(err.contains(want), "{drop}: {err}");
        }
    }

    #[test]
    fn offline_reads_as_huggingface_hub_reads_it() {
        for yes in ["1", "ON", "yes", "True"] {
            assert!(is_true(yes), "{yes}");
        }
        for no in ["0", "", "off", "false", "2", " 1"] {
            assert!(!is_true(no), "{no}");
        }
    }

    /// A hub on 127.0.0.1 serving `files` at one commit the way
    /// huggingface.co does for hf-hub (the repo's file list; each file's
    /// commit, ETag and size on a ranged GET), recording the paths asked.
    struct FakeHub {
        endpoint: String,
        asked: Arc<Mutex<Vec<String>>>,
    }

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    impl FakeHub {
        fn serve(repo: &'static str, files: BTreeMap<&'static str, String>) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let endpoint = format!("http://{}", listener.local_addr().unwrap());
            let asked = Arc::new(Mutex::new(Vec::new()));
            let log = Arc::clone(&asked);
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { return };
                    let mut reader = BufReader::new(&stream);
                    let mut line = String::new();
                    if reader.read_line(&mut line).is_err() {
                        continue;
                    }
                    let path = line.split(' ').nth(1).unwrap_or("").to_string();
                    loop {
                        let mut header = String::new();
                        match reader.read_line(&mut header) {
                            Ok(n) if n > 2 => continue,
                            _ => break,
                        }
                    }
                    log.lock().unwrap().push(path.clone());
                    let list = format!("/api/models/{repo}/revision/main");
                    let prefix = format!("/{repo}/resolve/main/");
                    let (status, headers, body) = if path == list {
                        let siblings: Vec<String> = files
                            .keys()
                            .map(|f| format!(r#"{{"rfilename":"{f}"}}"#))
                            .collect();
                        let body = format!(r#"{{"sha":"{COMMIT}","siblings":[{}]}}"#, siblings.join(","));
                        ("200 OK", String::new(), body)
                    } else if let Some(body) = path.strip_prefix(&prefix).and_then(|f| files.get(f)) {
                        let headers = format!(
                            "x-repo-commit: {COMMIT}\r\netag: \"{:016x}\"\r\ncontent-range: bytes 0-0/{}\r\n",
                            fnv(body.as_bytes()),
                            body.len()
                        );
                        ("200 OK", headers, body.clone())
                    } else {
                        ("404 Not Found", String::new(), String::new())
                    };
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status}\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
            });
            Self { endpoint, asked }
        }

        fn hub(&self, offline: bool) -> Hub {
            Hub {
                endpoint: self.endpoint.clone(),
                token: None,
                offline,
                progress: false,
            }
        }

        fn asked(&self) -> Vec<String> {
            self.asked.lock().unwrap().clone()
        }
    }

    fn fnv(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf29ce484222325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
        })
    }

    fn fresh_cache(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("multihead-hub-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_sharded_repo_is_downloaded_into_the_cache_layout_and_found_there() {
        let index = r#"{"metadata": {}, "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors"}}"#;
        let files = BTreeMap::from([
            ("config.json", r#"{"model_type": "llama"}"#.to_string()),
            ("tokenizer.json", "{}".to_string()),
            ("tokenizer_config.json", "{ }".to_string()),
            ("README.md", "# not fetched".to_string()),
            ("pytorch_model.bin", "not fetched".to_string()),
            (INDEX_NAME, index.to_string()),
            ("model-00001-of-00002.safetensors", "shard one".to_string()),
            ("model-00002-of-00002.safetensors", "shard two".to_string()),
            ("model-00003-of-00003.safetensors", "not in the index".to_string()),
        ]);
        let server = FakeHub::serve("acme/sharded", files.clone());
        let cache = fresh_cache("sharded");

        // HF_HUB_OFFLINE: not one request.
        let err = resolve_or_download(&cache, "acme", "sharded", "main", &server.hub(true)).unwrap_err();
        assert!(
            err.contains("has no acme/sharded") && err.contains("HF_HUB_OFFLINE"),
            "{err}"
        );
        assert!(server.asked().is_empty(), "{:?}", server.asked());

        let snapshot = resolve_or_download(&cache, "acme", "sharded", "main", &server.hub(false)).unwrap();
        let repo = cache.join("models--acme--sharded");
        assert_eq!(snapshot, repo.join("snapshots").join(COMMIT));
        assert_eq!(
            std::fs::read_to_string(repo.join("refs").join("main")).unwrap(),
            COMMIT
        );
        let mut held: Vec<String> = std::fs::read_dir(&snapshot)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        held.sort();
        assert_eq!(
            held,
            [
                "config.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                INDEX_NAME,
                "tokenizer.json",
                "tokenizer_config.json",
            ]
        );
        for file in &held {
            assert_eq!(
                &std::fs::read_to_string(snapshot.join(file)).unwrap(),
                &files[file.as_str()]
            );
        }
        // Found in the cache now: no request at all.
        let asked = server.asked().len();
        assert_eq!(
            resolve_or_download(&cache, "acme", "sharded", "main", &server.hub(false)).unwrap(),
            snapshot
        );
        assert_eq!(server.asked().len(), asked);

        // A shard lost from the snapshot: only that one is fetched again.
        std::fs::remove_file(snapshot.join("model-00002-of-00002.safetensors")).unwrap();
        resolve_or_download(&cache, "acme", "sharded", "main", &server.hub(false)).unwrap();
        let again: Vec<String> = server.asked()[asked..]
            .iter()
            .filter(|p| p.contains("/resolve/"))
            .cloned()
            .collect();
        assert_eq!(
            again,
            [
                "/acme/sharded/resolve/main/model-00002-of-00002.safetensors",
                "/acme/sharded/resolve/main/model-00002-of-00002.safetensors",
            ],
            "hf-hub asks once for the size and once for the bytes"
        );
        let _ = std::fs::remove_dir_all(&cache);
    }

    #[test]
    fn a_failed_download_names_the_repo_the_revision_and_the_file() {
        // The index lists a shard the hub does not serve.
        let files = BTreeMap::from([
            ("config.json", "{}".to_string()),
            ("tokenizer.json", "{}".to_string()),
            (
                INDEX_NAME,
                r#"{"weight_map": {"a": "model-gone.safetensors"}}"#.to_string(),
            ),
        ]);
        let server = FakeHub::serve("acme/broken", files);
        let cache = fresh_cache("broken");
        let err = resolve_or_download(&cache, "acme", "broken", "main", &server.hub(false)).unwrap_err();
        assert!(
            err.contains("has no acme/broken; downloading it failed: acme/broken at revision 'main': file 'model-gone.safetensors'")
                && err.contains("404"),
            "{err}"
        );
        // A repo the hub does not have: its file list is what failed.
        let err = resolve_or_download(&cache, "acme", "other", "v2", &server.hub(false)).unwrap_err();
        assert!(
            err.contains("acme/other at revision 'v2': listing its files") && err.contains("404"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&cache);
    }
}
