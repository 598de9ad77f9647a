"""Shared test set-up: fixed seeds, so every run sees the same weights, prompts and interleavings."""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:  # types only: every test session loads this file
    from mkc.runtime.backends import DecoderBackend
    from mkc.runtime.engine import Engine, Output
    from mkc.runtime.sampling import SamplingParams

SEED = 1234  # one seed for everything a test does not seed itself
ROOT = Path(__file__).resolve().parents[1]

# The CPU tests run thousands of tiny ops (one per tile); on a 2-core machine torch's intra-op
# thread pool makes them ~10x slower (threads spin and hand off for 100-element matmuls).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny():
    """The tiny North Mini Code look-alike (configs/tiny.yaml); a test file may define its own."""
    from mkc.ir.spec import load_spec

    return load_spec(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="session")
def nmc():
    """North Mini Code at full size (configs/north_mini_code.yaml)."""
    from mkc.ir.spec import load_spec

    return load_spec(ROOT / "configs" / "north_mini_code.yaml")


@pytest.fixture(scope="session", autouse=True)
def _no_machine_tuning(tmp_path_factory):
    """Schedules in tests never depend on this machine's measured choices (mkc bench --tune):
    every test, and every CLI it starts, reads an empty tuning file of its own."""
    path = tmp_path_factory.mktemp("tuning") / "tuning.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MKC_TUNING_FILE", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def _own_cache(tmp_path_factory):
    """Tests never read or fill the user's schedule and kernel caches (~/.cache/mkc): the run has
    its own, one folder shared by pytest-xdist's workers (beside their base folders), so what one
    worker planned or compiled the others read instead of making it again."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "mkc-cache"
    path.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MKC_CACHE_DIR", str(path))
        yield path


@pytest.fixture(autouse=True)
def _fixed_seeds():
    random.seed(SEED)
    torch.manual_seed(SEED)
    yield


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests skip cleanly on a machine without a CUDA device; where there is
    one, they form one pytest-xdist group (with ``-n``, one worker runs them all: they share the
    GPU and its memory)."""
    if torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("gpu"))
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def save_checkpoint(model: torch.nn.Module, folder) -> None:
    """Save a tiny random transformers model as a checkpoint, its norm weights perturbed first:
    they initialise to 1, so a misplaced norm weight would otherwise go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (finite elements only)."""
    a, b = a.double(), b.double()
    ok = torch.isfinite(a) & torch.isfinite(b)
    return float((a[ok] - b[ok]).norm() / b[ok].norm().clamp_min(1e-30))


def check_prefill_matches_decode(be: DecoderBackend, atol: float,
                                 err_fn: Callable[[torch.Tensor, torch.Tensor], float] = max_err
                                 ) -> tuple[list[int], torch.Tensor]:
    """Prefill a 21-token prompt into slot 0 of ``be`` and decode the same tokens one by one in
    slot 2; assert that every layer's K and V cache and the last logits agree: ``err_fn`` (the
    max abs error unless told otherwise) within ``atol``.
    The prompt is longer than the tiny model's sliding window (8). Returns it and the prefill's logits."""
    ids = [(i * 37 + 11) % 256 for i in range(21)]
    logits_prefill = be.prefill(0, ids)
    for p, t in enumerate(ids):
        logits_decode = be.decode([2], [t], [p])[0]
    n = len(ids)
    for layer, (a, b) in enumerate(zip(be.slot_kv(0, n), be.slot_kv(2, n), strict=True)):
        for name, x, y in (("k", a[0], b[0]), ("v", a[1], b[1])):
            err = err_fn(x, y)
            assert err < atol, f"layer {layer} {name} cache: error {err:.2e} > {atol:.0e}"
    err = err_fn(logits_prefill, logits_decode)
    assert err < atol, f"last logits: error {err:.2e} > {atol:.0e}"
    return ids, logits_prefill


def check_idle_rows_untouched(be: DecoderBackend,
                              same: Callable[[torch.Tensor, torch.Tensor], bool]) -> torch.Tensor:
    """Fill the 4 slots of ``be``, decode one step of slot 1 alone and assert, with ``same``, that the
    caches of slots 0, 2 and 3 are unchanged, position 0 included. Returns that step's logits."""
    for s in range(4):
        be.prefill(s, [s + 1] * (5 + s))
    before = {s: be.read_kv(s, 0, be.context) for s in (0, 2, 3)}
    alone = be.decode([1], [9], [6])
    for s in (0, 2, 3):
        assert same(be.read_kv(s, 0, be.context), before[s]), f"slot {s} changed by a step it was not in"
    return alone


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams,
               max_steps: int = 2000) -> list[list[Output]]:
    """Submit every prompt, step until the engine has no work left; each request's outputs."""
    outs: list[list[Output]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(p, params, outs[i].append)
    for _ in range(max_steps):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work()
    return outs


def record_preemptions(engine: Engine) -> list[str]:
    """The ids of the requests ``engine`` preempts from now on, appended as it preempts them."""
    preempted: list[str] = []
    orig = engine._preempt
    engine._preempt = lambda r, *why: (preempted.append(r.id), orig(r, *why))[1]  # type: ignore[method-assign]
    return preempted


def fill_random_kv(spec, gen: torch.Generator, ex, dec) -> None:
    """Fill every layer's KV cache of the CPU executor ``ex`` (through ``write_kv``) and of ``dec``
    (any decoder with ``kv_cache(layer)`` views, e.g. the megakernel's) with the same random bf16
    values, drawn from ``gen``: every position of every sequence."""
    a, batch, context = spec.attention, ex.schedule.batch, ex.schedule.context
    for layer in range(spec.num_layers):
        k = torch.randn(batch, a.num_kv_heads, context, a.head_dim, generator=gen).bfloat16()
        v = torch.randn(batch, a.num_kv_heads, context, a.head_dim, generator=gen).bfloat16()
        for b in range(batch):
            ex.write_kv(b, layer, k[b].transpose(0, 1), v[b].transpose(0, 1))
        kc, vc = dec.kv_cache(layer)
        kc.copy_(k)
        vc.copy_(v)


def load_benchmark(name: str):
    """The script benchmarks/NAME.py as a module (the folder is not a package), to test its parts."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_main(capsys, *args) -> tuple[int, str, str]:
    """The CLI in this process (no interpreter start-up per case): exit code, stdout, stderr of
    this call only (what the test printed before is dropped). An exception escaping main fails the
    test, as a traceback would show the user."""
    from mkc.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, needle: str) -> None:
    """A user error: exit 2 and one line ``mkc: error: ...`` that contains ``needle``."""
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mkc: error: "), err
    assert needle in lines[0], err
