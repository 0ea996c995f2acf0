"""vLLM's request extras, `/tokenize` and `/detokenize`, and the operational surface (request
ids, the access log, vLLM metric names, `/v1/health`, flags from the environment), against
the real binary serving the bundled model (models/orchid-tiny)."""

from __future__ import annotations

import os
import re

import pytest

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

MODEL = "orchid-tiny"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def server():
    s = S.Server(S.REPO / "models" / "orchid-tiny", "--max-context", "2048", "--max-seqs", "8", name="bundled").wait_ready()
    yield s
    s.stop()


def post(server, path, body, headers=None):
    status, h, data = server.request("POST", path, body, headers)
    import json

    return status, h, json.loads(data) if data.strip().startswith(b"{") else data


def complete(server, **kw):
    status, _, r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": 0, **kw})
    assert status == 200, r
    return r


def token_id(server, text: str) -> int:
    status, _, r = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and r["count"] == 1, r
    return r["tokens"][0]


def test_tokenize_detokenize(server):
    status, _, r = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and r["count"] == len(r["tokens"]) > 5 and r["max_model_len"] == 2048
    assert "".join(r["token_strs"]) == PROMPT
    status, _, d = post(server, "/detokenize", {"model": MODEL, "tokens": r["tokens"]})
    assert status == 200 and d == {"prompt": PROMPT}
    status, _, chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and chat["count"] > 3
    status, _, e = post(server, "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and e["error"]["param"] == "tokens[0]"
    status, _, e = post(server, "/tokenize", {})
    assert status == 400 and e["error"]["param"] == "prompt"


def test_n_choices(server):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=3, max_tokens=8,
                                  temperature=1.0, seed=5, extra_body=NO_THINK)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in r.choices}) > 1
    assert r.usage.completion_tokens == 24
    texts, finished = {}, set()
    for chunk in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=6,
                                           temperature=0, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "") + (getattr(ch.delta, "reasoning_content", None) or "")
            if ch.finish_reason:
                finished.add(ch.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == 12
    assert finished == {0, 1} and texts[0] == texts[1]  # greedy: the same text twice
    r = complete(server, n=2, max_tokens=4)
    assert [ch["index"] for ch in r["choices"]] == [0, 1] and r["choices"][0]["text"] == r["choices"][1]["text"]


def test_logit_bias_stop_token_ids_and_min_tokens(server):
    x = token_id(server, " sea")
    r = complete(server, max_tokens=3, logit_bias={str(x): 100})
    assert r["choices"][0]["text"] == " sea" * 3
    r = complete(server, max_tokens=8, logit_bias={str(x): 100}, stop_token_ids=[x])
    ch = r["choices"][0]
    assert (ch["text"], ch["finish_reason"], ch["stop_reason"], r["usage"]["completion_tokens"]) == ("", "stop", x, 1)
    r = complete(server, max_tokens=8, logit_bias={str(x): 100}, stop_token_ids=[x], min_tokens=3)
    ch = r["choices"][0]
    assert (ch["finish_reason"], ch["stop_reason"], r["usage"]["completion_tokens"]) == ("stop", x, 4)
    assert " sea" not in ch["text"]
    # ignore_eos with min_tokens = max_tokens: exactly that many tokens.
    r = complete(server, max_tokens=20, min_tokens=20, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 20 and r["choices"][0]["finish_reason"] == "length"
    status, _, e = post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}})
    assert status == 400 and e["error"]["param"] == "logit_bias.999999999"


