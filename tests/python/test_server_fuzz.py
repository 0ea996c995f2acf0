"""A bounded fuzz test of `orchid serve` (the bundled model): a few thousand generated requests
(random JSON, valid requests with one field replaced by random JSON, broken bytes) against
every POST endpoint. It asserts that

* no response is a 5xx, except 503 (overload; documented in docs/server.md),
* every error is the endpoint's JSON error envelope (OpenAI's; Anthropic's on /v1/messages),
* the server still answers a normal request correctly afterwards,
* its resident memory stays bounded (VmRSS from /proc).

Generation is kept short (token limits in the generated requests are capped) so the whole
test runs in about a minute on two cores. Hypothesis runs derandomized: the same requests
every run.
"""

from __future__ import annotations

import json
import sys

import pytest

import test_server_support as S

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [
    pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem())),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

FUZZ = settings(max_examples=1000, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "thinking_token_budget")
MAX_TOKENS = 6

VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 4},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/tokenize": {"prompt": "Hi there"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = sorted({
    "model", "messages", "prompt", "input", "instructions", "system", "n", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_sequences", "stream",
    "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs", "echo", "logit_bias", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "continue_final_message",
    "add_generation_prompt", "chat_template_kwargs", "reasoning_effort", "reasoning", "thinking", "store",
    "response_format", "text", "tokens", "return_token_strs", "use_beam_search", "metadata", *TOKEN_LIMITS,
})

json_scalars = st.none() | st.booleans() | st.integers(min_value=-2 ** 63, max_value=2 ** 64) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                           max_leaves=25)


@pytest.fixture(scope="module")
def server():
    s = S.Server(S.REPO / "models" / "orchid-tiny", "--max-context", "512", "--max-seqs", "4", "--max-queue", "16",
                 name="fuzz").wait_ready()
    yield s
    s.stop()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cap(body):
    """Keeps generation short: token limits above MAX_TOKENS are lowered, `n` too."""
    if isinstance(body, dict):
        for k in TOKEN_LIMITS:
            v = body.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_TOKENS:
                body[k] = MAX_TOKENS
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and 4 < body["n"] <= 16:
            body["n"] = 4
    return body


def check(server, path: str, body) -> int:
    raw = body if isinstance(body, bytes) else json.dumps(cap(body)).encode()
    status, headers, data = server.request("POST", path, raw, timeout=120)
    assert status < 500 or status == 503, (path, raw[:300], status, data[:300])
    if status >= 400:
        err = json.loads(data)
        if path == "/v1/messages":
            assert err["type"] == "error" and set(err["error"]) >= {"type", "message"}, err
        else:
            assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert headers.get("x-request-id")
    return status


@pytest.fixture(scope="module")
def baseline(server):
    # Warm up every endpoint once, then take the memory baseline.
    for path, body in VALID.items():
        assert check(server, path, dict(body)) == 200, path
    return rss_kib(server.proc.pid)


@FUZZ
@given(path=st.sampled_from(sorted(VALID)), body=json_values)
def test_random_json(server, baseline, path, body):
    check(server, path, body)


@FUZZ
@given(path=st.sampled_from(sorted(VALID)), field=st.sampled_from(FIELDS), value=json_values, stream=st.booleans())
def test_valid_requests_with_one_field_replaced(server, baseline, path, field, value, stream):
    body = dict(VALID[path])
    if stream and path not in ("/tokenize", "/detokenize"):
        body["stream"] = True
    body[field] = value
    check(server, path, body)


@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(VALID)), data=st.binary(max_size=200))
def test_broken_bytes(server, baseline, path, data):
    check(server, path, data)


def test_still_serving_and_memory_bounded(server, baseline):
    r = server.client().completions.create(model="orchid-tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 5
    status, _, health = server.json("GET", "/health")
    assert status == 200 and health["status"] == "ok"
    grown = rss_kib(server.proc.pid) - baseline
    assert grown < 150 * 1024, f"RSS grew by {grown} KiB over the fuzz run"
