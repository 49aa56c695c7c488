//! Models named as on the Hugging Face hub (`Qwen/Qwen2.5-0.5B-Instruct`),
//! found in the local hub cache the way `transformers` finds them offline
//! (`HF_HUB_OFFLINE=1`): no network, only the folders `huggingface_hub`
//! downloaded into. The cache's layout (`huggingface_hub/file_download.py`):
//!
//! ```text
//! <cache>/models--ORG--NAME/refs/main          the commit hash of `main`
//! <cache>/models--ORG--NAME/snapshots/<hash>/  the files of that commit
//! ```
//!
//! `<cache>` is `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
//! With the `hub-download` feature, a model missing there is downloaded
//! into it first (hub_download.rs), unless `HF_HUB_OFFLINE` is set.

use std::path::{Path, PathBuf};

use candle::{bail, Result};

use crate::formats::files::{read_text, MAX_CONFIG_BYTES};

/// The hub cache folder this process would read, from the environment.
pub fn hub_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// What `--model SPEC` names: `SPEC` itself where it is a file or folder,
/// else, where it reads `ORG/NAME` or `ORG/NAME@REVISION` (a branch or tag
/// in `refs/`, or a commit hash), that model's snapshot in the hub cache.
/// A spec that is neither is one error naming both places looked in.
///
/// Built with the `hub-download` feature, a model the cache lacks (or
/// holds without its config, tokenizer or every weights file) is first
/// downloaded into it at that revision: config.json, tokenizer.json, the
/// generation and tokenizer configs, special tokens map and chat template
/// the repo has, and `model.safetensors` or the shards its index lists.
/// `HF_HUB_OFFLINE=1` forbids it, as in `huggingface_hub`; without the
/// feature nothing is ever downloaded.
pub fn resolve_model(path: &Path) -> Result<PathBuf> {
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let spec = path.to_string_lossy();
    let Some((org, name, revision)) = path.to_str().and_then(hub_name) else {
        bail!("'{spec}': no such file or folder")
    };
    let Some(cache) = hub_cache_dir() else {
        bail!("'{spec}': no such file or folder, and no Hugging Face cache is set (HF_HUB_CACHE, HF_HOME or HOME)")
    };
    find_or_fetch(&cache, org, name, revision)
        .map_err(|why| candle::Error::Msg(format!("'{spec}': no such file or folder, and {why}")))
}

#[cfg(feature = "hub-download")]
fn find_or_fetch(
    cache: &Path,
    org: &str,
    name: &str,
    revision: &str,
) -> std::result::Result<PathBuf, String> {
    super::hub_download::resolve_or_download(
        cache,
        org,
        name,
        revision,
        &super::hub_download::Hub::from_env(),
    )
}

#[cfg(not(feature = "hub-download"))]
fn find_or_fetch(
    cache: &Path,
    org: &str,
    name: &str,
    revision: &str,
) -> std::result::Result<PathBuf, String> {
    snapshot_in(cache, org, name, revision).map_err(|why| {
        let flag = if revision == "main" {
            String::new()
        } else {
            format!(" --revision {revision}")
        };
        format!(
            "{why} (nothing is downloaded here: `huggingface-cli download {org}/{name}{flag}` fetches it, \
             and so does a multihead built with `--features hub-download`)"
        )
    })
}

/// A full commit hash: 40 hexadecimal digits.
pub(super) fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// `ORG/NAME[@REVISION]` with the hub's characters, or `None`.
fn hub_name(spec: &str) -> Option<(&str, &str, &str)> {
    let (repo, revision) = spec.split_once('@').unwrap_or((spec, "main"));
    let (org, name) = repo.split_once('/')?;
    // The hub's repo-id rule: letters, digits, '-', '_', '.'; no '..'.
    let ok = |s: &str| {
        !s.is_empty()
            && !s.contains("..")
            && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let revision_ok = !revision.is_empty()
        && !revision.contains("..")
        && !revision.starts_with('/')
        && revision
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
    (ok(org) && ok(name) && revision_ok).then_some((org, name, revision))
}

/// The snapshot folder of `org/name` at `revision` in `cache`, or why
/// there is none (for the message).
pub(super) fn snapshot_in(
    cache: &Path,
    org: &str,
    name: &str,
    revision: &str,
) -> std::result::Result<PathBuf, String> {
    let repo = cache.join(format!("models--{org}--{name}"));
    if !repo.is_dir() {
        return Err(format!(
            "the Hugging Face cache '{}' has no {org}/{name}",
            cache.display()
        ));
    }
    let commit = if is_commit_hash(revision) {
        revision.to_string()
    } else {
        let reference = repo.join("refs").join(revision);
        let text = read_text(&reference, "hub cache reference", MAX_CONFIG_BYTES).map_err(|_| {
            format!(
                "the Hugging Face cache has {org}/{name} but no revision '{revision}' ({} is missing)",
                reference.display()
            )
        })?;
        let commit = text.trim().to_string();
        if !is_commit_hash(&commit) {
            return Err(format!("{} does not hold a commit hash", reference.display()));
        }
        commit
    };
    let snapshot = repo.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        return Err(format!(
            "the Hugging Face cache has {org}/{name} but not its snapshot {commit} ({} is missing)",
            snapshot.display()
        ));
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_names_are_the_hub_s_repo_ids() {
        assert_eq!(
            hub_name("Qwen/Qwen2.5-0.5B-Instruct"),
            Some(("Qwen", "Qwen2.5-0.5B-Instruct", "main"))
        );
        assert_eq!(hub_name("a/b@refs/pr/1"), Some(("a", "b", "refs/pr/1")));
        for bad in [
            "a", "a/b/c", "../b", "a/..", "a/b@../x", "a/b@/etc", "a b/c", "/b", "a/",
        ] {
            assert_eq!(hub_name(bad), None, "{bad}");
        }
    }
}
