//! Structured output: the request fields that constrain the output to a grammar, and the
//! grammar that forces a tool call.
//!
//! Accepted (at most one per request; each maps to an [`GrammarSpec`]):
//! - `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
//!   `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (OpenAI);
//! - `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ..}` (vLLM);
//! - the older vLLM names `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
//!
//! `grammar`/`guided_grammar` is llguidance's Lark syntax. Forced tool calls
//! ([`tool_call_grammar`]) are a Lark grammar of the Qwen3.5 XML call format, with each
//! parameter value following its JSON schema.

use orchid_engine::constraint::{GrammarSpec, lark_string, with_options};
use serde_json::{Map, Value};

use crate::errors::ApiError;

/// A request's output constraint and the field it came from (named in errors).
#[derive(Clone, Debug, PartialEq)]
pub struct Structured {
    pub field: String,
    pub spec: GrammarSpec,
}

type Result<T> = std::result::Result<T, ApiError>;

/// The constraint a request asks for, if any (see the module docs).
pub fn request_constraint(body: &Map<String, Value>) -> Result<Option<Structured>> {
    let mut found: Vec<Structured> = Vec::new();
    let get = |k: &str| body.get(k).filter(|v| !v.is_null());
    if let Some(rf) = get("response_format")
        && let Some(spec) = response_format(rf)?
    {
        found.push(Structured { field: "response_format".into(), spec });
    }
    if let Some(so) = get("structured_outputs") {
        let Value::Object(o) = so else {
            return Err(ApiError::invalid("structured_outputs", "`structured_outputs` must be an object"));
        };
        for (k, v) in o {
            let field = format!("structured_outputs.{k}");
            match k.as_str() {
                // Output is always compact and there is no fallback backend: nothing to do.
                "disable_any_whitespace" | "disable_fallback" => {
                    if !v.is_boolean() && !v.is_null() {
                        return Err(ApiError::invalid(&field, format!("`{field}` must be a boolean")));
                    }
                }
                "json_object" => {
                    if v.as_bool() == Some(true) {
                        found.push(Structured { field, spec: GrammarSpec::JsonObject });
                    } else if !v.is_null() && !v.is_boolean() {
                        return Err(ApiError::invalid(&field, format!("`{field}` must be a boolean")));
                    }
                }
                "json" | "regex" | "choice" | "grammar" => {
                    if !v.is_null() {
                        found.push(Structured { spec: guided(k, &field, v)?, field });
                    }
                }
                _ => {
                    return Err(ApiError::invalid(
                        &field,
                        format!("`{field}` is not supported (supported: json, regex, choice, grammar, json_object)"),
                    ));
                }
            }
        }
    }
    for k in ["json", "regex", "choice", "grammar"] {
        let field = format!("guided_{k}");
        if let Some(v) = get(&field) {
            found.push(Structured { spec: guided(k, &field, v)?, field });
        }
    }
    if get("guided_whitespace_pattern").is_some() {
        return Err(ApiError::invalid(
            "guided_whitespace_pattern",
            "`guided_whitespace_pattern` is not supported: JSON output is always compact",
        ));
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            &found[1].field,
            format!("`{}` and `{}` both constrain the output; give only one", found[0].field, found[1].field),
        ));
    }
    Ok(found.pop())
}

fn response_format(rf: &Value) -> Result<Option<GrammarSpec>> {
    let Some(t) = rf.get("type").and_then(Value::as_str) else {
        return Err(ApiError::invalid("response_format", "`response_format` must be an object with a `type`"));
    };
    match t {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        "json_schema" => {
            let Some(js) = rf.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "`response_format.json_schema` must be an object with a `schema`",
                ));
            };
            match js.get("schema") {
                None | Some(Value::Null) => Ok(Some(GrammarSpec::JsonObject)),
                Some(s @ (Value::Object(_) | Value::Bool(true))) => Ok(Some(GrammarSpec::JsonSchema(s.clone()))),
                Some(_) => Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "`response_format.json_schema.schema` must be a JSON schema object",
                )),
            }
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!("`response_format` type `{other}` is not supported (text, json_object, json_schema)"),
        )),
    }
}