def test_stop_strings_kept_and_reported(server):
    full = complete(server, max_tokens=16)["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    r = complete(server, max_tokens=16, stop=[stop])["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == (cut, "stop", stop)
    r = complete(server, max_tokens=16, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert (r["text"], r["stop_reason"]) == (cut + stop, stop)
    r = complete(server, max_tokens=16)["choices"][0]
    assert r["stop_reason"] is None


def test_assistant_prefill(server):
    c = server.client()
    prefix = "Once upon a time"
    msgs = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": prefix}]
    status, _, tok = post(server, "/tokenize", {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False})
    assert status == 200
    status, _, text = post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert text["prompt"].endswith(prefix)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == tok["count"] and r.choices[0].message.content
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=2, extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_skip_special_tokens(server):
    c = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0)
    on = c.chat.completions.create(**kw)
    off = c.chat.completions.create(**kw, extra_body={"skip_special_tokens": False})
    assert on.usage.completion_tokens == off.usage.completion_tokens
    assert isinstance(off.choices[0].message.content, str)


def test_refused_and_unknown_fields(server):
    status, _, e = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True})
    assert status == 400 and e["error"]["param"] == "use_beam_search"
    for _ in range(2):
        status, _, r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "my_custom_field_xyz": 1})
        assert status == 200
    assert server.log().count("unknown request field `my_custom_field_xyz`") == 1


def test_request_ids_and_access_log(server):
    status, h, _ = server.request("GET", "/v1/health")
    assert status == 200 and re.fullmatch(r"req-[0-9a-f]{24}", h["x-request-id"])
    status, h, _ = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3}, headers={"X-Request-Id": "my-id-42"})
    assert status == 200 and h["x-request-id"] == "my-id-42"
    status, h, _ = post(server, "/v1/completions", {"prompt": 5}, headers={"X-Request-Id": "bad-id-7"})
    assert status == 400 and h["x-request-id"] == "bad-id-7"
    status, h, body = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                                     "stream": True}, headers={"X-Request-Id": "stream-id-9"})
    assert status == 200 and h["x-request-id"] == "stream-id-9"
    log = server.log()
    line = next(ln for ln in log.splitlines() if "request_id=my-id-42" in ln and "orchid::access" in ln)
    assert re.search(r"POST /v1/completions 200 prompt_tokens=\d+ cached_tokens=\d+ completion_tokens=3 ttft=[0-9.]+ms duration=[0-9.]+ms", line), line
    assert re.search(r"POST /v1/completions 400 .*request_id=bad-id-7", log)
    assert re.search(r"POST /v1/chat/completions 200 prompt_tokens=\d+ cached_tokens=\d+ completion_tokens=3 .*request_id=stream-id-9", log)


def test_vllm_metric_names(server):
    complete(server, max_tokens=2)
    m = server.metrics()
    label = f'{{model_name="{MODEL}"}}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert name + label in m, name
    assert m["vllm:prompt_tokens_total" + label] == m["orchid_prompt_tokens_total"] > 0
    assert m[f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="length"}}'] >= 1


def test_flags_from_the_environment_and_aliases():
    out = S.subprocess.run([str(S.orchid_binary()), "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    for alias in ("--max-model-len", "--max-num-seqs", "--served-model-name", "--max-num-batched-tokens", "--gpu-memory-utilization"):
        assert alias in out, alias
    assert "ORCHID_MAX_SEQS" in out and "ORCHID_PORT" in out and "ORCHID_GPU_MEMORY_UTILIZATION" in out
    assert "ORCHID_PREFILL_CHUNK" in out and "ORCHID_MAX_NUM_BATCHED_TOKENS" in out
    old = {k: os.environ.get(k) for k in ("ORCHID_MAX_SEQS", "ORCHID_MODEL_ID")}
    os.environ.update(ORCHID_MAX_SEQS="3", ORCHID_MODEL_ID="from-env")
    try:
        s = S.Server(S.REPO / "models" / "orchid-tiny", "--max-model-len", "512", name="env").wait_ready()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        m = s.metrics()
        assert m["orchid_max_sequences"] == 3
        status, _, body = s.json("GET", "/v1/models")
        assert body["data"][0]["id"] == "from-env" and body["data"][0]["max_model_len"] == 512
    finally:
        s.stop()
