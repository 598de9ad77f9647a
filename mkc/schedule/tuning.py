"""Measured schedule choices that override the cost model's prediction.

Where the cost model cannot tell candidates apart reliably (the attention SMs of a parallel
block: mkc/schedule/plan.py), ``mkc bench --tune`` times every candidate on the GPU and records
the fastest here, keyed by what the choice depends on: the model (a digest of its spec), the batch,
the context bucket, the SM count and the KV page size. The planner uses a recorded choice when one
matches, and says so (``meta["attention_sms"]["chosen_by"] == "measured"``); otherwise it
predicts. The file is JSON (``settings.tuning_file()``, by default tuning.json in the kernel
cache); an unreadable one is reported once and ignored, never fatal. Under it the planner reads
the tables shipped in configs/tuning/ (the counts measured for North Mini Code on an H200), unless
MKC_TUNING_FILE names the one file to use.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkc import settings
from mkc.ir.spec import ModelSpec

_warned: set[Path] = set()


# Tile row lists (LowerOptions.expert_up_rows) as entries key their times and the benchmarks take
# them: SIZExCOUNT terms joined by '+', 80x6+48x6 for six 80s then six 48s.
ROW_LIST = re.compile(r"\d+(x\d+)?(\+\d+(x\d+)?)*")


def rows_label(rows: tuple[int, ...]) -> str:
    """Equal or mixed tile rows as SIZExCOUNT terms joined by '+': (128,) * 6 is 128x6."""
    return "+".join(f"{size}x{len(list(run))}" for size, run in itertools.groupby(rows))


def row_list(text: str) -> tuple[int, ...]:
    """The rows of a label (rows_label's inverse; ROW_LIST must match it): 80x6+48x6 is six 80s then
    six 48s; a term without xCOUNT counts once."""
    return tuple(int(size) for term in text.split("+")
                 for size, _, count in [term.partition("x")] for _ in range(int(count or 1)))


def tuning_key(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0) -> str:
    """What a measured choice depends on. Not the page pool's size: it changes no tile, so a
    server's pool (mkc serve) uses what mkc bench --tune measured at its page size."""
    digest = hashlib.sha256(json.dumps(spec.to_yaml_dict(), sort_keys=True).encode()).hexdigest()[:16]
    return f"{spec.name}-{digest}/b{batch}/c{context}/sms{num_sms}/page{page_size}"


def load(path: Path | None = None) -> dict[str, Any]:
    """Every recorded entry; {} when there is no file or it cannot be read (reported once)."""
    path = path or settings.tuning_file()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        return _ignored(path, str(e))
    return data if isinstance(data, dict) else _ignored(path, "expected a JSON object of entries")


def _ignored(path: Path, why: str) -> dict[str, Any]:
    if path not in _warned:
        _warned.add(path)
        print(f"mkc: warning: ignoring the tuning file {path} ({why}); the cost model decides instead",
              file=sys.stderr)
    return {}


def lookup(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The entry for ``key``: from ``path`` if given, else from the tuning file, else from the
    shipped tables (settings.tuning_tables)."""
    sources = [path] if path else [settings.tuning_file(), *settings.tuning_tables()]
    for src in sources:
        entry = load(src).get(key)
        if isinstance(entry, dict):
            return entry
    return None


def nearest(key: str, path: Path | None = None) -> tuple[int, dict[str, Any]] | None:
    """The entry of the nearest context measured for ``key``'s model, batch, SM count and page size
    (nearest by ratio; a tie: the shorter context), as (its context, the entry); None where that
    batch was measured at no context. Sources as lookup's, the first holding a key winning."""
    name, batch, context, *where = key.rsplit("/", 4)  # as tuning_key writes it
    entries: dict[int, dict[str, Any]] = {}
    for src in [path] if path else [settings.tuning_file(), *settings.tuning_tables()]:
        for k, entry in load(src).items():
            parts = k.rsplit("/", 4)  # a key of another form (a hand-edited file) matches nothing
            if (len(parts) == 5 and (parts[0], parts[1], parts[3:]) == (name, batch, where)
                    and re.fullmatch(r"c[1-9]\d*", parts[2]) and isinstance(entry, dict)):
                entries.setdefault(int(parts[2][1:]), entry)
    if not entries:
        return None
    asked = int(context[1:])
    best = min(entries, key=lambda c: (abs(math.log(c / asked)), c))
    return best, entries[best]


def record(key: str, entry: dict[str, Any], path: Path | None = None) -> Path:
    """Add or replace one entry (the file is rewritten atomically, so a reader never sees half)."""
    path = path or settings.tuning_file()
    data = load(path)
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