/// One vLLM-style constraint: `kind` is json, regex, choice or grammar.
fn guided(kind: &str, field: &str, v: &Value) -> Result<GrammarSpec> {
    let bad = |what: &str| ApiError::invalid(field, format!("`{field}` must be {what}"));
    match kind {
        "json" => match v {
            Value::Object(_) => Ok(GrammarSpec::JsonSchema(v.clone())),
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(s @ Value::Object(_)) => Ok(GrammarSpec::JsonSchema(s)),
                _ => Err(bad("a JSON schema (an object, or a string holding one)")),
            },
            _ => Err(bad("a JSON schema (an object, or a string holding one)")),
        },
        "regex" => v.as_str().map(|s| GrammarSpec::Regex(s.to_string())).ok_or_else(|| bad("a string")),
        "grammar" => v.as_str().map(|s| GrammarSpec::Lark(s.to_string())).ok_or_else(|| bad("a string (Lark grammar)")),
        _ => {
            let choices = v
                .as_array()
                .filter(|a| !a.is_empty())
                .and_then(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect::<Option<Vec<_>>>())
                .ok_or_else(|| bad("a non-empty list of strings"))?;
            Ok(GrammarSpec::Choice(choices))
        }
    }
}

/// A Lark grammar for the tool calls a `tool_choice` of `required` (`only` = None) or a
/// named function (`only` = its name) must produce, in the Qwen3.5 XML format:
///
/// ```text
/// <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>
/// ```
///
/// `prefix` is the start of the first call already written into the prompt (e.g.
/// `<tool_call>\n<function=`); the grammar continues after it. The newlines next to the tags
/// are optional (the parser reads both forms). Parameters come in the schema's order,
/// required ones always, optional ones may be left out; a value whose schema allows a string
/// is raw text (an `enum` is its literal values, a `pattern` its regex) without `<`, any
/// other value is JSON following its schema. With `parallel` more calls may follow
/// (separated by a newline); the grammar ends after the last call, so the model can only
/// stop there.
pub fn tool_call_grammar(tools: &[Value], only: Option<&str>, parallel: bool, prefix: &str) -> String {
    let mut rules = vec!["NL: \"\\n\"".to_string()];
    let (mut calls, mut firsts) = (Vec::new(), Vec::new());
    for (i, t) in tools.iter().enumerate() {
        let Some(f) = t.get("function") else { continue };
        let Some(name) = f.get("name").and_then(Value::as_str) else { continue };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let params = f.get("parameters");
        let props = params.and_then(|p| p.get("properties")).and_then(Value::as_object).cloned().unwrap_or_default();
        let required: Vec<&str> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let defs = Defs::of(params);
        let mut body = Vec::new();
        for (j, (p, schema)) in props.iter().enumerate() {
            let rule = format!("p_{i}_{j}");
            match value_grammar(schema, &defs) {
                ValueGrammar::Json(json) => {
                    let open = lark_string(&format!("<parameter={p}>"));
                    rules.push(format!("{rule}: {open} NL? v_{i}_{j} NL? {} NL?", lark_string("</parameter>")));
                    rules.push(format!("v_{i}_{j}: {json}"));
                }
                // Raw text: the whole parameter is one terminal, so that a token may run from
                // the tag into the text (`>E`) as the tokenizer may write it.
                ValueGrammar::Text(rx) => {
                    let whole = format!("<parameter={}>\\n?{rx}\\n?</parameter>\\n?", regex_escape(p));
                    rules.push(format!("{rule}: P_{i}_{j}"));
                    rules.push(format!("P_{i}_{j}: /{}/", whole.replace('/', "\\/")));
                }
            }
            body.push(if required.contains(&p.as_str()) { rule } else { format!("{rule}?") });
        }
        body.push(format!("{} NL? {}", lark_string("</function>"), lark_string("</tool_call>")));
        let header = format!("<tool_call>\n<function={name}>");
        rules.push(format!("call_{i}: {} NL? {}", lark_string(&header), body.join(" ")));
        calls.push(format!("call_{i}"));
        let rest = if prefix == format!("{header}\n") {
            Some(String::new())
        } else {
            header.strip_prefix(prefix).map(|r| if r.is_empty() { "NL?".to_string() } else { format!("{} NL?", lark_string(r)) })
        };
        if let Some(rest) = rest {
            rules.push(format!("first_{i}: {rest} {}", body.join(" ")));
            firsts.push(format!("first_{i}"));
        }
    }
    let start = if parallel { "start: first (NL call)*" } else { "start: first" };
    format!("{start}\nfirst: {}\ncall: {}\n{}\n", firsts.join(" | "), calls.join(" | "), rules.join("\n"))
}

