"""Serving several clients: batching does not change anyone's output, a client that leaves
frees its sequence at once, and SIGTERM/SIGINT shut the server down cleanly."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import test_server_support as S

pytestmark = pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))

PROMPTS = [f"Request number {i}: tell me about {topic}." for i, topic in enumerate(
    ["owls", "rivers", "the moon", "bread", "glaciers", "violins", "chess", "tea", "volcanoes", "bees",
     "ships", "deserts", "clocks", "comets", "maps", "tigers"])]


@pytest.fixture(scope="module")
def server() -> S.Server:
    return S.shared_server("random")


def wait_for(pred, what: str, timeout: float = 20.0):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_16_concurrent_streams_match_solo_runs(server):
    client = server.client()
    kw = dict(model="tiny-random", max_tokens=24, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})

    def solo(p):
        r = client.chat.completions.create(messages=[{"role": "user", "content": p}], **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    def streamed(p):
        text, finish = "", None
        for chunk in client.chat.completions.create(messages=[{"role": "user", "content": p}], stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    alone = [solo(p) for p in PROMPTS]
    assert len({a for a, _ in alone}) == len(PROMPTS), "prompts should give distinct outputs"
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], server.metrics()["orchid_running_sequences"])
            time.sleep(0.02)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(streamed, PROMPTS))
    stop.set()
    w.join()
    assert together == alone
    assert peak[0] > 1, "the requests should have been batched together"


def open_stream(server, body: dict) -> socket.socket:
    """Starts a streaming request on a raw socket and reads its first bytes."""
    s = socket.create_connection((server.host, server.port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    return s


def test_client_disconnect_cancels_and_frees_the_slot(server):
    before = server.metrics()
    s = open_stream(server, {"prompt": "Go on forever", "max_tokens": 3000, "temperature": 0, "stream": True})
    assert server.metrics()["orchid_running_sequences"] >= 1
    s.close()
    wait_for(lambda: server.metrics()["orchid_running_sequences"] == 0, "the sequence to be freed", 10)
    after = server.metrics()
    assert after["orchid_cancelled_requests_total"] == before["orchid_cancelled_requests_total"] + 1
    assert after['orchid_request_finish_total{reason="cancelled"}'] >= 1
    # It stopped long before 3000 tokens.
    assert after["orchid_generation_tokens_total"] - before["orchid_generation_tokens_total"] < 1000
    assert after["orchid_state_memory_bytes"] <= before["orchid_state_memory_bytes"]


def test_disconnect_of_a_non_streaming_request(server):
    before = server.metrics()["orchid_cancelled_requests_total"]
    s = socket.create_connection((server.host, server.port), timeout=60)
    data = json.dumps({"prompt": "Go on forever", "max_tokens": 3000, "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data)
    wait_for(lambda: server.metrics()["orchid_running_sequences"] >= 1, "the request to start")
    s.close()
    wait_for(lambda: server.metrics()["orchid_running_sequences"] == 0, "the sequence to be freed", 10)
    assert server.metrics()["orchid_cancelled_requests_total"] == before + 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(sig):
    srv = S.Server(S.random_checkpoint(), "--shutdown-timeout", "1", "--max-context", "8192", name=f"shutdown-{sig.name}").wait_ready()
    # One request that finishes within the grace period, one that cannot.
    short = open_stream(srv, {"prompt": "short", "max_tokens": 4, "temperature": 0, "stream": True})
    long = open_stream(srv, {"prompt": "long", "max_tokens": 8000, "temperature": 0, "stream": True})
    t0 = time.time()
    srv.proc.send_signal(sig)
    rc = srv.proc.wait(30)
    assert rc == 0, srv.log()
    assert time.time() - t0 < 15
    for s in (short, long):
        rest = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        s.close()
        assert b"data: [DONE]" in rest
    log = srv.log()
    assert "shutdown signal received" in log and "server stopped" in log
    # The listener is gone.
    with pytest.raises(OSError):
        socket.create_connection((srv.host, srv.port), timeout=2).close()
