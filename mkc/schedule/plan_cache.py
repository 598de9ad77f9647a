"""Planned schedules kept on disk beside the compiled kernels, so that a server starts in seconds.

Planning North Mini Code (lowering, placement, the probes) takes about 10 s a batch size on one
core; `mkc serve` plans one schedule per step kernel. ``cached_plan`` returns the schedule plan()
made before for the same inputs: the model's spec, the point, the lowering and ceilings, the
tuning tables plan() reads, and the planner's own code (every module of mkc/ir and
mkc/schedule), so that a change to any of them plans afresh. Entries are gzipped schedule.json
documents under ``<cache>/schedules``; one that cannot be read is planned again and replaced.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import mkc
from mkc import settings
from mkc.ir.graph import gc_paused
from mkc.ir.spec import ModelSpec
from mkc.schedule.cost import H200, Ceilings
from mkc.schedule.plan import plan
from mkc.schedule.schedule import Schedule

PLANNER_PACKAGES = ("ir", "schedule")  # the mkc subpackages whose code decides a schedule


def _planner_code_digest() -> str:
    h = hashlib.sha256(mkc.__version__.encode())
    root = Path(mkc.__file__).resolve().parent
    for pkg in PLANNER_PACKAGES:
        for f in sorted((root / pkg).glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _tuning_digest() -> str:
    h = hashlib.sha256()  # the contents, not the paths: a cache carried to another checkout still hits
    for path in (settings.tuning_file(), *settings.tuning_tables()):
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(b"(none)")
        h.update(b"\0")
    return h.hexdigest()


def plan_key(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0, kv_pages: int = 0,
             attention_sms: int | None = None, ceilings: Ceilings = H200, **lowering) -> str:
    """The digest of everything plan() depends on for these arguments."""
    inputs: dict[str, Any] = {
        "spec": spec.to_yaml_dict(), "batch": batch, "context": context, "num_sms": num_sms,
        "page_size": page_size, "kv_pages": kv_pages, "attention_sms": attention_sms,
        "ceilings": dataclasses.asdict(ceilings), "lowering": lowering,
        "tuning": _tuning_digest(), "code": _planner_code_digest()}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def cached_plan(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0, kv_pages: int = 0,
                attention_sms: int | None = None, ceilings: Ceilings = H200, cache_dir: Path | None = None,
                **lowering) -> tuple[Schedule, bool]:
    """plan()'s schedule for these arguments and whether it came from the cache (else it was planned
    now and stored)."""
    key = plan_key(spec, batch, context, num_sms, page_size, kv_pages, attention_sms, ceilings, **lowering)
    root = (cache_dir or settings.cache_dir()) / "schedules"
    path = root / f"{spec.name}-b{batch}-c{context}-{key[:16]}.json.gz"
    try:
        with gc_paused():  # parsing makes millions of objects and no cycles
            return Schedule.from_json(json.loads(gzip.decompress(path.read_bytes()))), True
    except (OSError, EOFError, ValueError):  # absent, unreadable or not a schedule: plan it again
        pass
    sc = plan(spec, batch, context, num_sms, page_size, kv_pages, attention_sms, ceilings, **lowering)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(gzip.compress(json.dumps(sc.to_json(), separators=(",", ":")).encode(), compresslevel=1))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the schedule is still good, only not kept
        pass
    return sc, False
