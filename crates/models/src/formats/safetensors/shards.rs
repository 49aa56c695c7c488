//! A checkpoint saved in shards (`save_pretrained(max_shard_size=...)`):
//! `model.safetensors.index.json` maps every tensor to the shard file
//! holding it; the shards are read, checked against the index, and merged
//! into one in-memory [`Checkpoint`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path};

use candle::{bail, Result};
use serde_json::Value;

use super::file::Checkpoint;

/// Most shards an index may name (the largest models on the Hub have a few
/// hundred).
pub(crate) const MAX_SHARDS: usize = 4096;

/// The shard files an index names, each once, in order, and which shard
/// each tensor is in. Shard names must be plain file names in the index's
/// folder: `../x`, `/abs/x`, `a/b` and names that are not `.safetensors`
/// are refused.
pub fn read_index(text: &str, label: &str) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| candle::Error::Msg(format!("{label}: not valid JSON: {e}")))?;
    let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
        bail!("{label}: field 'weight_map': missing or not an object {{\"tensor name\": \"shard file\"}}")
    };
    let mut shards: Vec<String> = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (tensor, shard) in map {
        let Some(shard) = shard.as_str() else {
            bail!("{label}: field 'weight_map.{tensor}': expected a shard file name, found {shard}")
        };
        let mut parts = Path::new(shard).components();
        let plain = matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None))
            && !shard.contains(['/', '\\', '\0']);
        if !plain {
            bail!(
                "{label}: field 'weight_map.{tensor}': shard '{shard}' is not a file name in the index's folder \
                 (paths such as '../x' or '/x' are refused)"
            )
        }
        if !shard.ends_with(".safetensors") {
            bail!(
                "{label}: field 'weight_map.{tensor}': shard '{shard}' is not a .safetensors file \
                 (pickled shards are not read: export them with safetensors)"
            )
        }
        if !shards.iter().any(|s| s == shard) {
            if shards.len() == MAX_SHARDS {
                bail!("{label}: field 'weight_map': more than {MAX_SHARDS} shards")
            }
            shards.push(shard.to_string());
        }
        weight_map.insert(tensor.clone(), shard.to_string());
    }
    if shards.is_empty() {
        bail!("{label}: field 'weight_map': empty, no tensor is listed")
    }
    Ok((shards, weight_map))
}

impl Checkpoint {
    /// Reads the shards an index (`model.safetensors.index.json`) lists
    /// from the index's folder, checks that each shard holds exactly the
    /// tensors the index puts in it, and merges them into one checkpoint
    /// labelled with the index's path. The shards stay mapped as files: no
    /// copy of the weights is made.
    pub fn read_sharded(index: &Path) -> Result<Self> {
        let label = index.display().to_string();
        let text = crate::formats::files::read_text(index, "index", crate::formats::files::MAX_CONFIG_BYTES)?;
        let (shards, weight_map) = read_index(&text, &label)?;
        let dir = index.parent().map(Path::to_path_buf).unwrap_or_default();
        let files = shards
            .iter()
            .map(|s| Checkpoint::read(&dir.join(s)))
            .collect::<Result<Vec<_>>>()?;
        let mut seen: HashMap<&str, &str> = HashMap::new();
        for (shard, file) in shards.iter().zip(&files) {
            for name in file.tensors().iter().map(|t| t.name.as_str()) {
                match weight_map.get(name) {
                    Some(s) if s == shard => {}
                    Some(s) => bail!(
                        "{label}: tensor '{name}' is in shard '{shard}', but the index puts it in '{s}'"
                    ),
                    None => {
                        bail!("{label}: shard '{shard}' holds tensor '{name}', which the index does not list")
                    }
                }
                if let Some(other) = seen.insert(name, shard) {
                    bail!("{label}: tensor '{name}' is in both '{other}' and '{shard}'")
                }
            }
        }
        if let Some((name, shard)) = weight_map.iter().find(|(n, _)| !seen.contains_key(n.as_str())) {
            bail!("{label}: the index puts tensor '{name}' in shard '{shard}', which does not hold it")
        }
        drop(seen);
        Ok(Checkpoint::merged(files, &label))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_paths_stay_in_the_folder() {
        for bad in [
            "../x.safetensors",
            "/etc/x.safetensors",
            "a/b.safetensors",
            "..",
            "",
            "x.bin",
            "a\\b.safetensors",
        ] {
            let json = format!(r#"{{"weight_map": {{"w": "{}"}}}}"#, bad.replace('\\', "\\\\"));
            let err = read_index(&json, "i.json").unwrap_err().to_string();
            assert!(err.starts_with("i.json: field 'weight_map.w'"), "{bad}: {err}");
        }
        let (shards, map) = read_index(
            r#"{"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}"#,
            "i",
        )
        .unwrap_or_default();
        assert_eq!(shards, ["s1.safetensors"]);
        assert_eq!(map.len(), 2);
        for bad in [
            r#"{"weight_map": []}"#,
            r#"{"weight_map": {}}"#,
            "[",
            r#"{"weight_map": {"a": 1}}"#,
        ] {
            assert!(
                read_index(bad, "i.json")
                    .unwrap_err()
                    .to_string()
                    .contains("i.json"),
                "{bad}"
            );
        }
    }
}
