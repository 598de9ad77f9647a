"""Measured schedule choices that override the cost model's prediction.

Where the cost model cannot tell candidates apart reliably (the attention SMs of a parallel
block: mkc/schedule/plan.py), ``mkc bench --tune`` times every candidate on the GPU and records
the fastest here, keyed by what the choice depends on: the model (a digest of its spec), the batch,
the context bucket, the SM count and the KV page size. The planner uses a recorded choice when one
matches, and says so (``meta["attention_sms"]["chosen_by"] == "measured"``); otherwise it
predicts. The file is JSON (``settings.tuning_file()``, by default tuning.json in the kernel
cache); an unreadable one is reported once and ignored, never fatal. Under it the planner reads
the tables shipped in configs/tuning/ (the counts measured for North Mini Code on an H200), unless
MKC_TUNING_FILE names the one file to use. An entry is read and written as a TuningEntry; the
search that measures it is mkc/schedule/tune.py.
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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mkc import settings
from mkc.ir.spec import ModelSpec

_warned: set[Path] = set()


@dataclass(frozen=True, slots=True)
class TuningEntry:
    """One point's measured choices, a field per decision (None: not in the entry), as one JSON
    object of the tuning file reads; to_json writes the same object back (the JSON names are the
    field names, except the *_measured_us and *_by fields: JSON_NAMES). The values are as the file
    holds them, unchecked: a hand-edited file may hold anything, and the planner
    (mkc/schedule/plan.py: plan_choices) applies only what it can use. Each decision's times
    (``*_measured_us``) are µs by option, as mkc bench --tune labels the options; ``*_by`` names a
    tool other than mkc bench --tune that measured the decision."""

    attention_sms: Any = None  # the attention splits' SMs (LowerOptions.attention_sms)
    measured_us: Any = None  # {"count": µs}
    not_timed_simulated_us: Any = None  # {"count": simulated probe µs}: counts left out of the tune
    attention_inputs_first_us: Any = None  # Ceilings.attention_inputs_first_us, µs
    inputs_first_measured_us: Any = None  # {"0" | "100" | "100+splits": µs}
    splits_first: Any = None  # Ceilings.splits_first
    spread_siblings: Any = None  # Ceilings.spread_siblings
    spread_measured_us: Any = None  # {"off" | "on": µs}
    residual_in_o_proj: Any = None  # LowerOptions.residual_in_o_proj
    residual_measured_us: Any = None  # {"off" | "on": µs}
    residual_by: Any = None
    global_attention_sms: Any = None  # LowerOptions.global_attention_sms
    global_measured_us: Any = None  # {"W" | "W@A": µs}: W SMs' worth (beside A attention SMs)
    global_by: Any = None
    expert_up_rows: Any = None  # LowerOptions.expert_up_rows, a list of rows
    expert_up_measured_us: Any = None  # {"rule" | SIZExCOUNT label: µs}
    expert_up_by: Any = None
    expert_down_rows: Any = None  # LowerOptions.expert_down_rows (0: the tiling rule)
    expert_down_measured_us: Any = None  # {"rows": µs}
    expert_down_by: Any = None
    kept_over_retune: Any = None  # a re-tune's side-by-side run that this entry won (see plan.py)
    by: Any = None  # the note of a tune stopped part-way (mkc bench --tune, stopped after ...)
    gpu: Any = None  # the GPU's name
    date: Any = None  # "YYYY-MM-DD HH:MM UTC"
    reps: Any = None  # timed steps per run
    rounds: Any = None  # runs per option (mkc bench --tune-rounds)
    lowering: Any = None  # {LowerOptions field: value}: the lowering it was measured with
    extra: tuple[tuple[str, Any], ...] = field(default=())  # keys of no field (or null), kept as read

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TuningEntry:
        """The entry of one JSON object; a key of no field (or a null value) goes to ``extra``."""
        names = {JSON_NAMES.get(f, f): f for f in _FIELDS}
        known = {names[k]: v for k, v in obj.items() if k in names and v is not None}
        return cls(**known, extra=tuple((k, v) for k, v in obj.items() if k not in names or v is None))

    def to_json(self) -> dict[str, Any]:
        """The JSON object from_json read: each field that is not None under its JSON name, and extra."""
        out = dict(self.extra)
        out.update({JSON_NAMES.get(f, f): v for f in _FIELDS if (v := getattr(self, f)) is not None})
        return out


_FIELDS = tuple(f.name for f in fields(TuningEntry) if f.name != "extra")
# The JSON names of the fields not named as the file names them.
JSON_NAMES = {
    "inputs_first_measured_us": "attention_inputs_first_us_measured_us",
    "spread_measured_us": "spread_siblings_measured_us",
    "residual_measured_us": "residual_in_o_proj_measured_us", "residual_by": "residual_in_o_proj_by",
    "global_measured_us": "global_attention_sms_measured_us", "global_by": "global_attention_sms_by",
    "expert_up_measured_us": "expert_up_rows_measured_us", "expert_up_by": "expert_up_rows_by",
    "expert_down_measured_us": "expert_down_rows_measured_us", "expert_down_by": "expert_down_rows_by",
}


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


def tuning_key(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0,
               weights: str = "bf16") -> str:
    """What a measured choice depends on; a weight format other than bf16 (mkc/ir/fp8.py) is its own
    model ("+fp8" after the digest), so that its choices are measured apart. Not the page pool's
    size: it changes no tile, so a server's pool (mkc serve) uses what mkc bench --tune measured at
    its page size."""
    digest = hashlib.sha256(json.dumps(spec.to_yaml_dict(), sort_keys=True).encode()).hexdigest()[:16]
    model = f"{spec.name}-{digest}" + ("" if weights == "bf16" else f"+{weights}")
    return f"{model}/b{batch}/c{context}/sms{num_sms}/page{page_size}"


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


def record(key: str, entry: TuningEntry | dict[str, Any], path: Path | None = None) -> Path:
    """Add or replace one entry, a TuningEntry or its JSON object (the file is rewritten atomically,
    so a reader never sees half)."""
    path = path or settings.tuning_file()
    data = load(path)
    data[key] = entry.to_json() if isinstance(entry, TuningEntry) else entry
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
