"""The prefix cache through the real server on the bundled model: `usage.prompt_tokens_details
.cached_tokens` on every response (chat and completions, streamed usage too), greedy output identical
to a server started with `--prefix-cache off`, the /metrics counters, the request log line, and the
share of a multi-turn conversation's prompt tokens that the cache serves (printed)."""

from __future__ import annotations

import re

import pytest

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

SYSTEM = ("You are a patient guide to the natural history of rivers. " * 3 + "You answer in plain words, "
          "you keep each answer short, and you never invent facts about places you do not know. " * 4)
QUESTIONS = ["Where do rivers begin?", "Why do some rivers flood every spring?", "What is a delta?",
             "How do rivers carve canyons?", "Which animals live near river mouths?"]


@pytest.fixture(scope="module")
def servers(repo_root):
    model = repo_root / "models" / "orchid-tiny"
    on = S.Server(model, "--max-context", "4096", "--max-seqs", "4", name="cache-on").wait_ready()
    off = S.Server(model, "--max-context", "4096", "--max-seqs", "4", "--prefix-cache", "off", name="cache-off").wait_ready()
    yield on, off
    on.stop()
    off.stop()


def chat(server, messages, stream=False):
    body = {"model": "orchid-tiny", "messages": messages, "max_tokens": 40, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        status, _, data = server.request("POST", "/v1/chat/completions", body)
        assert status == 200, data
        events = S.sse_events(data)
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert len(usage) == 1
        msg = {"content": "".join((e["choices"][0]["delta"].get("content") or "") for e in events
                                  if isinstance(e, dict) and e.get("choices")),
               "reasoning_content": "".join((e["choices"][0]["delta"].get("reasoning_content") or "") for e in events
                                            if isinstance(e, dict) and e.get("choices"))}
        return msg, usage[0]
    status, _, r = server.json("POST", "/v1/chat/completions", body)
    assert status == 200, r
    m = r["choices"][0]["message"]
    return {"content": m.get("content") or "", "reasoning_content": m.get("reasoning_content") or ""}, r["usage"]


def test_conversation_reuses_earlier_turns(servers):
    on, off = servers
    hist_on = [{"role": "system", "content": SYSTEM}]
    hist_off = [{"role": "system", "content": SYSTEM}]
    prompt_total = cached_total = 0
    for i, q in enumerate(QUESTIONS):
        hist_on.append({"role": "user", "content": q})
        hist_off.append({"role": "user", "content": q})
        a, u = chat(on, hist_on, stream=i % 2 == 1)
        b, v = chat(off, hist_off)
        assert a == b, f"turn {i}: output differs with the cache on"
        assert u["prompt_tokens"] == v["prompt_tokens"]
        assert v["prompt_tokens_details"]["cached_tokens"] == 0
        c = u["prompt_tokens_details"]["cached_tokens"]
        assert c % 64 == 0 and c <= u["prompt_tokens"] - 2
        if i:
            assert c > 0, f"turn {i} found nothing cached"
            prompt_total += u["prompt_tokens"]
            cached_total += c
        for h, m in ((hist_on, a), (hist_off, b)):
            h.append({"role": "assistant", **m})
    share = cached_total / prompt_total
    print(f"prefix cache: turns 2-{len(QUESTIONS)} took {cached_total} of {prompt_total} prompt tokens from the cache ({share:.0%})")
    assert share > 0.5
    m = on.metrics()
    assert m["orchid_prefix_cache_hits_total"] >= len(QUESTIONS) - 1
    assert m["orchid_prefix_cache_tokens_total"] >= cached_total
    assert m["orchid_prefix_cache_bytes"] > 0
    assert m["orchid_prefix_cache_entries"] > 0
    assert off.metrics()["orchid_prefix_cache_entries"] == 0
    assert re.search(r"prompt_tokens=[1-9][0-9]* cached_tokens=[1-9][0-9]* ", on.log())


def test_completions_share_a_prefix(servers):
    on, off = servers
    prefix = "The old map showed every river of the valley, and beside each one a note in small letters. " * 6
    outs = []
    for i, tail in enumerate(["The first note said", "The second note said", "The last note said"]):
        body = {"model": "orchid-tiny", "prompt": prefix + tail, "max_tokens": 16, "temperature": 0}
        if i == 2:
            body.update(stream=True, stream_options={"include_usage": True})
            status, _, data = on.request("POST", "/v1/completions", body)
            assert status == 200
            events = [e for e in S.sse_events(data) if isinstance(e, dict)]
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            usage = [e["usage"] for e in events if e.get("usage")][0]
        else:
            status, _, r = on.json("POST", "/v1/completions", body)
            assert status == 200, r
            text, usage = r["choices"][0]["text"], r["usage"]
        body.pop("stream", None)
        body.pop("stream_options", None)
        status, _, ref = off.json("POST", "/v1/completions", body)
        assert text == ref["choices"][0]["text"]
        outs.append(usage["prompt_tokens_details"]["cached_tokens"])
    # The first request has nothing cached; the second finds none at the shared part's end yet
    # (it saves one there); the third restores it.
    assert outs[0] == 0 and outs[2] > 0 and outs[2] % 64 == 0
