//! The Python side of HF chat templates, for minijinja: what transformers' jinja2 environment
//! does differently from minijinja's defaults, so that templates render byte-identically.
//!
//! - Printing (`{{ x }}`) and the `string` filter use Python `str()`: `True`/`False`/`None`,
//!   float `repr` (`1.0`, `1e-05`, `1e+16`), lists/dicts as Python reprs.
//! - `tojson` is transformers' override: `json.dumps(x, ensure_ascii=False, indent=None,
//!   separators=None, sort_keys=False)` (no HTML escaping; `, ` and `: ` separators, or `,` and
//!   `: ` with `indent`; key order kept).
//! - `trim` and the `strip`/`lstrip`/`rstrip`/`split`/`rsplit` methods use Python's whitespace
//!   (`str.isspace`, which adds U+001C..U+001F to Unicode White_Space) and split semantics;
//!   other Python methods come from `minijinja_contrib::pycompat`.
//! - Tests `sequence` / `iterable` follow jinja2 (strings and dicts are sequences).
//! - `raise_exception(msg)` fails the render with [`Raised`]; `strftime_now(fmt)` formats the
//!   current time (UTC; Python uses local time, which is the same on a machine set to UTC).
//!
//! Known gaps (not used by Qwen templates): the `~` operator and `join` format numbers the
//! minijinja way (`true`, not `True`); Python `repr` of strings escapes only ASCII/Latin-1
//! control characters and common invisible code points; integers beyond 64 bits are floats.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind, from_args};
use minijinja::{Environment, Error, ErrorKind, State, Value};

/// The error a template's `raise_exception(msg)` produces (carried as the error's source).
#[derive(Debug, Clone)]
pub struct Raised(pub String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// Registers everything listed in the module docs on `env`.
pub(super) fn install(env: &mut Environment<'static>) {
    env.set_formatter(|out, _state, value| out.write_str(&py_str(value)).map_err(Error::from));
    env.set_unknown_method_callback(py_method);
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: &Value| py_str(v));
    env.add_filter("trim", |v: &Value, chars: Option<Value>| -> Result<String, Error> { strip(&py_str(v), chars.as_ref(), true, true) });
    env.add_test("sequence", |v: &Value| v.is_undefined() || matches!(v.kind(), ValueKind::Seq | ValueKind::String | ValueKind::Map));
    env.add_test("iterable", |v: &Value| {
        v.is_undefined() || matches!(v.kind(), ValueKind::Seq | ValueKind::String | ValueKind::Map | ValueKind::Iterable)
    });
    env.add_function("raise_exception", |msg: Value| -> Result<Value, Error> {
        let msg = py_str(&msg);
        Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
    });
    env.add_function("strftime_now", |fmt: String| super::strftime::strftime(&fmt, super::strftime::now_unix()));
}

// ---------------------------------------------------------------------------------------------
// Python str() / repr()

/// Python `str(value)` (what jinja2 prints).
pub(crate) fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python `repr(value)`.
fn py_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => "Undefined".into(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if v.is_integer() => v.to_string(),
        ValueKind::Number => py_float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN)),
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = v.try_iter().map(|it| it.map(|x| py_repr(&x)).collect()).unwrap_or_default();
            if v.is_tuple() {
                match items.len() {
                    1 => format!("({},)", items[0]),
                    _ => format!("({})", items.join(", ")),
                }
            } else {
                format!("[{}]", items.join(", "))
            }
        }
        ValueKind::Map => {
            let mut s = String::from("{");
            if let Ok(keys) = v.try_iter() {
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    let item = v.get_item(&k).unwrap_or_default();
                    let _ = write!(s, "{}: {}", py_repr(&k), py_repr(&item));
                }
            }
            s.push('}');
            s
        }
        _ => v.to_string(),
    }
}

fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) || c == '\u{ad}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            '\u{1680}' | '\u{2000}'..='\u{200f}' | '\u{2028}'..='\u{202f}' | '\u{205f}'..='\u{2064}' | '\u{3000}' | '\u{feff}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python `repr(float)`: the shortest round-trip digits, fixed notation for exponents in
/// -4..16, else `d.ddde+XX`.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-5".
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = match mant.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        let decpt = exp + 1;
        if decpt <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-decpt) as usize));
            out.push_str(&digits);
        } else if decpt >= n {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', (decpt - n) as usize));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.unsigned_abs());
    }
    out
}

