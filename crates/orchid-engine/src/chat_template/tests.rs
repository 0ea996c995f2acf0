//! Unit tests of the chat template renderer that need no Python (the byte-for-byte parity
//! with transformers is checked by `tests/python/test_chat_template.py`).

use super::*;
use serde_json::json;
use std::path::PathBuf;

fn assets(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets").join(name)
}

fn qwen35() -> ChatTemplate {
    ChatTemplate::from_dir(&assets("qwen3.5")).unwrap()
}

fn render_str(src: &str, ctx: Json) -> String {
    let t = ChatTemplate::from_source(src, &[]).unwrap();
    let mut kwargs = ctx.as_object().unwrap().clone();
    kwargs.remove("messages");
    t.render(&[json!({"role": "user", "content": "x"})], None, false, &kwargs).unwrap()
}

#[test]
fn qwen35_generation_prompt_and_thinking_switch() {
    let t = qwen35();
    let msgs = [json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "hi"})];
    let out = t.render(&msgs, None, true, &Map::new()).unwrap();
    assert_eq!(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n");
    let off = json!({"enable_thinking": false}).as_object().unwrap().clone();
    let out = t.render(&msgs[1..], None, true, &off).unwrap();
    assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    let out = t.render(&msgs[1..], None, false, &Map::new()).unwrap();
    assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n");
}

#[test]
fn qwen35_tool_call_arguments_from_json_string() {
    let t = qwen35();
    let msgs = [
        json!({"role": "user", "content": "weather?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {
            "name": "get", "arguments": "{\"city\": \"Paris\", \"n\": 2, \"ok\": true, \"deep\": {\"a\": [1, 2.0]}}"}}]}),
        json!({"role": "tool", "content": "sunny"}),
    ];
    let out = t.render(&msgs, None, false, &Map::new()).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\
         <tool_call>\n<function=get>\n<parameter=city>\nParis\n</parameter>\n<parameter=n>\n2\n</parameter>\n\
         <parameter=ok>\nTrue\n</parameter>\n<parameter=deep>\n{\"a\": [1, 2.0]}\n</parameter>\n</function>\n</tool_call>\
         <|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    );
    let bad = [msgs[0].clone(), json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]})];
    assert!(matches!(t.render(&bad, None, false, &Map::new()), Err(ChatTemplateError::InvalidRequest(_))));
}

#[test]
fn raise_exception_surfaces_the_template_message() {
    let t = qwen35();
    let err = t.render(&[json!({"role": "system", "content": "only"})], None, true, &Map::new()).unwrap_err();
    assert!(matches!(&err, ChatTemplateError::Raised(m) if m == "No user query found in messages."), "{err}");
    // Raised inside a macro, too.
    let msgs = [json!({"role": "user", "content": [{"type": "image", "image": "x.png"}]})];
    let err = t.render(&msgs, None, true, &Map::new()).unwrap_err();
    assert!(matches!(&err, ChatTemplateError::Raised(m) if m.contains("Only text content")), "{err}");
}

#[test]
fn request_object_and_errors() {
    let t = qwen35();
    let req = json!({"messages": [{"role": "user", "content": "a"}], "enable_thinking": false});
    assert!(t.render_request(&req).unwrap().ends_with("<think>\n\n</think>\n\n"));
    for bad in [
        json!([]),
        json!({"messages": "x"}),
        json!({"messages": []}),
        json!({"messages": [1]}),
        json!({"messages": [{"role": "user", "content": "a"}], "tools": {}}),
    ] {
        assert!(matches!(t.render_request(&bad), Err(ChatTemplateError::InvalidRequest(_))), "{bad}");
    }
    let kw = json!({"documents": 1}).as_object().unwrap().clone();
    assert!(t.render(&[json!({"role": "user", "content": "a"})], None, true, &kw).is_err());
}

