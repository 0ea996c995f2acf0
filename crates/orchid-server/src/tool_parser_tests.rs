//! Tool-call parser tests: model text fed in every possible split must give the same calls.

use serde_json::{Value, json};

use super::*;

#[derive(Debug, PartialEq)]
struct Parsed {
    content: String,
    /// (name, arguments parsed as JSON)
    calls: Vec<(String, Value)>,
}

fn schemas() -> ToolSchemas {
    ToolSchemas::from_tools(&[
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}),
        json!({"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
            "code": {"type": "string"}, "opts": {"type": "object"}, "args": {"type": "array"}, "scale": {"type": "number"}}}}}),
    ])
}

/// Feeds the deltas and checks the event stream is well formed (ids once, args in order).
fn run(deltas: &[&str]) -> Parsed {
    let mut p = ToolCallParser::new(schemas());
    let mut events = Vec::new();
    for d in deltas {
        events.extend(p.push(d));
    }
    events.extend(p.finish());
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for e in events {
        match e {
            ToolEvent::Content(s) => {
                assert!(!s.is_empty(), "empty content event");
                content.push_str(&s)
            }
            ToolEvent::Start { index, id, name } => {
                assert_eq!(index, calls.len(), "call indices are consecutive");
                assert!(id.starts_with("call_") && id.len() > 10, "{id}");
                calls.push((name, String::new()));
            }
            ToolEvent::Args { index, delta } => {
                assert_eq!(index + 1, calls.len(), "arguments belong to the latest call");
                calls[index].1.push_str(&delta);
            }
        }
    }
    assert_eq!(p.calls(), calls.len());
    let calls = calls
        .into_iter()
        .map(|(n, a)| {
            let v: Value = serde_json::from_str(&a).unwrap_or_else(|e| panic!("arguments {a:?} are not JSON: {e}"));
            (n, v)
        })
        .collect();
    Parsed { content, calls }
}

/// Every split of `text` into three deltas, and one character at a time, parse alike.
fn check_all_splits(text: &str, want: &Parsed) {
    let idx: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    let step = (idx.len() / 60).max(1); // keep long texts fast: every step-th cut point
    for &a in idx.iter().step_by(step) {
        for &b in idx.iter().filter(|&&b| b >= a).step_by(step) {
            let got = run(&[&text[..a], &text[a..b], &text[b..]]);
            assert_eq!(&got, want, "split at {a},{b}: {:?} | {:?} | {:?}", &text[..a], &text[a..b], &text[b..]);
        }
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(&run(&refs), want, "one char at a time");
}

fn parsed(content: &str, calls: &[(&str, Value)]) -> Parsed {
    Parsed { content: content.into(), calls: calls.iter().map(|(n, v)| (n.to_string(), v.clone())).collect() }
}

#[test]
fn one_call_typed_by_schema() {
    let text = "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>";
    check_all_splits(text, &parsed("I'll check.", &[("get_weather", json!({"city": "Paris", "days": 3, "metric": true}))]));
}

#[test]
fn arguments_stream_one_parameter_at_a_time() {
    let mut p = ToolCallParser::new(schemas());
    let ev = p.push("<tool_call>\n<function=get_weather>\n");
    assert!(matches!(&ev[..], [ToolEvent::Start { index: 0, name, .. }] if name == "get_weather"), "{ev:?}");
    let ev = p.push("<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n1");
    assert_eq!(ev, vec![ToolEvent::Args { index: 0, delta: "{\"city\": \"New York\"".into() }]);
    let ev = p.push("0\n</parameter>\n</function>\n</tool_call>");
    assert_eq!(ev, vec![ToolEvent::Args { index: 0, delta: ", \"days\": 10".into() }, ToolEvent::Args { index: 0, delta: "}".into() }]);
    assert!(p.finish().is_empty());
}

#[test]
fn values_with_angle_brackets_and_lines() {
    let code = "if a < b && c > d {\n    html = \"<div class='x'>\";\n}\n\n</param> is not the end\n";
    let text = format!("<tool_call>\n<function=run>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>");
    check_all_splits(&text, &parsed("", &[("run", json!({"code": code}))]));
}

#[test]
fn json_values_stay_typed() {
    let text = "<tool_call>\n<function=run>\n<parameter=opts>\n{\"depth\": 2, \"tags\": [\"a\", \"b\"], \"x\": null}\n</parameter>\n<parameter=args>\n[1, \"two\", {\"three\": 3}]\n</parameter>\n<parameter=scale>\n-0.5\n</parameter>\n</function>\n</tool_call>";
    check_all_splits(
        text,
        &parsed(
            "",
            &[("run", json!({"opts": {"depth": 2, "tags": ["a", "b"], "x": null}, "args": [1, "two", {"three": 3}], "scale": -0.5}))],
        ),
    );
}

#[test]
fn several_calls() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run>\n</function>\n</tool_call>";
    check_all_splits(
        text,
        &parsed("", &[("get_weather", json!({"city": "Oslo"})), ("get_weather", json!({"city": "Rome"})), ("run", json!({}))]),
    );
}

