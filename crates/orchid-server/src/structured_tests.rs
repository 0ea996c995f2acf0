use std::path::PathBuf;
use std::sync::Arc;

use orchid_engine::Tokenizer;
use orchid_engine::constraint::Grammars;
use serde_json::json;

use super::*;
use crate::tool_parser::{ToolCallParser, ToolEvent};
use crate::tool_schema::ToolSchemas;

fn body(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn param(v: Value) -> String {
    request_constraint(&body(v)).unwrap_err().param.unwrap()
}

#[test]
fn fields_map_to_one_grammar() {
    let spec = |v: Value| request_constraint(&body(v)).unwrap().map(|s| (s.field, s.spec));
    assert_eq!(spec(json!({"response_format": {"type": "text"}})), None);
    assert_eq!(spec(json!({})), None);
    assert_eq!(spec(json!({"response_format": {"type": "json_object"}})), Some(("response_format".into(), GrammarSpec::JsonObject)));
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        spec(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}})),
        Some(("response_format".into(), GrammarSpec::JsonSchema(schema.clone())))
    );
    assert_eq!(spec(json!({"guided_json": schema.to_string()})), Some(("guided_json".into(), GrammarSpec::JsonSchema(schema.clone()))));
    assert_eq!(
        spec(json!({"structured_outputs": {"choice": ["a", "b"]}})),
        Some(("structured_outputs.choice".into(), GrammarSpec::Choice(vec!["a".into(), "b".into()])))
    );
    assert_eq!(spec(json!({"guided_regex": "a+"})), Some(("guided_regex".into(), GrammarSpec::Regex("a+".into()))));
    assert_eq!(
        spec(json!({"structured_outputs": {"grammar": "start: \"x\"", "disable_fallback": true}})),
        Some(("structured_outputs.grammar".into(), GrammarSpec::Lark("start: \"x\"".into())))
    );
}

#[test]
fn bad_fields_name_themselves() {
    assert_eq!(param(json!({"response_format": {"type": "yaml"}})), "response_format.type");
    assert_eq!(param(json!({"response_format": "json"})), "response_format");
    assert_eq!(param(json!({"response_format": {"type": "json_schema"}})), "response_format.json_schema");
    assert_eq!(param(json!({"guided_choice": []})), "guided_choice");
    assert_eq!(param(json!({"guided_choice": ["a", 1]})), "guided_choice");
    assert_eq!(param(json!({"guided_json": "{not json"})), "guided_json");
    assert_eq!(param(json!({"structured_outputs": {"structural_tag": {}}})), "structured_outputs.structural_tag");
    assert_eq!(param(json!({"structured_outputs": 3})), "structured_outputs");
    assert_eq!(param(json!({"guided_whitespace_pattern": " "})), "guided_whitespace_pattern");
    assert_eq!(param(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"})), "guided_regex");
}

fn qwen() -> (Arc<Tokenizer>, Grammars) {
    let tok = Arc::new(Tokenizer::from_dir(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5")).unwrap());
    let g = Grammars::new(tok.clone(), &[tok.token_id("<|im_end|>").unwrap()]).unwrap();
    (tok, g)
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "tags": {"type": "array", "items": {"type": "string"}},
        }, "required": ["city", "days"]}}}),
        json!({"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}),
    ]
}

/// Greedy decoding from logits that push `fav` tokens; returns the text and whether it ended.
fn drive(tok: &Tokenizer, mut c: orchid_engine::constraint::Constraint, fav: &[&str], steps: usize) -> (String, bool) {
    let fav: Vec<u32> = fav.iter().map(|s| tok.encode(s, false).unwrap()[0]).collect();
    let n = tok.vocab_size();
    let mut out = Vec::new();
    for step in 0..steps {
        let mut logits: Vec<f32> = (0..n).map(|i| ((i * 7919 + step * 131) % 1000) as f32 / 1000.0).collect();
        for (k, &f) in fav.iter().enumerate() {
            logits[f as usize] = 10.0 + k as f32;
        }
        c.apply(&mut logits, usize::MAX, usize::MAX).unwrap();
        let t = orchid_engine::sampling::argmax(&logits) as u32;
        if c.observe(t).unwrap() {
            return (tok.decode(&out, false), true);
        }
        out.push(t);
    }
    (tok.decode(&out, false), false)
}

/// The calls the server's parser reads out of `text`: (name, arguments JSON).
fn parse_calls(text: &str) -> Vec<(String, Value)> {
    let mut p = ToolCallParser::new(ToolSchemas::from_tools(&tools()));
    let mut ev = p.push(text);
    ev.extend(p.finish());
    let mut calls: Vec<(String, String)> = Vec::new();
    for e in ev {
        match e {
            ToolEvent::Start { name, .. } => calls.push((name, String::new())),
            ToolEvent::Args { index, delta } => calls[index].1.push_str(&delta),
            ToolEvent::Content(c) => assert!(c.trim().is_empty(), "stray content {c:?} in {text:?}"),
        }
    }
    calls.into_iter().map(|(n, a)| (n, serde_json::from_str(&a).unwrap())).collect()
}