/// The grammar of one parameter value (see [`tool_call_grammar`]).
enum ValueGrammar {
    /// JSON following the schema (a Lark `%json {..}` item).
    Json(String),
    /// Raw text matching this regex.
    Text(String),
}

fn value_grammar(schema: &Value, defs: &Defs) -> ValueGrammar {
    let schema = defs.resolve(schema);
    if !allows_string(schema) {
        return ValueGrammar::Json(format!("%json {}", with_options(defs.attach(schema))));
    }
    if let Some(vals) = schema.get("enum").and_then(Value::as_array).filter(|v| !v.is_empty()) {
        let alts: Vec<String> = vals
            .iter()
            .map(|v| match v {
                Value::String(s) => regex_escape(s),
                other => regex_escape(&other.to_string()),
            })
            .collect();
        return ValueGrammar::Text(format!("(?:{})", alts.join("|")));
    }
    if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
        let p = p.strip_prefix('^').unwrap_or(p);
        let p = p.strip_suffix('$').filter(|q| !q.ends_with('\\')).unwrap_or(p);
        return ValueGrammar::Text(format!("(?:{p})"));
    }
    let bound = |k: &str| schema.get(k).and_then(Value::as_u64);
    ValueGrammar::Text(match (bound("minLength"), bound("maxLength")) {
        // A length bound: one line of text (the newlines around it are the call's framing).
        (None, None) => "[^<]*".to_string(),
        (lo, Some(hi)) => format!("[^<\\n]{{{},{}}}", lo.unwrap_or(0).min(hi), hi),
        (Some(lo), None) => format!("[^<\\n]{{{lo},}}"),
    })
}

/// The definitions of a tool's parameter schema (`$defs`, or the older `definitions`), which its
/// parameters' local references (`#/$defs/Name`, as pydantic writes nested models and enums)
/// point into: a parameter's schema is compiled on its own, so they go with it.
struct Defs(Map<String, Value>);

impl Defs {
    fn of(params: Option<&Value>) -> Defs {
        let mut m = Map::new();
        for key in ["$defs", "definitions"] {
            if let Some(d) = params.and_then(|p| p.get(key)) {
                m.insert(key.to_string(), d.clone());
            }
        }
        Defs(m)
    }

    /// The schema a local reference names (followed a few times), else `schema` itself.
    fn resolve<'a>(&'a self, mut schema: &'a Value) -> &'a Value {
        for _ in 0..8 {
            let Some(r) = schema.get("$ref").and_then(Value::as_str) else { break };
            let target = ["$defs", "definitions"].iter().find_map(|k| {
                let name = r.strip_prefix(&format!("#/{k}/"))?;
                self.0.get(*k)?.get(name)
            });
            match target {
                Some(t) => schema = t,
                None => break,
            }
        }
        schema
    }

    /// `schema` with the definitions beside it, so that its references resolve.
    fn attach(&self, schema: &Value) -> Value {
        let mut s = schema.clone();
        if let Value::Object(o) = &mut s {
            for (k, v) in &self.0 {
                o.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        s
    }
}

/// `s` matched literally in a regex.
fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

/// Whether a value written as raw text may be a string under `schema` (no type: anything).
fn allows_string(schema: &Value) -> bool {
    let mut any_type = false;
    match schema.get("type") {
        Some(Value::String(t)) => return t == "string",
        Some(Value::Array(ts)) => return ts.iter().any(|t| t == "string"),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(alts)) = schema.get(key) {
            any_type = true;
            if alts.iter().any(allows_string) {
                return true;
            }
        }
    }
    if let Some(Value::Array(vals)) = schema.get("enum") {
        return vals.iter().all(Value::is_string);
    }
    if schema.get("const").is_some() {
        return schema.get("const").is_some_and(Value::is_string);
    }
    !any_type && schema.get("properties").is_none() && schema.get("items").is_none() && schema.get("$ref").is_none()
}

#[cfg(test)]
#[path = "structured_tests.rs"]
mod tests;
