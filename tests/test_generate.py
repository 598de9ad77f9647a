"""mkc generate's progress line (runtime/generate.py: Progress), on a fake clock."""

import io

from mkc.runtime.generate import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_silent_for_short_runs_then_reports_tokens_per_second():
    clock, out = Clock(), io.StringIO()
    p = Progress(100, context=128, stream=out, after=3.0, every=2.0, clock=clock)
    clock.now += 1.0  # set-up (compile, weights) before the first step: not counted in the rate
    p(1)
    clock.now += 1.0
    p(11)
    assert out.getvalue() == ""  # under 3 s since the start: a short run prints nothing
    clock.now += 2.0
    p(41)  # 40 steps in 3 s since the first
    assert out.getvalue() == "generate: 41/100 steps, context 128, 13.3 tokens/s, about 4 s left\n"
    clock.now += 1.0
    p(51)  # within 2 s of the last line
    assert out.getvalue().count("\n") == 1
    clock.now += 3.0
    p(100)
    assert out.getvalue().splitlines()[-1] == "generate: 100/100 steps, context 128, 14.1 tokens/s, done"
    p.close()  # not a terminal: each line already ended


def test_progress_counts_every_sequence_of_a_batch():
    clock, out = Clock(), io.StringIO()
    p = Progress(10, batch=4, stream=out, after=0.0, every=0.0, clock=clock)
    p(0)
    clock.now += 2.0
    p(5)
    assert "10.0 tokens/s" in out.getvalue() and "about 2 s left" in out.getvalue()


def test_generate_reports_each_step():
    import torch
    from conftest import ROOT

    from mkc.ir.spec import load_spec
    from mkc.runtime.generate import greedy_generate
    from mkc.runtime.weights import random_weights

    spec = load_spec(ROOT / "configs" / "tiny.yaml")
    done: list[int] = []
    out = greedy_generate(spec, random_weights(spec, 0, torch.float32), [1, 2, 3], 4, backend="reference",
                          progress=done.append)
    assert len(out) == 4 and done == [1, 2, 3, 4, 5, 6]  # 3 prompt + 4 new tokens - 1 steps
