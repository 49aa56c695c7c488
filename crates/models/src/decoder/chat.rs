//! Chat templates: a folder's `chat_template.jinja` (transformers 5) or
//! `tokenizer_config.json`'s `chat_template`, rendered with MiniJinja the
//! way HF's `apply_chat_template` renders it with Jinja2: blocks trimmed
//! (`trim_blocks`, `lstrip_blocks`), `break` / `continue`,
//! `raise_exception`, `strftime_now`, a `tojson` that writes what Python's
//! `json.dumps` writes, the Python string methods templates call, and the
//! tokenizer's special tokens (`bos_token`, ...) as variables. A template
//! is untrusted code: MiniJinja cannot reach the file system, and fuel
//! bounds the work of one rendering.

use std::collections::BTreeMap;
use std::path::Path;

use candle::{bail, Result};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;

use crate::files::{read_text, MAX_CONFIG_BYTES};
use crate::vit::folder::json::{parse_object, short};

/// Instructions one rendering may run: a long conversation through a real
/// template takes a few thousand; a template that loops over huge ranges
/// is stopped.
const FUEL: u64 = 5_000_000;

/// Most bytes a rendered conversation may have.
const MAX_RENDERED_BYTES: usize = 16 << 20;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A folder's chat template with the special tokens it may use.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    label: String,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token`, ... as text.
    special: BTreeMap<String, String>,
}

impl ChatTemplate {
    /// The template of `dir`: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or HF's list of
    /// named templates, of which `default` is taken); `None` when the
    /// folder has none.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            let label = config_path.display().to_string();
            let text = read_text(&config_path, "tokenizer config", MAX_CONFIG_BYTES)?;
            Some((parse_object(&text, &label)?, label))
        } else {
            None
        };
        let special = config
            .as_ref()
            .map(|(map, label)| special_tokens(map, label))
            .transpose()?
            .unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let source = read_text(&jinja, "chat template", MAX_CONFIG_BYTES)?;
            return Self::new(source, &jinja.display().to_string(), special).map(Some);
        }
        let Some((map, label)) = config else {
            return Ok(None);
        };
        let source = match map.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(named)) => {
                let default = named
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"));
                match default.and_then(|t| t.get("template")).and_then(Json::as_str) {
                    Some(s) => s.to_string(),
                    None => bail!("{label}: field 'chat_template' lists templates but none named 'default'"),
                }
            }
            Some(other) => bail!(
                "{label}: field 'chat_template' must be a string or a list of named templates, found {}",
                short(other)
            ),
        };
        Self::new(source, &format!("{label} (chat_template)"), special).map(Some)
    }

    /// A template from its source; `label` names it in errors. It is
    /// compiled once here so that a syntax error comes at load time.
    pub fn new(source: String, label: &str, special: BTreeMap<String, String>) -> Result<Self> {
        let t = Self {
            source,
            label: label.to_string(),
            special,
        };
        t.environment()
            .template_from_str(&t.source)
            .map_err(|e| t.error("does not compile", &e))?;
        Ok(t)
    }

    /// Where the template came from.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The conversation as the model reads it; with
    /// `add_generation_prompt`, followed by the start of the assistant's
    /// turn. Tokenize the result without adding special tokens (the
    /// template writes them), as `apply_chat_template` does.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let env = self.environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| self.error("does not compile", &e))?;
        let mut ctx: BTreeMap<String, Value> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages".into(), Value::from(minijinja::value::Serde(messages)));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        let text = template
            .render(context! { ..Value::from(ctx) })
            .map_err(|e| self.error("failed", &e))?;
        if text.len() > MAX_RENDERED_BYTES {
            bail!(
                "{}: the rendered conversation is {} bytes, over the limit of {MAX_RENDERED_BYTES}",
                self.label,
                text.len()
            )
        }
        Ok(text)
    }

    fn error(&self, what: &str, e: &Error) -> candle::Error {
        // A template's own `raise_exception` message is the user's answer.
        let detail = match (e.kind(), e.detail()) {
            (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
            _ => e.to_string(),
        };
        candle::Error::Msg(format!("{}: the chat template {what}: {detail}", self.label))
    }

    /// HF's Jinja environment, in MiniJinja.
    fn environment(&self) -> Environment<'static> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build();
        if let Ok(syntax) = syntax {
            env.set_syntax(syntax);
        }
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_utc(&format));
        env.add_filter(
            "tojson",
            |value: Value, indent: Option<usize>| -> std::result::Result<String, Error> {
                let json = serde_json::to_value(&value)
                    .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
                Ok(python_json(&json, indent, 0))
            },
        );
        env
    }
}

