"""``mkc serve`` end to end: a real uvicorn process on 127.0.0.1 (CPU backend, tiny random model,
byte-level tokenizer), driven with the official ``openai`` client and raw HTTP.

One server for the whole module; every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from mkc.runtime.tool_calls import parse_tool_calls

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 256
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mkc.runtime.server", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "--random-weights", "--backend", "cpu", "--host", "127.0.0.1", "--port", str(port),
         "--max-batch", "8", "--context", str(CONTEXT), "--log-level", "warning"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with status {proc.returncode} before becoming healthy:\n"
                        f"{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy within 60 s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(base: str, path: str, body: bytes, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def _stream_text(client, **kw) -> tuple[str, str | None, list]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, (finish[-1] if finish else None), chunks


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server + "/health", timeout=5) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_completion_plain_and_streamed(client):
    kw = dict(prompt="The quick brown fox", max_tokens=8, temperature=0)
    a = client.completions.create(model=MODEL, **kw)
    b = client.completions.create(model=MODEL, **kw)
    assert a.choices[0].text == b.choices[0].text  # greedy is deterministic
    assert a.usage.prompt_tokens == len("The quick brown fox".encode())
    assert 1 <= a.usage.completion_tokens <= 8
    assert a.choices[0].finish_reason in ("length", "stop")
    text, finish, chunks = _stream_text(client, stream_options={"include_usage": True}, **kw)
    assert text == a.choices[0].text and finish == a.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == a.usage.completion_tokens


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=8, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 50})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_chat_plain_and_streamed(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert a.object == "chat.completion" and a.choices[0].message.role == "assistant"
    assert a.usage.completion_tokens <= 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (a.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == a.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == a.usage.total_tokens


def test_chat_with_tools_accepted(client):
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    a = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=4, temperature=0)
    # random weights never write a valid call: the text comes back as content
    assert a.choices[0].finish_reason in ("length", "stop") and a.choices[0].message.tool_calls is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=4,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (a.choices[0].message.content or "")


def test_sse_ends_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", int(server.rsplit(":", 1)[1]), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 3,
                                                        "stream": True}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    conn.close()


def test_stop_sequences(client):
    # seeded sampling is reproducible (and, from random weights, more varied than greedy): cut the
    # text at a piece of itself, then ask again with that piece as the stop string
    for seed in range(5):
        kw = dict(prompt="stop test", max_tokens=12, temperature=1.0, seed=seed)
        full = client.completions.create(model=MODEL, **kw).choices[0].text
        if len(full) >= 8:
            break
    else:
        pytest.skip("the random model produced no text long enough to cut")
    stop = full[4:7]
    want = full[:full.index(stop)]
    got = client.completions.create(model=MODEL, stop=[stop, "@@@@"], **kw)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    text, finish, _ = _stream_text(client, stop=stop, **kw)
    assert text == want and finish == "stop"


@pytest.mark.parametrize("kw, status, param", [
    (dict(max_tokens=-1), 400, "max_tokens"),
    (dict(n=2), 400, "n"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt="x" * (CONTEXT + 5)), 400, "prompt"),
    (dict(prompt="x" * (CONTEXT - 10), max_tokens=50), 400, "max_tokens"),
    (dict(model="no-such-model"), 404, "model"),
    (dict(temperature=-1.0), 400, "temperature"),
])
def test_bad_requests_openai_client(client, kw, status, param):
    args = dict(model=MODEL, prompt="hello", max_tokens=4) | kw
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


@pytest.mark.parametrize("body", [
    b"{not json",
    b"[1, 2, 3]",
    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "5"}).encode(),
    json.dumps({"model": MODEL, "prompt": 42}).encode(),
    json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}).encode(),
    json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}).encode(),
    json.dumps({"prompt": "hi"}).encode(),
])
def test_bad_requests_raw(server, body):
    status, out = _post(server, "/v1/completions", body)
    assert status == 400, out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["type"] == "invalid_request_error"


def test_bad_chat_requests(server, client):
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": "hello"}):
        status, out = _post(server, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and out["error"]["param"], out
    # and the server still serves
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok"}],
                                          max_tokens=2).usage.completion_tokens >= 1


def test_concurrent_streams_match_alone(client):
    """32 clients at once (max batch 8): none lost, each stream equal to its request run alone."""
    prompts = [f"client {i:02d} says" for i in range(32)]
    kw = dict(max_tokens=6, temperature=0)
    results: dict[int, tuple[str, str | None]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            text, finish, _ = _stream_text(client, prompt=prompts[i], **kw)
            results[i] = (text, finish)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    assert sorted(results) == list(range(32)), "some streams were lost"
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=p, **kw)
        assert results[i] == (alone.choices[0].text, alone.choices[0].finish_reason), f"client {i}"


def test_disconnect_frees_slot(server):
    aborted = _metric(server, "mkc_requests_total")
    port = int(server.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "long one", "max_tokens": 100,
                                                        "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()  # the first event has arrived: the request is running
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _metric(server, "mkc_running_requests") == 0 and _metric(server, "mkc_requests_total") > aborted:
            break
        time.sleep(0.1)
    assert _metric(server, "mkc_running_requests") == 0
    assert _metric(server, "mkc_generated_tokens_total") > 0
    with urllib.request.urlopen(server + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'mkc_requests_total{finish_reason="abort"}' in text


def test_metrics_exposed(server):
    with urllib.request.urlopen(server + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for name in ("mkc_requests_total", "mkc_generated_tokens_total", "mkc_time_to_first_token_seconds_count",
                 "mkc_inter_token_latency_seconds_count", "mkc_batch_occupancy", "mkc_kv_pages_in_use",
                 "mkc_kv_slots_in_use", "mkc_http_errors_total"):
        assert name in text, name


def test_tool_calls_parsed():
    names = {"get_weather"}
    calls, rest = parse_tool_calls('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', names)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert rest is None
    calls, _ = parse_tool_calls('<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city": "Oslo"}}]'
                                '<|END_ACTION|>', names)
    assert calls[0].name == "get_weather"
    assert parse_tool_calls('{"name": "rm_rf", "arguments": {}}', names) == ([], '{"name": "rm_rf", "arguments": {}}')
    assert parse_tool_calls("just text", names) == ([], "just text")