#[test]
fn tool_grammar_has_the_template_format() {
    let g = tool_call_grammar(&tools(), Some("ping"), false, "");
    assert!(g.contains(r#""<tool_call>\n<function=ping>" NL?"#), "{g}");
    assert!(!g.contains("get_weather"), "{g}");
    let g = tool_call_grammar(&tools(), None, true, "");
    assert!(g.contains(r#"/<parameter=city>\n?[^<\n]{0,12}\n?<\/parameter>\n?/"#), "{g}");
    assert!(g.contains(r#""<parameter=days>" NL? v_0_2 NL? "</parameter>" NL?"#), "{g}");
    assert!(g.contains(r#""</function>" NL? "</tool_call>""#), "{g}");
    assert!(g.contains("%json"), "{g}");
}

#[test]
fn forced_calls_parse_and_follow_the_schema() {
    let (tok, g) = qwen();
    let cases = [
        (Some("get_weather"), false, ""),
        (None, false, "<tool_call>\n<function="),
        (None, true, ""),
        (Some("ping"), true, "<tool_call>\n<function=ping>\n"),
    ];
    for (only, parallel, prefix) in cases {
        let grammar = tool_call_grammar(&tools(), only, parallel, prefix);
        let c = g.compile(&GrammarSpec::Lark(grammar.clone())).unwrap_or_else(|e| panic!("{e}\n{grammar}"));
        // A "model" that would rather write prose and newlines (with parallel calls allowed, a
        // model that always prefers a newline would call forever: not this one).
        let fav: &[&str] = if parallel { &["Hello", "</parameter>", "<|im_end|>"] } else { &["Hello", "\n", "</parameter>"] };
        let (text, ended) = drive(&tok, c, fav, 200);
        assert!(ended, "{text:?}");
        let calls = parse_calls(&format!("{prefix}{text}"));
        assert!(!calls.is_empty(), "{text:?}");
        if !parallel {
            assert_eq!(calls.len(), 1, "{text:?}");
        }
        for (name, args) in &calls {
            if let Some(o) = only {
                assert_eq!(name, o);
            }
            if name == "get_weather" {
                assert!(args["city"].as_str().unwrap().chars().count() <= 12, "{args}");
                assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
                if let Some(u) = args.get("unit") {
                    assert!(u == "celsius" || u == "fahrenheit", "{args}");
                }
                if let Some(t) = args.get("tags") {
                    assert!(t.as_array().unwrap().iter().all(Value::is_string), "{args}");
                }
            }
        }
    }
}

#[test]
fn a_parameter_schema_that_does_not_compile_is_an_error() {
    let (_, g) = qwen();
    let bad = vec![json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]}}})];
    let grammar = tool_call_grammar(&bad, None, false, "");
    assert!(g.compile(&GrammarSpec::Lark(grammar)).is_err());
}

/// Pydantic writes nested models and enums as `$ref`s into the tool's `$defs`: a forced call
/// compiles and follows them (each parameter is compiled on its own, so its definitions go with it).
#[test]
fn forced_calls_follow_references_into_defs() {
    let (tok, g) = qwen();
    let tools = vec![json!({"type": "function", "function": {"name": "ship", "parameters": {
        "$defs": {
            "Address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}},
                        "required": ["street", "zip"], "additionalProperties": false},
            "Speed": {"type": "string", "enum": ["slow", "fast"]},
        },
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Address"}, "speed": {"$ref": "#/$defs/Speed"}},
        "required": ["to", "speed"],
    }}})];
    let grammar = tool_call_grammar(&tools, Some("ship"), false, "");
    assert!(grammar.contains("(?:slow|fast)"), "the enum behind the reference is raw text: {grammar}");
    let c = g.compile(&GrammarSpec::Lark(grammar.clone())).unwrap_or_else(|e| panic!("{e}\n{grammar}"));
    let (text, ended) = drive(&tok, c, &["Hello", "\n", "</parameter>"], 300);
    assert!(ended, "{text:?}");
    let mut p = ToolCallParser::new(ToolSchemas::from_tools(&tools));
    let mut ev = p.push(&text);
    ev.extend(p.finish());
    let args: String = ev.iter().filter_map(|e| if let ToolEvent::Args { delta, .. } = e { Some(delta.as_str()) } else { None }).collect();
    let args: Value = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    // An integer (the JSON text "-0" reads back as the float -0.0).
    assert!(args["to"]["street"].is_string() && args["to"]["zip"].as_f64().is_some_and(|z| z.fract() == 0.0), "{args}");
    assert!(args["speed"] == "slow" || args["speed"] == "fast", "{args}");
}