// ---------------------------------------------------------------------------------------------
// tojson = json.dumps

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// `x|tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)` (positional
/// arguments in that order, as in transformers' Python signature).
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"));
    }
    let mut opt: [Option<Value>; 4] = Default::default();
    for (i, a) in args.iter().enumerate() {
        opt[i] = Some(a.clone());
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            opt[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = opt;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string"));
            }
        },
    };
    let (item_sep, key_sep) = match separators.filter(|s| !s.is_none()) {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some(s) => {
            let parts: Vec<Value> = s.try_iter()?.collect();
            match (parts.first().and_then(|p| p.as_str()), parts.get(1).and_then(|p| p.as_str())) {
                (Some(a), Some(b)) if parts.len() == 2 => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"));
                }
            }
        }
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(out: &mut String, v: &Value, st: &JsonStyle, depth: usize) -> Result<(), Error> {
    if depth > 500 {
        return Err(Error::new(ErrorKind::InvalidOperation, "tojson: value nested too deeply"));
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            let f = f64::try_from(v.clone())?;
            out.push_str(&match f {
                f if f.is_nan() => "NaN".into(),
                f if f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.into(),
                f => py_float_repr(f),
            });
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), st.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, st, depth, '[', ']', items.len(), |out, i| write_json(out, &items[i], st, depth + 1))?;
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let key = json_key(&k)?;
                entries.push((key, v.get_item(&k)?));
            }
            if st.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, st, depth, '{', '}', entries.len(), |out, i| {
                write_json_str(out, &entries[i].0, st.ensure_ascii);
                out.push_str(&st.key_sep);
                write_json(out, &entries[i].1, st, depth + 1)
            })?;
        }
        kind => {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: object of kind {kind} is not JSON serializable")));
        }
    }
    Ok(())
}

/// Writes `open item sep item ... close` with Python's indent layout.
fn write_container(
    out: &mut String,
    st: &JsonStyle,
    depth: usize,
    open: char,
    close: char,
    len: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &st.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    newline(out, depth + 1);
    for i in 0..len {
        if i > 0 {
            out.push_str(&st.item_sep);
            newline(out, depth + 1);
        }
        item(out, i)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Python's conversion of dict keys: str as is; int, float, bool, None to their JSON text.
fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
        ValueKind::None => "null".into(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => py_float_repr(f64::try_from(k.clone())?),
        kind => {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be str, not {kind}")));
        }
    })
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
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
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// Python string methods

fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `str.strip/lstrip/rstrip(chars=None)`.
fn strip(s: &str, chars: Option<&Value>, left: bool, right: bool) -> Result<String, Error> {
    let set: Option<Vec<char>> = match chars {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(c) => Some(c.chars().collect()),
            None => {
                return Err(Error::new(ErrorKind::InvalidOperation, "strip arg must be None or str"));
            }
        },
    };
    let pred = |c: char| match &set {
        None => is_py_space(c),
        Some(set) => set.contains(&c),
    };
    let mut t = s;
    if left {
        t = t.trim_start_matches(pred);
    }
    if right {
        t = t.trim_end_matches(pred);
    }
    Ok(t.to_string())
}

/// `str.split(sep=None, maxsplit=-1)` and `str.rsplit(..)`.
fn split(s: &str, sep: Option<&str>, maxsplit: i64, from_right: bool) -> Result<Vec<String>, Error> {
    let max = if maxsplit < 0 { usize::MAX } else { maxsplit as usize };
    match sep {
        Some("") => Err(Error::new(ErrorKind::InvalidOperation, "empty separator")),
        Some(sep) if from_right => {
            let mut v: Vec<String> = s.rsplitn(max.saturating_add(1), sep).map(String::from).collect();
            v.reverse();
            Ok(v)
        }
        Some(sep) => Ok(s.splitn(max.saturating_add(1), sep).map(String::from).collect()),
        None => {
            // Runs of whitespace separate; after `max` splits the rest is kept, stripped only
            // on the side the splitting came from.
            let chars: Vec<char> = if from_right { s.chars().rev().collect() } else { s.chars().collect() };
            let mut parts = Vec::new();
            let mut i = 0;
            while i < chars.len() {
                while i < chars.len() && is_py_space(chars[i]) {
                    i += 1;
                }
                if i == chars.len() {
                    break;
                }
                if parts.len() == max {
                    parts.push(chars[i..].to_vec());
                    break;
                }
                let start = i;
                while i < chars.len() && !is_py_space(chars[i]) {
                    i += 1;
                }
                parts.push(chars[start..i].to_vec());
            }
            let mut out: Vec<String> =
                parts.into_iter().map(|p| if from_right { p.into_iter().rev().collect() } else { p.into_iter().collect() }).collect();
            if from_right {
                out.reverse();
            }
            Ok(out)
        }
    }
}

