"""``mkc serve`` end to end: a real uvicorn process on 127.0.0.1 (CPU backend, tiny random model,
byte-level tokenizer), driven with the official ``openai`` client and raw HTTP.

One server for the whole module; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from mkc import settings
from mkc.runtime.engine import Output
from mkc.runtime.server import CompletionRequest, StreamOptions, _completion_choices, _stream
from mkc.runtime.tool_calls import parse_tool_calls

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 256
MODEL = "tiny"
# cpu everywhere; MKC_TEST_SERVE_BACKEND=cuda runs the same client tests against the megakernel
BACKEND = settings.MKC_TEST_SERVE_BACKEND.get()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve(log_dir: Path, *args: str):
    """A server process on a free port with ``args``; yields its base URL, stops it after."""
    with _serve_process(log_dir, *args) as (base, _):
        yield base


@contextlib.contextmanager
def _serve_process(log_dir: Path, *args: str, context: int = CONTEXT):
    """_serve, yielding (base URL, the server's process)."""
    port = _free_port()
    log_path = log_dir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mkc.runtime.server", *args, "--backend", BACKEND, "--host", "127.0.0.1",
             "--port", str(port), "--max-batch", "8", "--context", str(context), "--log-level", "warning"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
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
                    pytest.fail(f"server not healthy within 60 s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.2)
            yield base, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _serve(tmp_path_factory.mktemp("server"), "--config", str(ROOT / "configs" / "tiny.yaml"),
                "--random-weights") as base:
        yield base


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
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE):
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
    kw = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    a = client.completions.create(model=MODEL, **kw)
    b = client.completions.create(model=MODEL, **kw)
    assert a.choices[0].text == b.choices[0].text  # greedy is deterministic
    assert a.usage.prompt_tokens == len(b"The quick brown fox")
    assert 1 <= a.usage.completion_tokens <= 8
    assert a.choices[0].finish_reason in ("length", "stop")
    text, finish, chunks = _stream_text(client, stream_options={"include_usage": True}, **kw)
    assert text == a.choices[0].text and finish == a.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == a.usage.completion_tokens


def test_seeded_sampling_repeats(client):
    kw = {"model": MODEL, "prompt": "seeded", "max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 1234,
              "extra_body": {"top_k": 50}}
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


def test_stream_ends_failed_generation_with_error_event():
    """In process, no server: a generation that fails mid-stream sends the text so far, an OpenAI
    error event, the usage asked for and [DONE]."""
    outs = [Output("r", "ab", [1, 2], prompt_tokens=3, completion_tokens=2),
            Output("r", "", [], "error", prompt_tokens=3, completion_tokens=2, error="boom")]

    class Gen:
        async def outputs(self):
            for o in outs:
                yield o

    async def events() -> list:
        req = CompletionRequest(model=MODEL, prompt="x", stream_options=StreamOptions(include_usage=True))
        return [e async for e in _stream(types.SimpleNamespace(model_name=MODEL), Gen(), req, "cmpl-1", 0,
                                         "text_completion", _completion_choices)]

    text, error, usage, done = asyncio.run(events())
    assert text["choices"][0]["text"] == "ab" and text["usage"] is None
    assert error == {"error": {"message": "generation failed: boom", "type": "server_error", "param": None,
                               "code": None}}
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert done == "[DONE]"


def test_stop_sequences(client):
    # seeded sampling is reproducible (and, from random weights, more varied than greedy): cut the
    # text at a piece of itself, then ask again with that piece as the stop string
    for seed in range(5):
        kw = {"prompt": "stop test", "max_tokens": 12, "temperature": 1.0, "seed": seed}
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
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"n": 2}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x" * (CONTEXT + 5)}, 400, "prompt"),
    ({"prompt": "x" * (CONTEXT - 10), "max_tokens": 50}, 400, "max_tokens"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"temperature": -1.0}, 400, "temperature"),
])
def test_bad_requests_openai_client(client, kw, status, param):
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 4} | kw
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
                 {"model": MODEL, "messages": "hello"},
                 # an earlier tool call without its function: was a KeyError, answered 500
                 {"model": MODEL, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}):
        status, out = _post(server, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and out["error"]["param"], out
    # content parts: an image, and a text part whose text is no string, each named as it is
    for part, said in (({"type": "image_url", "image_url": {"url": "x"}}, "(got type 'image_url')"),
                       ({"type": "text", "text": 5}, "text must be a string (got int)")):
        body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
        status, out = _post(server, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and said in out["error"]["message"], out
    # and the server still serves
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok"}],
                                          max_tokens=2).usage.completion_tokens >= 1


def test_concurrent_streams_match_alone(client):
    """32 clients at once (max batch 8): none lost, each stream equal to its request run alone."""
    prompts = [f"client {i:02d} says" for i in range(32)]
    kw = {"max_tokens": 6, "temperature": 0}
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


def test_paged_kv_server_matches_slab_server(client, tmp_path):
    """A server over a paged KV cache (--kv-layout paged, a pool of 20 pages of 16: far less than the 8
    slots' full contexts) streams the same greedy text as the slab server, for 12 clients at once
    (more than the slots: requests queue, and slots are reused with other pages)."""
    prompts = [f"paged client {i:02d} asks" for i in range(12)]
    kw = {"max_tokens": 8, "temperature": 0}
    want = [client.completions.create(model=MODEL, prompt=p, **kw).choices[0].text for p in prompts]
    with _serve(tmp_path, "--config", str(ROOT / "configs" / "tiny.yaml"), "--random-weights",
                "--kv-layout", "paged", "--page-size", "16", "--kv-pages", "20") as base:
        paged = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        got: dict[int, str] = {}

        def worker(i: int) -> None:
            got[i] = _stream_text(paged, prompt=prompts[i], **kw)[0]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert [got.get(i) for i in range(len(prompts))] == want


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_slot(server, stream):
    def aborted() -> float:
        with urllib.request.urlopen(server + "/metrics", timeout=5) as r:
            m = re.search(r'^mkc_requests_total{finish_reason="abort"} (\S+)$', r.read().decode(), re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    def wait_for(cond, what: str) -> None:
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    before = aborted()
    body = json.dumps({"model": MODEL, "prompt": "long one", "max_tokens": 200, "stream": stream,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    wait_for(lambda: _metric(server, "mkc_running_requests") >= 1, "the request to run")
    sock.close()
    wait_for(lambda: _metric(server, "mkc_running_requests") == 0, "the slot to be freed")
    # the abort is counted when the engine notices the closed stream, which under load may be after
    # the slot shows free: wait for it (a request that ran to its end would never count one)
    wait_for(lambda: aborted() >= before + 1, "the abort to be counted")
    assert aborted() == before + 1


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


# ----------------------------------------------------------------------------------------------
# a Hugging Face checkpoint folder: config.json + safetensors from transformers, plus a tokenizer
# (byte-level BPE trained here, with a chat template) — the path a real checkpoint takes


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf_tiny")
    cfg = transformers.Cohere2MoeConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, num_experts=16, num_experts_per_tok=4, intermediate_size=64, first_k_dense_replace=1,
        prefix_dense_intermediate_size=192, sliding_window=8, expert_selection_fn="sigmoid", norm_topk_prob=False,
        rms_norm_eps=1e-6, logit_scale=0.5, rope_theta=50000.0, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(5)
    transformers.Cohere2MoeForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, how are you?"] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<bos>"], show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    hf.save_pretrained(folder)
    return folder, hf


def test_checkpoint_folder_with_its_tokenizer(tmp_path_factory, hf_checkpoint):
    folder, hf = hf_checkpoint
    with _serve(tmp_path_factory.mktemp("ckpt_server"), "--checkpoint", str(folder),
                "--served-model-name", "north-tiny") as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["north-tiny"]
        msgs = [{"role": "user", "content": "hello world"}]
        r = c.chat.completions.create(model="north-tiny", messages=msgs, max_tokens=5, temperature=0)
        rendered = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert r.usage.prompt_tokens == len(hf.encode(rendered, add_special_tokens=False))
        t = c.completions.create(model="north-tiny", prompt="the quick brown fox", max_tokens=5, temperature=0)
        assert t.usage.prompt_tokens == len(hf.encode("the quick brown fox"))
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="north-tiny", prompt="the quick brown fox", max_tokens=5, temperature=0, stream=True) if ch.choices)
        assert streamed == t.choices[0].text


def test_serve_memory_names_what_does_not_fit():
    """Mixtral-8x7B in bf16 (93 GB of weights) on an 80 GB GPU: one line naming what it needs,
    its parts and what is free; North Mini Code at batch 8 and 16K fits in the same 85 GB."""
    from mkc.ir.spec import load_spec
    from mkc.runtime.server import memory_problem, serve_memory

    configs = Path(__file__).resolve().parents[1] / "configs"
    free = 85_000_000_000  # an 80 GB H100's free memory
    mixtral = serve_memory(load_spec(configs / "mixtral_8x7b.yaml"), 1, 4096, 0, 0, 8192)
    assert 93e9 < mixtral["weights"] < 94e9
    line = memory_problem("mixtral_8x7b", mixtral, free, "NVIDIA H100 80GB HBM3", 1, 4096)
    assert line is not None and "\n" not in line
    assert "needs" in line and "weights 93.4" in line and "85.0 GB are free on NVIDIA H100" in line
    nmc = serve_memory(load_spec(configs / "north_mini_code.yaml"), 8, 16384, 0, 0, 8192)
    assert memory_problem("north_mini_code", nmc, free, "H100", 8, 16384) is None
    # the KV cache: K and V of 49 layers, 4 heads of 128, bf16, every position of 8 slots
    assert nmc["kv_cache"] == 8 * 16384 * 2 * 49 * 4 * 128 * 2
    paged = serve_memory(load_spec(configs / "north_mini_code.yaml"), 8, 16384, 16, 100, 8192)
    assert paged["kv_cache"] == 101 * 16 * 2 * 49 * 4 * 128 * 2  # the pages and the scratch page


def test_prefix_copies_take_the_memory_left_after_the_prefill(monkeypatch):
    """The slab layout's prefix-cache copies (North Mini Code, batch 8, 16K, on an H100 with 9 GB
    free and 1 GB cached by the allocator once the backend is built) get nine tenths of what the
    prefill's working memory and the margin leave, in whole pages of 16 positions."""
    import argparse

    import torch

    from mkc.ir.spec import load_spec
    from mkc.runtime.server import prefix_copy_pages, serve_memory

    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "north_mini_code.yaml")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (9 * 10**9, 80 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3 * 10**9)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 * 10**9)
    args = argparse.Namespace(max_batch=8, context=16384, page_size=16, prefill_chunk=8192, weights="bf16")
    need = serve_memory(spec, 8, 16384, 0, 0, 8192)
    page = 16 * 2 * 49 * 4 * 128 * 2
    pages = prefix_copy_pages(spec, args)
    assert pages == int((10 * 10**9 - need["prefill"] - need["margin"]) * 0.9) // page
    assert 3000 < pages < 4000  # about 50K positions
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10**9, 80 * 10**9))
    assert prefix_copy_pages(spec, args) == 0  # less than the prefill needs