/// The special tokens `tokenizer_config.json` names (`bos_token`,
/// `eos_token`, ...), each a string or an `AddedToken` object.
fn special_tokens(map: &serde_json::Map<String, Json>, label: &str) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ] {
        let text = match map.get(key) {
            None | Some(Json::Null) => continue,
            Some(Json::String(s)) => s.clone(),
            Some(Json::Object(o)) => match o.get("content").and_then(Json::as_str) {
                Some(s) => s.to_string(),
                None => bail!("{label}: field '{key}.content' must be a string"),
            },
            Some(other) => bail!(
                "{label}: field '{key}' must be a string or a token object, found {}",
                short(other)
            ),
        };
        out.insert(key.to_string(), text);
    }
    Ok(out)
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)`: Python's
/// separators (`", "` and `": "`, or `","` at line ends when indenting).
fn python_json(value: &Json, indent: Option<usize>, depth: usize) -> String {
    let (open_sep, item_sep, close_sep) = match indent {
        Some(n) => (
            format!("\n{}", " ".repeat(n * (depth + 1))),
            format!(",\n{}", " ".repeat(n * (depth + 1))),
            format!("\n{}", " ".repeat(n * depth)),
        ),
        None => (String::new(), ", ".to_string(), String::new()),
    };
    match value {
        Json::Array(items) if !items.is_empty() => {
            let inner: Vec<String> = items.iter().map(|v| python_json(v, indent, depth + 1)).collect();
            format!("[{open_sep}{}{close_sep}]", inner.join(&item_sep))
        }
        Json::Object(map) if !map.is_empty() => {
            let inner: Vec<String> = map
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{}: {}",
                        Json::String(k.clone()),
                        python_json(v, indent, depth + 1)
                    )
                })
                .collect();
            format!("{{{open_sep}{}{close_sep}}}", inner.join(&item_sep))
        }
        Json::Null => "null".into(),
        other => other.to_string(),
    }
}

/// `datetime.now().strftime(format)` in UTC (no time-zone database is
/// read): `%Y %m %d %H %M %S %b %B %a %A %j %y %%`.
fn strftime_utc(format: &str) -> std::result::Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(month - 1) as usize];
    let yday = before + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: %{} is not supported",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_writes_what_python_writes() {
        let v: Json = serde_json::from_str(r#"{"a": [1, "é", null], "b": {}}"#).unwrap();
        // json.dumps({"a": [1, "é", None], "b": {}}, ensure_ascii=False)
        assert_eq!(python_json(&v, None, 0), r#"{"a": [1, "é", null], "b": {}}"#);
        // ... indent=2
        assert_eq!(
            python_json(&v, Some(2), 0),
            "{\n  \"a\": [\n    1,\n    \"é\",\n    null\n  ],\n  \"b\": {}\n}"
        );
    }

    #[test]
    fn strftime_now_writes_a_date() {
        let s = strftime_utc("%d %b %Y").unwrap();
        assert_eq!(s.len(), 11, "{s}");
        assert!(strftime_utc("%Q").is_err());
    }

    #[test]
    fn a_template_that_loops_for_ever_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".into(),
            "hostile",
            BTreeMap::new(),
        )
        .unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(
            err.contains("hostile: the chat template failed") && err.contains("fuel"),
            "{err}"
        );
    }
}
