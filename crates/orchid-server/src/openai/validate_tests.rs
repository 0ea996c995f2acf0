use serde_json::json;

use super::*;

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn chat(v: Value) -> Result<ChatRequest> {
    chat_request(&obj(v), &SamplingParams::default())
}

fn param_of(r: Result<impl std::fmt::Debug>) -> String {
    let e = r.expect_err("expected a validation error");
    assert_eq!(e.status.as_u16(), 400, "{e:?}");
    e.param.unwrap_or_default()
}

#[test]
fn full_chat_request() {
    let r = chat(json!({
        "model": "m", "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "reasoning_content": "hm", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "presence_penalty": 1.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": -7, "stop": "END",
        "max_completion_tokens": 12, "max_tokens": 99, "stream": true, "stream_options": {"include_usage": true},
        "logprobs": true, "top_logprobs": 3, "user": "u1", "unknown_field": {"ignored": true},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "reasoning_effort": "none", "chat_template_kwargs": {"preserve_thinking": true},
    }))
    .unwrap();
    assert_eq!(r.messages[0], json!({"role": "system", "content": "be brief"}));
    assert_eq!(r.messages[1]["content"], "ab");
    assert_eq!(r.messages[2]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
    assert_eq!(r.messages[2]["reasoning_content"], "hm");
    assert!(r.messages[2].get("content").is_none());
    assert_eq!(r.messages[3]["tool_call_id"], "c1");
    let s = &r.common.sampling;
    assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (0.5, 0.9, 20, 0.05));
    assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (1.5, -0.5, 1.1));
    assert_eq!(s.seed, Some(-7i64 as u64));
    assert_eq!(r.common.stop, vec!["END".to_string()]);
    assert_eq!(r.common.max_tokens, Some(12));
    assert!(r.common.stream && r.common.include_usage);
    assert_eq!(r.logprobs, Some(3));
    assert_eq!(r.tool_choice, ToolChoice::Function("f".into()));
    assert_eq!(r.template_kwargs, obj(json!({"enable_thinking": false, "preserve_thinking": true})));
}

#[test]
fn defaults() {
    let r = chat(json!({"messages": [{"role": "user", "content": "hi"}], "top_k": -1, "n": 1, "stop": null})).unwrap();
    assert_eq!(r.common.sampling, SamplingParams::default());
    assert_eq!(r.common.max_tokens, None);
    assert!(!r.common.stream && r.logprobs.is_none() && r.tools.is_none());
    assert_eq!(r.tool_choice, ToolChoice::Auto);
}

