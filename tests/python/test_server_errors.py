"""Every error `orchid serve` documents comes back with its status and the OpenAI envelope
`{"error": {"message", "type", "param", "code"}}`, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> S.Server:
    return S.shared_server("random")


def envelope(body: dict, param=None, code=None) -> dict:
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}, body
    assert isinstance(e["message"], str) and e["message"]
    assert isinstance(e["type"], str) and e["type"]
    assert e["param"] == param, body
    if code is not None:
        assert e["code"] == code, body
    return e


@pytest.mark.parametrize("field,value,param", [
    ("temperature", 3, "temperature"),
    ("temperature", "warm", "temperature"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -5, "top_k"),
    ("min_p", -0.1, "min_p"),
    ("presence_penalty", 9, "presence_penalty"),
    ("frequency_penalty", -9, "frequency_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("max_tokens", 0, "max_tokens"),
    ("max_completion_tokens", "many", "max_completion_tokens"),
    ("seed", 1.5, "seed"),
    ("stop", [1, 2], "stop[0]"),
    ("n", 400, "n"),
    ("logit_bias", {"x": 1}, "logit_bias.x"),
    ("use_beam_search", True, "use_beam_search"),
    ("logprobs", "yes", "logprobs"),
    ("top_logprobs", 50, "top_logprobs"),
    ("stream", 1, "stream"),
    ("stream_options", {"include_usage": True}, "stream_options"),
    ("messages", [], "messages"),
    ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], "messages[0].content[0].type"),
    ("tools", "all", "tools"),
    ("tool_choice", "maybe", "tool_choice"),
    ("response_format", {"type": "yaml"}, "response_format.type"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}, "response_format"),
    ("guided_regex", "(unclosed", "guided_regex"),
    ("structured_outputs", {"grammar": "start: nope_undefined_rule"}, "structured_outputs.grammar"),
    ("structured_outputs", {"structural_tag": "x"}, "structured_outputs.structural_tag"),
    ("reasoning_effort", "extreme", "reasoning_effort"),
    ("chat_template_kwargs", 5, "chat_template_kwargs"),
])
def test_invalid_values_are_400_naming_the_field(server, field, value, param):
    status, _, body = server.json("POST", CHAT, {"messages": MSGS, "max_tokens": 2, field: value})
    assert status == 400, body
    envelope(body, param=param)
    assert body["error"]["type"] == "invalid_request_error"


def test_template_refusals_are_400(server):
    # The Qwen3.5 template refuses a system message that is not first.
    msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    status, _, body = server.json("POST", CHAT, {"messages": msgs, "max_tokens": 2})
    assert status == 400
    envelope(body, param="messages")


def test_completion_errors(server):
    for bad, param in [({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                       ({"prompt": [999999999]}, "prompt"), ({"prompt": "x", "logprobs": 99}, "logprobs"),
                       ({"prompt": "x", "suffix": "y"}, "suffix")]:
        status, _, body = server.json("POST", "/v1/completions", bad)
        assert status == 400, (bad, body)
        envelope(body, param=param)


def test_context_length_exceeded(server):
    long_text = "hello " * 5000  # > 4096 tokens
    status, _, body = server.json("POST", CHAT, {"messages": [{"role": "user", "content": long_text}]})
    assert status == 400
    envelope(body, param="messages", code="context_length_exceeded")
    status, _, body = server.json("POST", "/v1/completions", {"prompt": long_text})
    assert status == 400
    envelope(body, param="prompt", code="context_length_exceeded")


def test_unknown_model_route_and_method(server):
    status, _, body = server.json("POST", CHAT, {"model": "nope", "messages": MSGS})
    assert status == 404
    envelope(body, param="model", code="model_not_found")
    status, _, body = server.json("GET", "/v1/nothing")
    assert status == 404
    envelope(body)
    status, _, body = server.json("POST", "/v1/models")
    assert status == 405
    envelope(body)
    status, _, body = server.json("GET", "/v1/models/nope")
    assert status == 404
    envelope(body, param="model")


def test_malformed_json(server):
    for raw in (b"{", b"not json", b"[1, 2]", b"", "{\"messages\": \"\u00e9\"".encode()):
        status, _, data = server.request("POST", CHAT, raw)
        assert status == 400, raw
        envelope(json.loads(data))


def test_oversized_body_is_413(server):
    # Declared size over the limit (8 MiB): refused from the headers, before the body is read.
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 20000000\r\n\r\n{\"messages\": ")
        resp = b""
        while b"\r\n\r\n" not in resp or not resp.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            resp += chunk
    head, _, body = resp.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    envelope(json.loads(body), code="request_too_large")
    # A body that really is too large, sent chunked (no declared size): refused once the limit
    # is crossed while reading. The server answers before the client has sent everything, so
    # send from a thread (ignoring the broken pipe) and read the answer here.
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")

        def send_body():
            piece = b"x" * (1 << 20)
            try:
                for _ in range(12):
                    s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
                s.sendall(b"0\r\n\r\n")
            except OSError:
                pass

        t = threading.Thread(target=send_body, daemon=True)
        t.start()
        resp = b""
        try:
            while not (b"\r\n\r\n" in resp and resp.rstrip().endswith(b"}")):
                chunk = s.recv(65536)
                if not chunk:
                    break
                resp += chunk
        except ConnectionResetError:
            pass
        t.join(30)
    head, _, body = resp.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), resp[:200]
    # The body may be chunk-framed: take the JSON object out.
    envelope(json.loads(body[body.index(b"{"):body.rindex(b"}") + 1]), code="request_too_large")


def test_overload_is_503_with_retry_after():
    srv = S.Server(S.random_checkpoint(), "--max-seqs", "1", "--max-queue", "1", "--max-context", "4096", name="overload").wait_ready()
    try:
        stop = threading.Event()
        started = []

        def long_stream():
            # Holds the only sequence slot while `stop` is unset.
            with socket.create_connection((srv.host, srv.port), timeout=60) as s:
                body = b'{"prompt": "x", "max_tokens": 3000, "temperature": 0, "stream": true}'
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)
                s.recv(4096)
                started.append(True)
                stop.wait(60)

        threads = [threading.Thread(target=long_stream, daemon=True) for _ in range(2)]
        threads[0].start()
        deadline = time.time() + 30
        while srv.metrics()["orchid_running_sequences"] < 1:
            assert time.time() < deadline
            time.sleep(0.05)
        threads[1].start()  # waits in the queue (size 1)
        while srv.metrics()["orchid_queue_depth"] < 1:
            assert time.time() < deadline
            time.sleep(0.05)
        status, headers, data = srv.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503
        assert int(headers["retry-after"]) >= 1
        envelope(json.loads(data), code="overloaded")
        stop.set()
        for t in threads:
            t.join(30)
        # The slot frees once the streams are gone; the server serves again.
        deadline = time.time() + 30
        while True:
            status, _, _ = srv.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
            if status == 200:
                break
            assert time.time() < deadline, "server did not recover after overload"
            time.sleep(0.1)
    finally:
        assert srv.stop() == 0


def test_still_serving_after_errors(server):
    status, _, body = server.json("POST", CHAT, {"messages": MSGS, "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    m = server.metrics()
    assert m['orchid_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert m['orchid_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    status, _, _ = server.request("GET", "/health")
    assert status == 200


def test_unloadable_checkpoint_exits_nonzero(tmp_path):
    """The server listens at once (health 503 while loading); a checkpoint that cannot be
    loaded ends the process with an error instead of serving 503 forever."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(S.random_checkpoint(), bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    log = tmp_path / "log"
    with open(log, "w") as out:
        p = S.subprocess.run([str(S.orchid_binary()), "serve", "--model", str(bad), "--port", "0", "--device", "cpu"],
                             stdout=out, stderr=S.subprocess.STDOUT, timeout=120)
    assert p.returncode != 0
    text = log.read_text()
    assert "listening on" in text and "could not be loaded" in text, text