def test_shutdown_ends_the_streams_in_flight_with_an_error_event(tmp_path):
    """On SIGTERM a stream in flight goes on for the drain, then ends with an error event saying
    that the server shuts down (not a connection cut by uvicorn's grace), and the server exits."""
    from mkc.runtime.server import _DRAIN_S, SHUTDOWN_GRACE_S

    with _serve_process(tmp_path, "--config", str(ROOT / "configs" / "tiny.yaml"), "--random-weights",
                        context=4096) as (base, proc):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = []
        while len(events) < 3:  # generating
            line = resp.readline().decode().strip()
            if line:
                events.append(line)
        sent = time.monotonic()
        proc.terminate()
        while (line := resp.readline().decode()):  # a cut connection ends the loop without the error
            if line.strip():
                events.append(line.strip())
        ended = time.monotonic() - sent
        # uvicorn re-raises the signal once it has shut down
        assert proc.wait(timeout=SHUTDOWN_GRACE_S + 10) in (0, -signal.SIGTERM)
    errors = [json.loads(e[6:]) for e in events if e.startswith("data: {") and '"error"' in e]
    assert len(errors) == 1 and "shutting down" in errors[0]["error"]["message"], events[-3:]
    assert events[-1] == "data: [DONE]"
    assert ended >= _DRAIN_S - 0.5  # the drain came first: the stream went on after the signal