#[test]
fn invalid_values_name_the_field() {
    let base = || json!({"messages": [{"role": "user", "content": "hi"}]});
    let with = |k: &str, v: Value| {
        let mut b = base();
        b[k] = v;
        chat(b)
    };
    assert_eq!(param_of(with("temperature", json!(2.5))), "temperature");
    assert_eq!(param_of(with("temperature", json!("hot"))), "temperature");
    assert_eq!(param_of(with("top_p", json!(0))), "top_p");
    assert_eq!(param_of(with("top_k", json!(-2))), "top_k");
    assert_eq!(param_of(with("top_k", json!(1.5))), "top_k");
    assert_eq!(param_of(with("min_p", json!(1.5))), "min_p");
    assert_eq!(param_of(with("presence_penalty", json!(3))), "presence_penalty");
    assert_eq!(param_of(with("frequency_penalty", json!(-3))), "frequency_penalty");
    assert_eq!(param_of(with("repetition_penalty", json!(0))), "repetition_penalty");
    assert_eq!(param_of(with("seed", json!("x"))), "seed");
    assert_eq!(param_of(with("max_tokens", json!(0))), "max_tokens");
    assert_eq!(param_of(with("max_completion_tokens", json!(-1))), "max_completion_tokens");
    assert_eq!(param_of(with("n", json!(0))), "n");
    assert_eq!(param_of(with("n", json!(17))), "n");
    assert_eq!(param_of(with("stop", json!([1]))), "stop[0]");
    assert_eq!(param_of(with("stop", json!(5))), "stop");
    assert_eq!(param_of(with("stop", json!(["a", "x".repeat(2000)]))), "stop[1]");
    assert_eq!(param_of(with("stop", json!("x".repeat(2000)))), "stop");
    assert_eq!(param_of(with("repetition_penalty", json!(1e-46))), "repetition_penalty");
    assert_eq!(param_of(with("chat_template_kwargs", json!({"namespace": null}))), "chat_template_kwargs.namespace");
    assert_eq!(param_of(with("chat_template_kwargs", json!({"messages": []}))), "chat_template_kwargs.messages");
    let call = json!([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "a<b>", "arguments": "{}"}}]}]);
    assert_eq!(param_of(with("messages", call)), "messages[0].tool_calls[0].function.name");
    assert_eq!(param_of(with("stream", json!("yes"))), "stream");
    assert_eq!(param_of(with("stream_options", json!({"include_usage": true}))), "stream_options");
    assert_eq!(param_of(with("logprobs", json!(1))), "logprobs");
    assert_eq!(param_of(with("top_logprobs", json!(21))), "top_logprobs");
    assert_eq!(param_of(with("top_logprobs", json!(2))), "top_logprobs");
    assert_eq!(param_of(with("logit_bias", json!({"a": 5}))), "logit_bias.a");
    assert_eq!(param_of(with("use_beam_search", json!(true))), "use_beam_search");
    assert_eq!(param_of(with("response_format", json!({"type": "yaml"}))), "response_format.type");
    assert_eq!(param_of(with("guided_choice", json!([]))), "guided_choice");
    assert_eq!(param_of(with("reasoning_effort", json!("max"))), "reasoning_effort");
    assert_eq!(param_of(with("chat_template_kwargs", json!([]))), "chat_template_kwargs");
    assert_eq!(param_of(with("tools", json!({}))), "tools");
    assert_eq!(param_of(with("tools", json!([{"type": "function", "function": {"name": "a b"}}]))), "tools[0].function.name");
    assert_eq!(param_of(with("tool_choice", json!("sometimes"))), "tool_choice");
    assert_eq!(param_of(with("tool_choice", json!("required"))), "tool_choice");
    assert_eq!(param_of(with("tool_choice", json!({"type": "function", "function": {"name": "nope"}}))), "tool_choice");
    assert_eq!(param_of(with("model", json!(3))), "model");
    assert_eq!(param_of(with("messages", json!([]))), "messages");
    assert_eq!(param_of(with("messages", json!("hi"))), "messages");
    assert_eq!(param_of(with("messages", json!([{"role": "robot", "content": "x"}]))), "messages[0].role");
    assert_eq!(param_of(with("messages", json!([{"content": "x"}]))), "messages[0].role");
    assert_eq!(param_of(with("messages", json!([{"role": "user"}]))), "messages[0].content");
    assert_eq!(param_of(with("messages", json!([{"role": "user", "content": 5}]))), "messages[0].content");
    assert_eq!(
        param_of(with("messages", json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]))),
        "messages[0].content[0].type"
    );
    assert_eq!(
        param_of(with(
            "messages",
            json!([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}])
        )),
        "messages[1].tool_calls[0].function.arguments"
    );
    let mut b = base();
    b.as_object_mut().unwrap().remove("messages");
    assert_eq!(param_of(chat(b)), "messages");
}

#[test]
fn completion_prompts() {
    let c = |v: Value| completion_request(&obj(v), &SamplingParams::default());
    assert_eq!(c(json!({"prompt": "hi"})).unwrap().prompt, Prompt::Text("hi".into()));
    assert_eq!(c(json!({"prompt": ["hi"]})).unwrap().prompt, Prompt::Text("hi".into()));
    assert_eq!(c(json!({"prompt": [1, 2]})).unwrap().prompt, Prompt::Tokens(vec![1, 2]));
    assert_eq!(c(json!({"prompt": [[3]]})).unwrap().prompt, Prompt::Tokens(vec![3]));
    let r = c(json!({"prompt": "x", "logprobs": 2, "echo": true})).unwrap();
    assert_eq!((r.logprobs, r.echo, r.common.max_tokens), (Some(2), true, Some(16)));
    assert_eq!(param_of(c(json!({}))), "prompt");
    assert_eq!(param_of(c(json!({"prompt": ""}))), "prompt");
    assert_eq!(param_of(c(json!({"prompt": ["a", "b"]}))), "prompt");
    assert_eq!(param_of(c(json!({"prompt": [-1]}))), "prompt");
    assert_eq!(param_of(c(json!({"prompt": "x", "logprobs": 30}))), "logprobs");
    assert_eq!(param_of(c(json!({"prompt": "x", "suffix": "s"}))), "suffix");
    assert_eq!(param_of(c(json!({"prompt": "x", "best_of": 3}))), "best_of");
}
