"""`orchid serve` end to end with the official `openai` client and plain HTTP, on a small
random checkpoint (`orchid synth --preset tiny-test`): chat and completions, streaming and not,
stop strings, max_tokens, seeds, logprobs, usage. See test_server_support.py for the setup."""

from __future__ import annotations

import json

import pytest

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

GREEDY = {"temperature": 0}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server() -> S.Server:
    return S.shared_server("random")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def stream_chat(client, **kw) -> tuple[str, str, str | None, list]:
    """(content, reasoning, finish_reason, chunks) of a streamed chat completion."""
    content, reasoning, finish, chunks = "", "", None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, finish, chunks


def reasoning_of(message) -> str | None:
    return getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")


def test_models_health_metrics(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-random"]
    status, _, body = server.json("GET", "/health")
    assert status == 200 and body["status"] == "ok"
    m = server.metrics()
    assert m["orchid_model_loaded"] == 1
    assert m["orchid_max_sequences"] == 16
    for name in ("orchid_queue_depth", "orchid_running_sequences", "orchid_state_memory_bytes",
                 "orchid_prompt_tokens_total", "orchid_generation_tokens_total",
                 "orchid_time_to_first_token_seconds_count", "orchid_inter_token_latency_seconds_count"):
        assert name in m, name


def test_chat_non_streaming_shape(client):
    r = client.chat.completions.create(model="tiny-random", messages=user("Hello there"), max_tokens=8, user="u-1", **GREEDY, extra_body=NO_THINK)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny-random"
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason in ("length", "stop")
    u = r.usage
    assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.completion_tokens_details.reasoning_tokens == 0
    if c.finish_reason == "length":
        assert u.completion_tokens == 8


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_stream_equals_non_stream(client, thinking):
    kw = dict(model="tiny-random", messages=user("Tell me a story about a fox."), max_tokens=24, **GREEDY,
              extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    r = client.chat.completions.create(**kw)
    content, reasoning, finish, chunks = stream_chat(client, **kw)
    assert content == (r.choices[0].message.content or "")
    assert reasoning == (reasoning_of(r.choices[0].message) or "")
    assert finish == r.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    if thinking:
        # The template opens <think> in the prompt: the output is reasoning until </think>.
        assert reasoning and r.usage.completion_tokens_details.reasoning_tokens > 0
    else:
        assert content and not reasoning


def test_completions_stream_equals_non_stream(client):
    kw = dict(model="tiny-random", prompt="Once upon a time", max_tokens=20, **GREEDY)
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kw):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert text == r.choices[0].text and text
    assert finish == r.choices[0].finish_reason
    assert r.usage.completion_tokens == 20 or r.choices[0].finish_reason == "stop"


def test_completions_token_prompt_and_echo(server):
    status, _, a = server.json("POST", "/v1/completions", {"prompt": "Hello world", "max_tokens": 6, **GREEDY, "echo": True})
    assert status == 200
    assert a["choices"][0]["text"].startswith("Hello world")
    status, _, b = server.json("POST", "/v1/completions", {"prompt": "Hello world", "max_tokens": 6, **GREEDY})
    assert a["choices"][0]["text"] == "Hello world" + b["choices"][0]["text"]
    # A prompt of token ids: echoed as its text only when asked.
    status, _, ids = server.json("POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200
    for echo in (True, False):
        status, _, c = server.json("POST", "/v1/completions", {"prompt": ids["tokens"], "max_tokens": 6, **GREEDY, "echo": echo})
        assert status == 200
        assert c["choices"][0]["text"] == ("Hello world" if echo else "") + b["choices"][0]["text"]


def test_max_tokens(client):
    r = client.chat.completions.create(model="tiny-random", messages=user("Count"), max_completion_tokens=5, **GREEDY, extra_body=NO_THINK)
    assert r.usage.completion_tokens <= 5
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 5
    r = client.completions.create(model="tiny-random", prompt="Count", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens <= 3


def test_max_tokens_clipped_to_context(server):
    # A token-id prompt 4 tokens short of the context (4096): at most 4 tokens come back.
    ids = [9707] * 4092
    status, _, r = server.json("POST", "/v1/completions", {"prompt": ids, "max_tokens": 500, **GREEDY})
    assert status == 200, r
    assert r["usage"]["prompt_tokens"] == 4092 and r["usage"]["completion_tokens"] <= 4
    assert r["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_are_cut_and_never_emitted(client, stream):
    base = dict(model="tiny-random", messages=user("Write something long."), max_tokens=40, **GREEDY, extra_body=NO_THINK)
    full = client.chat.completions.create(**base).choices[0].message.content
    assert len(full) > 12, full
    stop = full[8:11]
    want = full[: full.find(stop)]
    if stream:
        content, _, finish, _ = stream_chat(client, stop=[stop, "never-appears"], **base)
    else:
        r = client.chat.completions.create(stop=stop, **base)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert content == want and stop not in content
    assert finish == "stop"


def test_seed_reproducibility(client):
    kw = dict(model="tiny-random", messages=user("Random words please"), max_tokens=24, temperature=1.0, top_p=1.0, extra_body=NO_THINK)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=4321, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_chat_logprobs(client):
    kw = dict(model="tiny-random", messages=user("Logprobs"), max_tokens=10, logprobs=True, top_logprobs=3, **GREEDY, extra_body=NO_THINK)
    r = client.chat.completions.create(**kw)
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens
    for t in lps:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.logprob == pytest.approx(tops[0])  # greedy picks the most likely token
        assert t.token == t.top_logprobs[0].token and isinstance(t.bytes, list)
    if r.choices[0].finish_reason == "length":
        spelled = b"".join(bytes(t.bytes) for t in lps).decode("utf-8", "replace")
        assert spelled == r.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lps]
    r = client.chat.completions.create(model="tiny-random", messages=user("x"), max_tokens=2, **GREEDY)
    assert r.choices[0].logprobs is None


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny-random", prompt="The sky is", max_tokens=6, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_stream_include_usage(server):
    body = {"messages": user("Usage please"), "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
    status, headers, data = server.request("POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = S.sse_events(data)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] <= 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == 1
    # Without include_usage there is no usage chunk.
    body.pop("stream_options")
    events = S.sse_events(server.request("POST", "/v1/chat/completions", body)[2])
    assert all("usage" not in c for c in events[:-1])


def test_content_parts_and_roles(client):
    r = client.chat.completions.create(
        model="tiny-random",
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
        max_tokens=4, **GREEDY, extra_body={"unknown_field": {"is": "ignored"}})
    assert r.choices[0].message.content is not None


def test_n_above_the_limit_rejected(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x"), n=100, max_tokens=2)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "n"


def test_unknown_model_is_404(client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=user("x"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_sse_wire_format(server):
    status, _, data = server.request("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True, **GREEDY})
    assert status == 200
    text = data.decode()
    assert text.endswith("data: [DONE]\n\n")
    for block in text.split("\n\n")[:-2]:
        assert block.startswith("data: {")
        json.loads(block[6:])