#[test]
fn python_semantics_in_templates() {
    assert_eq!(render_str("{{ true }} {{ none }} {{ 1.0 }} {{ 1e-5 }} {{ x }}|", json!({})), "True None 1.0 1e-05 |");
    assert_eq!(render_str("{{ v }} {{ v|string }}", json!({"v": [1, "a", {"k": null}]})), "[1, 'a', {'k': None}] [1, 'a', {'k': None}]");
    assert_eq!(render_str("{{ v|tojson }}", json!({"v": {"b": "<é>", "a": [1.5, true]}})), r#"{"b": "<é>", "a": [1.5, true]}"#);
    assert_eq!(render_str("{{ v|tojson(indent=2) }}", json!({"v": {"a": [1]}})), "{\n  \"a\": [\n    1\n  ]\n}");
    assert_eq!(render_str("{{ v|tojson(separators=(',', ':'), sort_keys=true) }}", json!({"v": {"b": 1, "a": 2}})), r#"{"a":2,"b":1}"#);
    assert_eq!(render_str("{{ ' a  b '.split() }}{{ 'x\n'.rstrip('\\n') }}{{ '  y '|trim }}", json!({})), "['a', 'b']xy");
    assert_eq!(render_str("{{ 'abc'.startswith('a') }}{{ {'k': 1}.items()|list }}", json!({})), "True[('k', 1)]");
    assert_eq!(
        render_str("{{ 'a' is sequence }}{{ {} is sequence }}{{ 3 is sequence }}{{ 'a' is iterable }}", json!({})),
        "TrueTrueFalseTrue"
    );
    // trim_blocks + lstrip_blocks, and the single trailing newline dropped.
    assert_eq!(render_str("  {% if true %}\nX\n  {% endif %}\nY\n", json!({})), "X\nY");
    assert_eq!(render_str("{{ bos_token }}|{{ strftime_now('%Y')|length }}", json!({})), "|4");
    let t = ChatTemplate::from_source("{{ eos_token }}", &[("eos_token", "<|im_end|>")]).unwrap();
    assert_eq!(t.render(&[json!({"role": "user"})], None, true, &Map::new()).unwrap(), "<|im_end|>");
}

#[test]
fn reasoning_aliases_and_null_keys() {
    let src = "{% for m in messages %}{{ m|tojson }}\n{% endfor %}";
    let t = ChatTemplate::from_source(src, &[]).unwrap();
    let msgs = [json!({"role": "assistant", "content": "c", "reasoning": "r", "tool_calls": null})];
    assert_eq!(
        t.render(&msgs, None, false, &Map::new()).unwrap(),
        r#"{"thinking": "r", "role": "assistant", "content": "c", "reasoning": "r", "reasoning_content": "r"}"#.to_string() + "\n"
    );
}

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("orchid-ct-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn loading_from_tokenizer_config() {
    let d = tmp_dir("named");
    let cfg = json!({"eos_token": "<E>", "bos_token": null, "chat_template": [
        {"name": "default", "template": "D{{ eos_token }}"}, {"name": "tool_use", "template": "T{{ tools|length }}"}]});
    std::fs::write(d.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let t = ChatTemplate::from_dir(&d).unwrap();
    let m = [json!({"role": "user", "content": "x"})];
    assert_eq!(t.render(&m, None, true, &Map::new()).unwrap(), "D<E>");
    assert_eq!(t.render(&m, Some(&[json!({})]), true, &Map::new()).unwrap(), "T1");

    // chat_template.jinja wins over tokenizer_config.json.
    std::fs::write(d.join("chat_template.jinja"), "J").unwrap();
    assert_eq!(ChatTemplate::from_dir(&d).unwrap().render(&m, None, true, &Map::new()).unwrap(), "J");
    std::fs::write(d.join("chat_template.jinja"), "{% if %}").unwrap();
    assert!(matches!(ChatTemplate::from_dir(&d), Err(ChatTemplateError::Syntax(_))));
    std::fs::remove_file(d.join("chat_template.jinja")).unwrap();

    std::fs::write(d.join("tokenizer_config.json"), "{}").unwrap();
    let err = ChatTemplate::from_dir(&d).unwrap_err().to_string();
    assert!(err.contains("no chat template"), "{err}");
    std::fs::write(d.join("tokenizer_config.json"), "{bad").unwrap();
    let err = ChatTemplate::from_dir(&d).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn qwen3_template_loads_with_special_tokens() {
    let t = ChatTemplate::from_dir(&assets("qwen3")).unwrap();
    let out = t.render(&[json!({"role": "user", "content": "hi"})], None, true, &Map::new()).unwrap();
    assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}