#[test]
fn malformed_text_is_content() {
    for text in [
        "<tool_call>\nnot a call\n</tool_call>",
        "<tool_call>\n<function=has space>\n</function>\n</tool_call>",
        "before <tool_call> after",
        "<tool_call>\n{\"name\": \"x\", \"arguments\": [broken}\n</tool_call> tail",
        "a <tool_ca",
        "<tool_call>",
        "<tool_call>\n<function=get_wea",
        "<tool_call><tool_call>x",
        "x <tool-call> y </tool_call>",
    ] {
        let got = run(&[text]);
        assert_eq!(got, parsed(text, &[]), "{text:?}");
        check_all_splits(text, &parsed(text, &[]));
    }
}

#[test]
fn malformed_then_valid() {
    let text = "<tool_call> oops\n<tool_call>\n<function=run>\n<parameter=code>\nx\n</parameter>\n</function>\n</tool_call>";
    check_all_splits(text, &parsed("<tool_call> oops", &[("run", json!({"code": "x"}))]));
}

#[test]
fn lenient_inside_a_call() {
    // Missing </parameter>, stray text, missing </tool_call> before the next call.
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n2\n</parameter>\nstray\n</function>\n<function=run>\n<parameter=code>\ny\n</parameter>\n</function>\n</tool_call>\nDone.";
    check_all_splits(text, &parsed("strayDone.", &[("get_weather", json!({"city": "Lima", "days": 2})), ("run", json!({"code": "y"}))]));
}

#[test]
fn multibyte_stray_text_inside_a_call() {
    let text = "<tool_call>\n<function=run>\n自由选择 ok\n<parameter=code>\nx\n</parameter>\n😀</function>\n</tool_call>";
    check_all_splits(text, &parsed("自由选择 ok😀", &[("run", json!({"code": "x"}))]));
}

#[test]
fn truncated_call_is_closed() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer";
    check_all_splits(text, &parsed("", &[("get_weather", json!({"city": "Ber"}))]));
    let text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</func";
    check_all_splits(text, &parsed("", &[("get_weather", json!({"days": 4}))]));
}

#[test]
fn json_form_calls() {
    let text = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Kyiv\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"run\", \"arguments\": \"{\\\"code\\\": \\\"1\\\"}\"}\n</tool_call>";
    check_all_splits(text, &parsed("Sure.", &[("get_weather", json!({"city": "Kyiv", "days": 2})), ("run", json!({"code": "1"}))]));
}

#[test]
fn unknown_tool_and_text_after() {
    let text = "<tool_call>\n<function=search>\n<parameter=q>\nrust <3\n</parameter>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>\n\nLet me know.";
    check_all_splits(text, &parsed("Let me know.", &[("search", json!({"q": "rust <3", "n": "5"}))]));
}

#[test]
fn plain_text_passes_through() {
    let text = "No tools needed: 1 < 2, <b>bold</b>, and a trailing space ";
    check_all_splits(text, &parsed(text, &[]));
}

#[test]
fn unicode_around_tags() {
    let text = "héllo 😀\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 🌧\n</parameter>\n</function>\n</tool_call>";
    check_all_splits(text, &parsed("héllo 😀", &[("get_weather", json!({"city": "Zürich 🌧"}))]));
}

/// Random mixes of tag fragments, unicode and whitespace: never a panic, and the result does
/// not depend on how the text is split into deltas.
#[test]
fn random_texts_are_split_invariant() {
    const FRAGMENTS: [&str; 24] = [
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "<function=run>",
        "<parameter=city>",
        "<parameter=days>",
        "</parameter>",
        "</function>",
        "<function=",
        "<parameter=",
        "<",
        ">",
        "</",
        "\n",
        " ",
        "\t",
        "x",
        "é",
        "😀",
        "{\"name\": \"run\"}",
        "12",
        "true",
        "</think>",
        "<tool_",
    ];
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut next = move |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    for _ in 0..400 {
        let text: String = (0..1 + next(30)).map(|_| FRAGMENTS[next(FRAGMENTS.len())]).collect();
        let whole = run(&[&text]);
        let idx: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for _ in 0..8 {
            let (mut a, mut b) = (idx[next(idx.len())], idx[next(idx.len())]);
            if a > b {
                std::mem::swap(&mut a, &mut b);
            }
            assert_eq!(run(&[&text[..a], &text[a..b], &text[b..]]), whole, "{text:?} split at {a},{b}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&refs), whole, "{text:?} one char at a time");
        // Text outside calls survives: no call parsed means the non-whitespace text is intact.
        if whole.calls.is_empty() {
            let squash = |s: &str| s.split_whitespace().collect::<String>();
            assert_eq!(squash(&whole.content), squash(&text), "{text:?}");
        }
    }
}
