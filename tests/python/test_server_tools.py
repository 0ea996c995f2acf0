"""Reasoning and tool calls through `orchid serve`, end to end.

The *scripted* checkpoint (see test_server_support.py) writes fixed texts: with thinking on it
reasons, closes `</think>` and answers; with thinking off it answers directly; after the
`tool_choice: required` prompt it completes a `get_time` call. So the real binary, template,
tokenizer, engine and parsers are all exercised, with known expected output. Parser edge cases
(splits, malformed text, several calls, typed values) are the Rust unit tests of
crates/orchid-server (tool_parser, reasoning_parser, tool_schema, chat_output).
"""

from __future__ import annotations

import json

import pytest

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

REASONING, _, CONTENT = S.SCRIPT_THINKING.partition("</think>")
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "What time is it in Oslo?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server() -> S.Server:
    return S.shared_server("scripted")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def extra(message, key):
    return getattr(message, key, None) or (message.model_extra or {}).get(key)


def collect_stream(client, **kw):
    """Streamed chat: (content, reasoning, {index: [id, name, args]}, finish, deltas)."""
    content, reasoning, calls, finish, deltas = "", "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        deltas.append(d)
        content += d.content or ""
        reasoning += extra(d, "reasoning_content") or ""
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, [None, None, ""])
            if t.id:
                assert c[0] is None, "a call's id comes once"
                c[0], c[1] = t.id, t.function.name
            else:
                assert c[0] is not None, "arguments come after the id and name"
            c[2] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, calls, finish, deltas


def test_reasoning_split_with_thinking_on(client):
    r = client.chat.completions.create(model="tiny-scripted", messages=QUESTION, max_tokens=64, temperature=0)
    m = r.choices[0].message
    assert extra(m, "reasoning_content") == REASONING
    assert m.content == CONTENT
    assert "<think>" not in m.content and "</think>" not in m.content
    assert r.choices[0].finish_reason == "stop"
    # Reasoning tokens: the reasoning text plus the </think> token.
    assert r.usage.completion_tokens_details.reasoning_tokens == 15
    content, reasoning, calls, finish, deltas = collect_stream(client, model="tiny-scripted", messages=QUESTION, max_tokens=64, temperature=0)
    assert (content, reasoning, calls, finish) == (CONTENT, REASONING, {}, "stop")
    # All reasoning deltas come before the first content delta.
    kinds = ["r" if extra(d, "reasoning_content") else "c" for d in deltas if d.content or extra(d, "reasoning_content")]
    assert kinds == sorted(kinds, key=lambda k: k == "c") and kinds.count("r") > 1


@pytest.mark.parametrize("how", [NO_THINK, {"reasoning_effort": "none"}])
def test_thinking_off(client, how):
    r = client.chat.completions.create(model="tiny-scripted", messages=QUESTION, max_tokens=64, temperature=0, extra_body=how)
    m = r.choices[0].message
    assert m.content == S.SCRIPT_ANSWER
    assert not extra(m, "reasoning_content")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    content, reasoning, _, _, _ = collect_stream(client, model="tiny-scripted", messages=QUESTION, max_tokens=64, temperature=0, extra_body=how)
    assert (content, reasoning) == (S.SCRIPT_ANSWER, "")


def test_tool_round_trip(client):
    # 1. The model must call a tool: it writes a get_time call.
    r = client.chat.completions.create(model="tiny-scripted", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_time"
    # The call is grammar-constrained: its shape is guaranteed; the scripted value is not (the
    # bigram chain's non-canonical token splits are not all allowed by the grammar).
    args = json.loads(call.function.arguments)
    assert list(args) == ["timezone"] and isinstance(args["timezone"], str)
    # 2. The tool result goes back; the model answers.
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "10:42"},
    ]
    r2 = client.chat.completions.create(model="tiny-scripted", messages=messages, tools=TOOLS, max_tokens=64, temperature=0, extra_body=NO_THINK)
    assert r2.choices[0].message.content == S.SCRIPT_ANSWER
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    # The rendered prompt holds the call and its result: the second prompt is longer.
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_tool_call_streaming(client):
    content, reasoning, calls, finish, _ = collect_stream(client, model="tiny-scripted", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0)
    assert finish == "tool_calls" and content == "" and reasoning == ""
    assert list(calls) == [0]
    call_id, name, args = calls[0]
    assert call_id.startswith("call_") and name == "get_time"
    assert list(json.loads(args)) == ["timezone"]


def test_tool_choice_auto_and_none(client):
    # auto: tools are offered; this model reasons and answers without calling.
    r = client.chat.completions.create(model="tiny-scripted", messages=QUESTION, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0)
    assert r.choices[0].message.content == CONTENT and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny-scripted", messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=64, temperature=0)
    assert r.choices[0].message.content == CONTENT and not r.choices[0].message.tool_calls


def test_named_tool_choice_on_a_random_model():
    """A named tool_choice starts the call for the model: even random weights yield a call to
    that function, with JSON arguments (whatever the model wrote inside comes back as content)."""
    client = S.shared_server("random").client()
    r = client.chat.completions.create(model="tiny-random", messages=QUESTION, tools=TOOLS, max_tokens=8, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert len(calls) >= 1 and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    assert r.choices[0].finish_reason in ("tool_calls", "length")


def test_tool_request_errors(server):
    def post(body):
        return server.json("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4, **body})

    status, _, r = post({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert status == 400 and r["error"]["param"] == "tool_choice"
    status, _, r = post({"tool_choice": "required"})
    assert status == 400 and r["error"]["param"] == "tool_choice"
    status, _, r = post({"tools": [{"type": "function", "function": {"name": "bad name"}}]})
    assert status == 400 and r["error"]["param"] == "tools[0].function.name"
    bad_history = QUESTION + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]
    status, _, r = server.json("POST", "/v1/chat/completions", {"messages": bad_history, "max_tokens": 4})
    assert status == 400 and r["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
