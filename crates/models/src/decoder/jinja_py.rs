//! What HF's chat-template environment (Jinja2, with the filters and
//! functions `transformers/utils/chat_template_utils.py` adds) does that
//! MiniJinja does differently: Python's `json.dumps` behind `tojson`, its
//! float `repr`, Jinja's forgiving `int` and `float` filters, the
//! `iterable` test (`none` is not), `strftime_now`, HF's `{% generation %}` tag, and a depth bound on the
//! values a template prints (Python stops deep ones with a
//! `RecursionError`; printing one here would overflow the stack).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Deepest nesting of lists and dicts a template may print or pass to
/// `tojson` (Python's own recursion limit is 1000 frames).
const MAX_VALUE_DEPTH: usize = 256;

fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

/// Refuses a value nested deeper than [`MAX_VALUE_DEPTH`], walking it
/// without recursion.
fn check_depth(value: &Value) -> Result<(), Error> {
    let mut stack = vec![(value.clone(), 0usize)];
    while let Some((v, depth)) = stack.pop() {
        let kind = v.kind();
        if !matches!(kind, ValueKind::Seq | ValueKind::Map) {
            continue;
        }
        if depth >= MAX_VALUE_DEPTH {
            return Err(invalid(format!(
                "a value nested deeper than {MAX_VALUE_DEPTH} lists or dicts cannot be printed"
            )));
        }
        for item in v.try_iter()? {
            let child = if kind == ValueKind::Map {
                v.get_item(&item)?
            } else {
                item
            };
            stack.push((child, depth + 1));
        }
    }
    Ok(())
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: `json.dumps` with those arguments; dicts keep their
/// insertion order, as Python's do.
pub(super) fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => Some(" ".repeat(i64::try_from(v)?.clamp(0, 64) as usize)),
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            return Err(invalid(format!(
                "tojson: indent must be a number or a string, found {v}"
            )))
        }
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid("tojson: separators must be two strings".into()))?;
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => return Err(invalid("tojson: separators must be two strings".into())),
            }
        }
        // Python's defaults: ", " without indent, "," with it.
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let opts = JsonOptions {
        indent,
        separators,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(out)
}

struct JsonOptions {
    indent: Option<String>,
    /// Between items, between a key and its value.
    separators: (String, String),
    ensure_ascii: bool,
    sort_keys: bool,
}

