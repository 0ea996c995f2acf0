//! Typing tool-call argument values by the tool's JSON schema.
//!
//! Qwen3.5's XML calls write every parameter value as raw text (`<parameter=n>\n3\n</parameter>`);
//! objects and arrays are written as JSON. The OpenAI `arguments` string must be JSON with
//! the types the tool declared, so each value is converted by its parameter's schema type:
//! `integer`/`number` -> number, `boolean` -> bool, `null`, `object`/`array` -> parsed JSON,
//! `string` -> the raw text. A union (`"type": [..]`, `anyOf`, `oneOf`) tries the non-string
//! types first. A value that fits none of the declared types, a parameter the schema does not
//! declare, or a tool without a schema keeps the text as a string (objects and arrays written
//! as JSON are still parsed), so nothing the model wrote is lost.

use std::collections::HashMap;

use serde_json::{Map, Value};

/// Parameter schemas of the request's tools, by function name.
#[derive(Clone, Debug, Default)]
pub struct ToolSchemas {
    properties: HashMap<String, Map<String, Value>>,
}

impl ToolSchemas {
    /// From OpenAI tool objects (`{"type": "function", "function": {"name", "parameters"}}`).
    pub fn from_tools(tools: &[Value]) -> ToolSchemas {
        let mut properties = HashMap::new();
        for t in tools {
            let Some(f) = t.get("function") else { continue };
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                continue;
            };
            let props = f.get("parameters").and_then(|p| p.get("properties")).and_then(Value::as_object).cloned().unwrap_or_default();
            properties.insert(name.to_string(), props);
        }
        ToolSchemas { properties }
    }

    /// The JSON value of parameter `param` of function `func`, written as `raw`.
    pub fn convert(&self, func: &str, param: &str, raw: &str) -> Value {
        let types = self.properties.get(func).and_then(|p| p.get(param)).map(schema_types).unwrap_or_default();
        convert(raw, &types)
    }
}

/// The type names a parameter schema allows, in order of preference.
fn schema_types(schema: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t.clone()),
        Some(Value::Array(ts)) => out.extend(ts.iter().filter_map(Value::as_str).map(str::to_string)),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(alts)) = schema.get(key) {
            for alt in alts {
                out.extend(schema_types(alt));
            }
        }
    }
    if out.is_empty()
        && let Some(Value::Array(vals)) = schema.get("enum")
    {
        // An enum without a type: the types of its members.
        for v in vals {
            let t = match v {
                Value::String(_) => "string",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
                Value::Number(_) => "number",
                Value::Null => "null",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            };
            if !out.iter().any(|x| x == t) {
                out.push(t.to_string());
            }
        }
    }
    out
}

/// Converts `raw` to the first of `types` it fits (see the module docs).
pub fn convert(raw: &str, types: &[String]) -> Value {
    for t in types.iter().filter(|t| t.as_str() != "string") {
        if let Some(v) = as_type(raw, t) {
            return v;
        }
    }
    if !types.iter().any(|t| t == "string") {
        // Untyped, or no declared type fits: JSON containers are still structure.
        if let Ok(v @ (Value::Object(_) | Value::Array(_))) = serde_json::from_str::<Value>(raw.trim()) {
            return v;
        }
    }
    Value::String(raw.to_string())
}

fn as_type(raw: &str, t: &str) -> Option<Value> {
    let s = raw.trim();
    match t {
        "integer" => {
            if let Ok(i) = s.parse::<i64>() {
                return Some(Value::from(i));
            }
            if let Ok(u) = s.parse::<u64>() {
                return Some(Value::from(u));
            }
            // `3.0` for an integer parameter.
            let f = s.parse::<f64>().ok().filter(|f| f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15)?;
            Some(Value::from(f as i64))
        }
        "number" => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Number(_)) => Some(v),
            _ => None,
        },
        "boolean" => match s.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        "null" => matches!(s, "null" | "None").then_some(Value::Null),
        "object" => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => Some(v),
            _ => None,
        },
        "array" => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Array(_)) => Some(v),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schemas() -> ToolSchemas {
        ToolSchemas::from_tools(&[json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
                "o": {"type": "object"}, "a": {"type": "array", "items": {"type": "string"}},
                "s": {"type": "string"}, "opt": {"type": ["integer", "null"]},
                "u": {"anyOf": [{"type": "string"}, {"type": "number"}]},
                "e": {"enum": [1, 2, 3]},
            }
        }}})])
    }

    #[test]
    fn typed_by_schema() {
        let s = schemas();
        assert_eq!(s.convert("f", "n", "42"), json!(42));
        assert_eq!(s.convert("f", "n", " 7.0 "), json!(7));
        assert_eq!(s.convert("f", "n", "-3"), json!(-3));
        assert_eq!(s.convert("f", "x", "2.5"), json!(2.5));
        assert_eq!(s.convert("f", "x", "1e3"), json!(1000.0));
        assert_eq!(s.convert("f", "b", "True"), json!(true));
        assert_eq!(s.convert("f", "b", "false"), json!(false));
        assert_eq!(s.convert("f", "o", "{\"k\": [1, {\"z\": null}]}"), json!({"k": [1, {"z": null}]}));
        assert_eq!(s.convert("f", "a", "[\"p\", \"q\"]"), json!(["p", "q"]));
        assert_eq!(s.convert("f", "s", "123"), json!("123"));
        assert_eq!(s.convert("f", "s", "  spaced \n text"), json!("  spaced \n text"));
        assert_eq!(s.convert("f", "opt", "null"), json!(null));
        assert_eq!(s.convert("f", "opt", "5"), json!(5));
        assert_eq!(s.convert("f", "u", "5"), json!(5));
        assert_eq!(s.convert("f", "u", "five"), json!("five"));
        assert_eq!(s.convert("f", "e", "2"), json!(2));
    }

    #[test]
    fn mismatches_keep_the_text() {
        let s = schemas();
        assert_eq!(s.convert("f", "n", "many"), json!("many"));
        assert_eq!(s.convert("f", "b", "yes"), json!("yes"));
        assert_eq!(s.convert("f", "o", "{broken"), json!("{broken"));
        assert_eq!(s.convert("f", "x", "NaN"), json!("NaN"));
        // Undeclared parameter / unknown tool: strings, but JSON containers parse.
        assert_eq!(s.convert("f", "zzz", "12"), json!("12"));
        assert_eq!(s.convert("g", "p", "[1, 2]"), json!([1, 2]));
        assert_eq!(s.convert("g", "p", "{\"a\": 1}"), json!({"a": 1}));
    }
}
