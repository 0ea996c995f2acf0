"""The other wire formats of `orchid serve`, end to end with their official clients, on the
*scripted* checkpoint (see test_server_support.py: with thinking on it reasons, closes
`</think>` and answers; after `tool_choice: required` it writes a `get_time` call):

* the OpenAI Responses API (`client.responses.create`, streamed and not, function tools,
  a function-call round trip, reasoning items, `store`),
* the Anthropic Messages API (the `anthropic` client: messages, streaming, tool use, errors),
* litellm's OpenAI provider,
* `reasoning` beside `reasoning_content`, and `thinking_token_budget` (the forced `</think>`).
"""

from __future__ import annotations

import json

import pytest

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

REASONING, _, CONTENT = S.SCRIPT_THINKING.partition("</think>")
QUESTION = "What time is it in Oslo?"
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}]
RESP_TOOLS = [{"type": "function", **CHAT_TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [{"name": "get_time", "description": "Current time in a timezone",
                    "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]
OSLO = {"timezone": "Europe/Oslo"}


def is_time_args(a) -> bool:
    """A forced call's arguments follow the tool's schema (one string `timezone`). The grammar
    decides what the scripted model may write inside the value, so the text itself is not
    compared."""
    return isinstance(a, dict) and set(a) == {"timezone"} and isinstance(a["timezone"], str) and a["timezone"] != ""
# The anthropic client no longer has sampling arguments; the server still reads them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server() -> S.Server:
    return S.shared_server("scripted")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def claude(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


def extra(obj, key):
    return getattr(obj, key, None) or (obj.model_extra or {}).get(key)


# ---- reasoning fields and the thinking budget (chat completions) ----

def test_reasoning_under_both_names(client):
    r = client.chat.completions.create(model="tiny-scripted", messages=[{"role": "user", "content": QUESTION}], max_tokens=64, temperature=0)
    m = r.choices[0].message
    assert extra(m, "reasoning") == extra(m, "reasoning_content") == REASONING
    both = ""
    for chunk in client.chat.completions.create(model="tiny-scripted", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=64, temperature=0, stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            assert extra(d, "reasoning") == extra(d, "reasoning_content")
            both += extra(d, "reasoning") or ""
    assert both == REASONING


@pytest.mark.parametrize("budget", [0, 3])
def test_thinking_budget_forces_the_end_of_thinking(client, budget):
    r = client.chat.completions.create(model="tiny-scripted", messages=[{"role": "user", "content": QUESTION}], max_tokens=64,
                                       temperature=0, extra_body={"thinking_token_budget": budget})
    m = r.choices[0].message
    reasoning = extra(m, "reasoning") or ""
    # The budget's tokens of the script, then the forced </think>; the scripted model then
    # answers exactly as after its own </think>.
    assert REASONING.startswith(reasoning) and len(reasoning) < len(REASONING)
    assert (budget == 0) == (reasoning == "")
    assert m.content == CONTENT
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + 1


# ---- the Responses API ----

def test_responses_text_and_reasoning(client):
    r = client.responses.create(model="tiny-scripted", input=QUESTION, max_output_tokens=64, temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output_text == CONTENT
    assert r.output[0].content[0].text == REASONING
    assert r.usage.output_tokens_details.reasoning_tokens == 15 and r.usage.input_tokens > 0
    short = client.responses.create(model="tiny-scripted", input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                                    instructions="Answer briefly.", max_output_tokens=4, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_streamed(client):
    events = list(client.responses.create(model="tiny-scripted", input=QUESTION, max_output_tokens=64, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for k in ("response.output_item.added", "response.reasoning_text.delta", "response.output_text.delta",
              "response.output_text.done", "response.output_item.done"):
        assert k in kinds, k
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == CONTENT
    assert events[-1].response.output_text == CONTENT


def test_responses_function_call_round_trip(client):
    r = client.responses.create(model="tiny-scripted", input=QUESTION, tools=RESP_TOOLS, tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time" and is_time_args(json.loads(calls[0].arguments))
    events = list(client.responses.create(model="tiny-scripted", input=QUESTION, tools=RESP_TOOLS, tool_choice="required",
                                          max_output_tokens=64, temperature=0, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(calls[0].arguments)
    follow = client.responses.create(model="tiny-scripted", tools=RESP_TOOLS, max_output_tokens=64, temperature=0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_time", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "10:42"}])
    assert follow.status == "completed" and follow.output_text == CONTENT


def test_responses_is_stateless(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny-scripted", input="hi", store=True)
    assert e.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny-scripted", input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    assert client.responses.create(model="tiny-scripted", input="hi", store=False, max_output_tokens=2).status == "incomplete"


# ---- the Anthropic Messages API ----

def test_anthropic_message(claude):
    m = claude.messages.create(model="tiny-scripted", max_tokens=64, extra_body=GREEDY, system="Be brief.",
                               messages=[{"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == REASONING and m.content[1].text == CONTENT
    assert m.stop_reason == "end_turn" and m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    short = claude.messages.create(model="tiny-scripted", max_tokens=3, messages=[{"role": "user", "content": QUESTION}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    stopped = claude.messages.create(model="tiny-scripted", max_tokens=64, extra_body=GREEDY, stop_sequences=["clock"],
                                     messages=[{"role": "user", "content": QUESTION}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "clock")
    assert stopped.content[-1].text == CONTENT[:CONTENT.index("clock")]


def test_anthropic_streaming(claude):
    with claude.messages.stream(model="tiny-scripted", max_tokens=64, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].thinking == REASONING and final.content[1].text == CONTENT
    assert final.stop_reason == "end_turn"


def test_anthropic_tool_use(claude):
    m = claude.messages.create(model="tiny-scripted", max_tokens=64, extra_body=GREEDY, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "any"}, messages=[{"role": "user", "content": QUESTION}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_time" and is_time_args(uses[0].input)
    assert m.stop_reason == "tool_use"
    with claude.messages.stream(model="tiny-scripted", max_tokens=64, extra_body=GREEDY, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any"}, messages=[{"role": "user", "content": QUESTION}]) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = s.get_final_message()
    assert json.loads("".join(deltas)) == uses[0].input and final.content[-1].input == uses[0].input
    # The round trip: the call and its result go back in.
    follow = claude.messages.create(model="tiny-scripted", max_tokens=64, extra_body=GREEDY, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_time", "input": OSLO}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "10:42"}]}])
    assert follow.content[-1].text == CONTENT


def test_anthropic_count_tokens(claude, client):
    n = claude.messages.count_tokens(model="tiny-scripted", system="Be brief.", messages=[{"role": "user", "content": QUESTION}])
    r = client.chat.completions.create(model="tiny-scripted", max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert n.input_tokens == r.usage.prompt_tokens


def test_anthropic_errors(claude, server):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny-scripted", max_tokens=10, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    status, _, body = server.json("POST", "/v1/messages", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
    status, _, body = server.request("POST", "/v1/messages", b"{not json")
    assert status == 400 and json.loads(body)["type"] == "error"


# ---- litellm ----

def test_litellm_openai_provider(server, monkeypatch):
    # litellm would otherwise fetch its model price list from the network on import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="openai/tiny-scripted", api_base=server.base + "/v1", api_key="unused", temperature=0,
                           max_tokens=64, messages=[{"role": "user", "content": QUESTION}])
    assert r.choices[0].message.content == CONTENT
    chunks = litellm.completion(model="openai/tiny-scripted", api_base=server.base + "/v1", api_key="unused", temperature=0,
                                max_tokens=64, stream=True, messages=[{"role": "user", "content": QUESTION}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == CONTENT
    r = litellm.completion(model="openai/tiny-scripted", api_base=server.base + "/v1", api_key="unused", temperature=0, max_tokens=64,
                           tools=CHAT_TOOLS, tool_choice="required", messages=[{"role": "user", "content": QUESTION}])
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and is_time_args(json.loads(call.function.arguments))