fn write_json(out: &mut String, value: &Value, opts: &JsonOptions, depth: usize) -> Result<(), Error> {
    if depth > MAX_VALUE_DEPTH {
        return Err(invalid(format!(
            "tojson: a value nested deeper than {MAX_VALUE_DEPTH} lists or dicts"
        )));
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let x = f64::try_from(value.clone())?;
            out.push_str(&match x {
                x if x.is_nan() => "NaN".into(),
                f64::INFINITY => "Infinity".into(),
                f64::NEG_INFINITY => "-Infinity".into(),
                x => float_repr(x),
            });
        }
        ValueKind::String => json_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_items(out, ('[', ']'), items.len(), opts, depth, |out, i| {
                write_json(out, &items[i], opts, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            write_items(out, ('{', '}'), keys.len(), opts, depth, |out, i| {
                let key = &keys[i];
                match key.as_str() {
                    Some(k) => json_string(out, k, opts.ensure_ascii),
                    // json.dumps writes number and bool keys as strings.
                    None => json_string(out, &key.to_string(), opts.ensure_ascii),
                }
                out.push_str(&opts.separators.1);
                write_json(out, &value.get_item(key)?, opts, depth + 1)
            })?;
        }
        _ => {
            return Err(invalid(format!(
                "tojson: Object of type {} is not JSON serializable",
                value.kind()
            )))
        }
    }
    Ok(())
}

/// `[a, b]` / `{..}` with `json.dumps`'s separators and indentation.
fn write_items(
    out: &mut String,
    (open, close): (char, char),
    n: usize,
    opts: &JsonOptions,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &opts.indent {
            out.push('\n');
            (0..level).for_each(|_| out.push_str(indent));
        }
    };
    for i in 0..n {
        if i > 0 {
            out.push_str(&opts.separators.0);
        }
        newline(out, depth + 1);
        item(out, i)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// A JSON string as `json.dumps` writes it: `\"`, `\\`, `\n`, `\r`,
/// `\t`, `\b`, `\f`, other control characters as `\u00XX`, and with
/// `ensure_ascii` every non-ASCII character as `\uXXXX` (surrogate pairs
/// past U+FFFF).
fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr` of a finite float: the shortest digits that read back
/// the same, fixed-point for exponents -4..16 (`0.0001`, `100.0`),
/// scientific otherwise with a sign and at least two exponent digits
/// (`3e-07`, `1e+16`).
fn float_repr(x: f64) -> String {
    // Rust's `{:e}` gives the same shortest digits: "-1.25e-7", "3e0".
    let sci = format!("{x:e}");
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return sci;
    };
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    if !(-4..16).contains(&exp) {
        return format!(
            "{sign}{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        );
    }
    let digits: String = mantissa.chars().filter(|&c| c != '.').collect();
    let body = if exp < 0 {
        format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
    } else {
        let point = exp as usize + 1;
        if digits.len() <= point {
            format!("{digits}{}.0", "0".repeat(point - digits.len()))
        } else {
            format!("{}.{}", &digits[..point], &digits[point..])
        }
    };
    format!("{sign}{body}")
}

/// Prints a value as Jinja2 does where MiniJinja differs: floats as
/// Python's `str`, and no value nested past [`MAX_VALUE_DEPTH`].
pub(super) fn formatter(
    out: &mut minijinja::Output,
    state: &mut minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    if value.is_number() && !value.is_integer() {
        if let Ok(x) = f64::try_from(value.clone()) {
            let text = match x {
                x if x.is_nan() => "nan".to_string(),
                f64::INFINITY => "inf".to_string(),
                f64::NEG_INFINITY => "-inf".to_string(),
                x => float_repr(x),
            };
            return out.write_str(&text).map_err(Error::from);
        }
    }
    check_depth(value)?;
    minijinja::escape_formatter(out, state, value)
}

/// `pprint`, refusing what [`check_depth`] refuses: MiniJinja's pretty
/// form of a value nested `n` deep indents `n` lines by up to `n` levels.
pub(super) fn pprint(value: Value) -> Result<String, Error> {
    check_depth(&value)?;
    Ok(format!("{value:#?}"))
}

/// Jinja2's `int(value, default=0, base=10)`: a string that is not a
/// number gives `default` (MiniJinja's `int` raises), as does any value
/// `int()` refuses. Unlike Python's, the integers are i64: past it they
/// saturate, and an infinite float gives `default` (Python raises).
pub(super) fn int_filter(value: Value, default: Option<Value>, base: Option<u32>) -> Result<Value, Error> {
    let default = default.unwrap_or(Value::from(0));
    if value.is_integer() {
        return Ok(value);
    }
    if value.kind() == ValueKind::Bool {
        return Ok(Value::from(i64::from(value.is_true())));
    }
    if value.is_number() {
        let x = f64::try_from(value)?;
        return Ok(if x.is_finite() {
            Value::from(x.trunc() as i64)
        } else {
            default
        });
    }
    let Some(text) = value.as_str() else {
        return Ok(default);
    };
    let text = text.trim().replace('_', "");
    let base = base.unwrap_or(10);
    if !(2..=36).contains(&base) {
        return Err(invalid(format!("int: base must be in 2..=36, found {base}")));
    }
    if let Ok(n) = i64::from_str_radix(&text, base) {
        return Ok(Value::from(n));
    }
    Ok(match text.parse::<f64>() {
        Ok(x) if x.is_finite() && base == 10 => Value::from(x.trunc() as i64),
        _ => default,
    })
}

/// Jinja2's `float(value, default=0.0)`.
pub(super) fn float_filter(value: Value, default: Option<Value>) -> Result<Value, Error> {
    let default = default.unwrap_or(Value::from(0.0));
    if value.is_number() {
        return Ok(Value::from(f64::try_from(value)?));
    }
    if value.kind() == ValueKind::Bool {
        return Ok(Value::from(if value.is_true() { 1.0 } else { 0.0 }));
    }
    Ok(
        match value.as_str().map(|t| t.trim().replace('_', "").parse::<f64>()) {
            Some(Ok(x)) => Value::from(x),
            _ => default,
        },
    )
}

/// Jinja2's `iterable` test: whether Python's `iter(value)` succeeds.
/// MiniJinja iterates `none` as empty and so calls it iterable; Python
/// does not, and templates lean on it: `tools is iterable and tools |
/// length > 0` (Qwen3-Coder's, Nemotron's) with `tools` none takes
/// `length` of none here unless the test is false. Undefined stays
/// iterable, as Jinja2's `Undefined` is.
pub(super) fn is_iterable(value: &Value) -> bool {
    !value.is_none() && value.try_iter().is_ok()
}

/// HF's `{% generation %}…{% endgeneration %}` (TRL's templates mark the
/// assistant's text with it for `return_assistant_tokens_mask`; it renders
/// its body unchanged) as an `if true` block, keeping its whitespace
/// control (`{%-`, `-%}`).
pub(super) fn generation_tags_as_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        // The tag's end, after its `{%` (`{%}` is no tag).
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, close) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &inner[inner.len() - 1..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => out.push_str(&format!("{{%{open} {r} {close}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// `datetime.now().strftime(format)` in UTC (no time-zone database is
/// read): `%Y %m %d %H %M %S %b %B %a %A %j %y %%`.
pub(super) fn strftime_utc(format: &str) -> Result<String, Error> {
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
                return Err(invalid(format!(
                    "strftime_now: %{} is not supported",
                    other.map(String::from).unwrap_or_default()
                )))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr_prints_them() {
        // [repr(x) for x in (3e-07, 1e16, 1e15, 0.0001, 100.0, -0.0, 1.5, 123456.789, 1e-05, 2.5e-308)]
        let cases = [
            (3e-07, "3e-07"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (100.0, "100.0"),
            (-0.0, "-0.0"),
            (1.5, "1.5"),
            (123456.789, "123456.789"),
            (1e-05, "1e-05"),
            (2.5e-308, "2.5e-308"),
        ];
        for (x, python) in cases {
            assert_eq!(float_repr(x), python, "{x}");
        }
    }

    #[test]
    fn generation_tags_become_blocks_with_their_whitespace_control() {
        assert_eq!(
            generation_tags_as_blocks("a{%- generation -%}b{% endgeneration %}{% if x %}"),
            "a{%- if true -%}b{% endif %}{% if x %}"
        );
        assert_eq!(generation_tags_as_blocks("{% generation"), "{% generation");
        // A `%}` overlapping the `{%` ends no tag.
        assert_eq!(generation_tags_as_blocks("e{%}x"), "e{%}x");
        assert_eq!(generation_tags_as_blocks("{%-%}{%%}"), "{%-%}{%%}");
    }

    #[test]
    fn strftime_now_writes_a_date() {
        let s = strftime_utc("%d %b %Y").unwrap();
        assert_eq!(s.len(), 11, "{s}");
        assert!(strftime_utc("%Q").is_err());
    }
}