fn py_method(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<Value>,) = from_args(args)?;
                let (l, r) = (method != "rstrip", method != "lstrip");
                return strip(s, chars.as_ref(), l, r).map(Value::from);
            }
            "split" | "rsplit" => {
                let (sep, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
                let sep = match &sep {
                    Some(v) if !v.is_none() => {
                        Some(v.as_str().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "split separator must be a string"))?)
                    }
                    _ => None,
                };
                let parts = split(s, sep, maxsplit.unwrap_or(-1), method == "rsplit")?;
                return Ok(Value::from(parts));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (100.0, "100.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.2345e-7, "1.2345e-07"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (123.456, "123.456"),
            (0.1 + 0.2, "0.30000000000000004"),
            (f64::INFINITY, "inf"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn python_split_and_strip() {
        let sp = |s: &str, sep: Option<&str>, n: i64| split(s, sep, n, false).unwrap();
        assert_eq!(sp("  a b  c ", None, -1), ["a", "b", "c"]);
        assert_eq!(sp("  a b  c ", None, 1), ["a", "b  c "]);
        assert_eq!(sp("a</think>b</think>c", Some("</think>"), -1), ["a", "b", "c"]);
        assert_eq!(sp("a,b,c", Some(","), 1), ["a", "b,c"]);
        assert_eq!(split("  a b  c ", None, 1, true).unwrap(), ["  a b", "c"]);
        assert_eq!(split("a,b,c", Some(","), 1, true).unwrap(), ["a,b", "c"]);
        assert!(split("abc", Some(""), -1, false).is_err());
        assert_eq!(strip("\u{1c} x \n", None, true, true).unwrap(), "x");
        assert_eq!(strip("\n\nx\n", Some(&Value::from("\n")), false, true).unwrap(), "\n\nx");
    }

    #[test]
    fn json_dumps_layouts() {
        let v = Value::from_pairs([
            ("b", Value::from(vec![Value::from(1), Value::from(2.5)])),
            ("a", Value::from("é\"\n\u{1}")),
            ("c", Value::from_pairs(Vec::<(&str, Value)>::new())),
        ]);
        let st = |indent: Option<&str>| JsonStyle {
            indent: indent.map(String::from),
            item_sep: if indent.is_some() { "," } else { ", " }.into(),
            key_sep: ": ".into(),
            ensure_ascii: false,
            sort_keys: false,
        };
        let mut out = String::new();
        write_json(&mut out, &v, &st(None), 0).unwrap();
        assert_eq!(out, r#"{"b": [1, 2.5], "a": "é\"\n\u0001", "c": {}}"#);
        let mut out = String::new();
        write_json(&mut out, &v, &st(Some("  ")), 0).unwrap();
        assert_eq!(out, "{\n  \"b\": [\n    1,\n    2.5\n  ],\n  \"a\": \"é\\\"\\n\\u0001\",\n  \"c\": {}\n}");
        let mut out = String::new();
        write_json_str(&mut out, "é😀", true);
        assert_eq!(out, r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn python_reprs() {
        let v = Value::from(vec![Value::from("it's"), Value::from(true), Value::from(()), Value::from(1.0)]);
        assert_eq!(py_str(&v), r#"["it's", True, None, 1.0]"#);
        assert_eq!(py_str(&Value::from_pairs([("k", "v")])), "{'k': 'v'}");
        assert_eq!(py_str(&Value::UNDEFINED), "");
    }
}
