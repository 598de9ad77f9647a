"""``mkc bench-serve``: one in-process run on the CPU backend (tiny random model), the load it
generates, the SSE parsing and statistics on canned data, and its one-line errors."""

from __future__ import annotations

import contextlib
import io
import json
import socket

import numpy as np
import pytest
from conftest import ROOT

from mkc.cli import main
from mkc.runtime.serve_bench import (
    LoadConfig,
    RequestRecord,
    StreamParser,
    Target,
    add_bench_serve_arguments,
    in_process_server,
    make_workload,
    poisson_arrivals,
    summarize,
)

N, PROMPT, OUTPUT = 4, 8, 6  # requests, prompt tokens, output tokens of the in-process run
STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One benchmark of a server started in this process; its exit status, stdout and JSON."""
    out = tmp_path_factory.mktemp("bench-serve") / "report.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["bench-serve", "--config", str(ROOT / "configs" / "tiny.yaml"), "--random-weights",
                   "--backend", "cpu", "--context", "64", "--max-batch", "2", "--num-requests", str(N),
                   "--concurrency", "2", "--prompt-len", str(PROMPT), "--output-len", str(OUTPUT), "-o", str(out)])
    return rc, stdout.getvalue(), json.loads(out.read_text())


def test_in_process_counts(run):
    rc, stdout, report = run
    assert rc == 0, stdout
    s = report["summary"]
    assert (s["completed"], s["failed"]) == (N, 0)
    assert s["input_tokens"] == N * PROMPT and s["output_tokens"] == N * OUTPUT
    assert len(report["requests"]) == N
    for r in report["requests"]:
        assert r["error"] is None
        assert (r["prompt_tokens"], r["output_tokens"]) == (PROMPT, OUTPUT)
        if r["chunk_tokens"] is None:
            # a chunk per token with text, and the last; byte-level ids above 255 have no text
            assert 1 <= len(r["chunk_times_s"]) <= OUTPUT
        else:  # the server reports running usage: a chunk per token
            assert r["chunk_tokens"] == [1] * OUTPUT and len(r["chunk_times_s"]) == OUTPUT
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
        assert r["ttft_s"] == r["chunk_times_s"][0] <= r["latency_s"]
    assert "TTFT" in stdout and "wrote" in stdout


def test_in_process_statistics_ordered(run):
    _, _, report = run
    for key in STATS:
        st = report["summary"][key]
        assert st["p50"] <= st["p90"] <= st["p99"], (key, st)
    assert report["config"]["request_rate"] == "inf"  # JSON has no infinity


@pytest.fixture(scope="module")
def server():
    """A tiny model served in this process, for the --url runs."""
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    args = parser.parse_args(["--config", str(ROOT / "configs" / "tiny.yaml"), "--random-weights", "--backend", "cpu",
                              "--context", "32", "--max-batch", "2"])
    with in_process_server(args) as target:
        yield target


def test_url_poisson_run(server: Target, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["bench-serve", "--url", server.url + "/", "--num-requests", "3", "--request-rate", "20",
                 "--prompt-len", "2:5", "--output-len", "1:3", "--seed", "3", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["server"]["model"] == "tiny" and report["server"]["context"] == 32  # from /v1/models
    records = report["requests"]
    assert [r["error"] for r in records] == [None] * 3
    assert [r["output_tokens"] for r in records] == [r["output_len"] for r in records]
    assert [r["prompt_tokens"] for r in records] == [r["prompt_len"] for r in records]
    assert records[0]["scheduled_s"] == 0 < records[1]["scheduled_s"] < records[2]["scheduled_s"]
    assert report["summary"]["output_tokens"] == sum(r["output_len"] for r in records)


def test_url_context_too_short(server: Target, capsys):
    assert main(["bench-serve", "--url", server.url, "--prompt-len", "30", "--output-len", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("mkc: error: --prompt-len 30 and --output-len 3 need up to 33 positions; the server's "
                    "context is 32")]


def test_one_seed_seeds_the_load_and_the_in_process_weights():
    """bench-serve has one --seed (the serve options'), with or without --url: it seeds the load, and
    its help says so; --url needs neither --checkpoint nor --random-weights, though the serve options
    make one of them required."""
    import argparse

    import mkc.runtime.serve_bench as sb

    parser = argparse.ArgumentParser()
    sb.add_bench_serve_arguments(parser)
    assert parser.parse_args(["--url", "http://x"]).seed == 0
    assert parser.parse_args(["--url", "http://x", "--seed", "9"]).seed == 9
    assert parser.parse_args(["--random-weights", "--seed", "9"]).seed == 9
    seed = next(a for a in parser._actions if "--seed" in a.option_strings)
    assert "lengths, prompts and arrivals" in seed.help and "--random-weights" in seed.help


def test_poisson_arrivals_mean_gap():
    rate, n = 4.0, 20_000
    t = poisson_arrivals(n, rate, np.random.default_rng(7))
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps >= 0).all()
    # exponential gaps: mean 1/rate and standard deviation 1/rate; the mean's own error is
    # 1/rate/sqrt(n) = 0.7%, so 4% is a loose bound
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.04)
    assert (poisson_arrivals(5, float("inf"), np.random.default_rng(7)) == 0).all()


def _load(**kw) -> LoadConfig:
    base = {"num_requests": 200, "concurrency": 8, "request_rate": 2.0, "prompt_len": (3, 9),
            "output_len": (5, 5), "seed": 11}
    return LoadConfig(**{**base, **kw})


def test_workload_lengths_and_seed():
    w = make_workload(_load(), vocab_size=50)
    lens = [len(p) for p in w.prompts]
    assert min(lens) == 3 and max(lens) == 9  # the range is inclusive
    assert set(w.output_lens) == {5}
    assert all(0 <= t < 50 for p in w.prompts for t in p)
    assert len(w.probe) == lens[0] and w.probe[:3] != w.prompts[0][:3]  # not a prefix-cache hit for the first
    assert make_workload(_load(), vocab_size=50) == w
    other_rate = make_workload(_load(request_rate=100.0), vocab_size=50)
    assert other_rate.prompts == w.prompts and other_rate.arrivals != w.arrivals
    assert make_workload(_load(seed=12), vocab_size=50).prompts != w.prompts


def _parse(lines: list[tuple[str, float]], end: float) -> RequestRecord:
    rec = RequestRecord(index=0, prompt_len=3, output_len=4, scheduled_s=0.0)
    p = StreamParser(rec)
    for line, t in lines:
        p.feed(line, t)
    p.finish(end)
    return rec


def _chunk(text: str, usage: dict | None = None, finish: str | None = None) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage})


def test_stream_parser_text_chunks_and_usage():
    rec = _parse([(_chunk("a"), 0.1), ("", 0.1), (_chunk("b"), 0.3), (_chunk("", finish="length"), 0.35),
                  ('data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}', 0.36),
                  ("data: [DONE]", 0.37)], end=0.4)
    # without running usage every chunk counts, the empty finishing one too (it brings the last token)
    assert rec.ok and rec.chunk_times_s == [0.1, 0.3, 0.35] and rec.chunk_tokens is None
    assert (rec.ttft_s, rec.latency_s, rec.prompt_tokens, rec.output_tokens) == (0.1, 0.4, 3, 4)
    assert rec.tpot_s == pytest.approx((0.4 - 0.1) / 3)


def test_stream_parser_running_usage():
    # vLLM's continuous_usage_stats: each chunk says how many tokens so far, empty text or not
    usage = [{"prompt_tokens": 3, "completion_tokens": k} for k in (1, 3, 4, 4)]
    rec = _parse([(_chunk("a", usage[0]), 0.1), (_chunk("", usage[1]), 0.2), (_chunk("c", usage[2]), 0.3),
                  (_chunk("", usage[3], finish="length"), 0.3), ("data: [DONE]", 0.3)], end=0.3)
    assert rec.ok and rec.chunk_times_s == [0.1, 0.2, 0.3] and rec.chunk_tokens == [1, 2, 1]
    assert rec.output_tokens == 4


def test_stream_parser_failures():
    err = 'data: {"error": {"message": "generation failed: boom", "type": "server_error"}}'
    assert _parse([(_chunk("a"), 0.1), (err, 0.2), ("data: [DONE]", 0.2)], end=0.2).error == \
        "generation failed: boom"
    assert "without data: [DONE]" in _parse([(_chunk("a"), 0.1)], end=0.2).error
    assert "no output" in _parse([("data: [DONE]", 0.1)], end=0.1).error


def test_summarize():
    def rec(i: int, times: list[float], error: str | None = None) -> RequestRecord:
        return RequestRecord(index=i, prompt_len=2, output_len=len(times), scheduled_s=0.0, ttft_s=times[0],
                             latency_s=times[-1], prompt_tokens=2, output_tokens=len(times),
                             chunk_times_s=times, error=error)

    s = summarize([rec(0, [1.0, 2.0, 4.0]), rec(1, [2.0, 3.0]), rec(2, [9.0, 99.0], error="x")], duration_s=5.0)
    assert (s["completed"], s["failed"], s["input_tokens"], s["output_tokens"]) == (2, 1, 4, 5)
    assert s["output_chunks"] == 5
    assert s["output_throughput"] == pytest.approx(1.0) and s["request_throughput"] == pytest.approx(0.4)
    assert s["itl_ms"]["mean"] == pytest.approx(4000 / 3)  # gaps 1, 2 and 1 s; the failed request left out
    assert s["tpot_ms"]["mean"] == pytest.approx((1500 + 1000) / 2)
    assert s["ttft_ms"]["p50"] == pytest.approx(1500)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, says", [
    (["--url", "http://127.0.0.1:1", "--prompt-len", "0"], "--prompt-len '0'"),
    (["--url", "http://127.0.0.1:1", "--output-len", "9:3"], "--output-len '9:3'"),
    (["--url", "http://127.0.0.1:1", "--request-rate", "0"], "--request-rate"),
    (["--url", "http://127.0.0.1:{port}"], "is it running?"),
    ([], "nothing to benchmark"),
    (["--url", "http://127.0.0.1:1", "--config", "configs/tiny.yaml", "--random-weights"], "exclude each other"),
])
def test_bad_input_one_line(capsys, argv, says):
    argv = [a.format(port=_free_port()) for a in argv]
    assert main(["bench-serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mkc: error:") and says in err[0], err


def test_url_sampled_run(server: Target, tmp_path, capsys):
    """--temperature and --top-p go into every request, each seeded apart: the run completes with
    every token, and each request body carries them."""
    from mkc.runtime.serve_bench import completion_body

    out = tmp_path / "report.json"
    assert main(["bench-serve", "--url", server.url, "--num-requests", "3", "--prompt-len", "4",
                 "--output-len", "5", "--temperature", "0.9", "--top-p", "0.8", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["output_tokens"] == 15 and report["config"]["temperature"] == 0.9
    load = LoadConfig(num_requests=3, concurrency=3, request_rate=float("inf"), prompt_len=(4, 4),
                      output_len=(5, 5), seed=2, temperature=0.9, top_p=0.8)
    bodies = [completion_body("m", [1, 2], 5, s) for s in make_workload(load, 100).sampling]
    assert [(b["temperature"], b["top_p"]) for b in bodies] == [(0.9, 0.8)] * 3
    assert len({b["seed"] for b in bodies}) == 3
    assert make_workload(LoadConfig(1, 1, 1.0, (1, 1), (1, 1), 0), 100).sampling == ()
    assert completion_body("m", [1, 2], 5)["temperature"] == 0.0


@pytest.mark.parametrize(("option", "value", "expected"), [("--temperature", "-1.0", "a number >= 0"),
                                                            ("--top-p", "0.0", "a number in (0, 1]")])
def test_bad_sampling_options(server: Target, capsys, option, value, expected):
    assert main(["bench-serve", "--url", server.url, option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mkc: error: {option} {value}: expected {expected}"), err
