"""A profiled step and its schedule, for the scripts that read one (calibrate_cost.py, replay_profile.py).

TIMELINE.npz is written by ``benchmarks/megakernel_step.py --profile DIR`` or ``mkc bench --profile``
(one real step of the megakernel: each task's wait / start / end, by task id). The schedule is
planned again from the same options, so run the script on the tree the profile was taken with.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mkc.ir.spec import load_spec
from mkc.schedule import tuning
from mkc.schedule.plan import DEFAULT_LOWERING, LOWERING_CHOICES, plan
from mkc.schedule.schedule import Schedule

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The timeline and the options to plan its schedule again."""
    ap.add_argument("timeline")
    ap.add_argument("--config", default=str(ROOT / "configs" / "north_mini_code.yaml"))
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--num-sms", type=int, default=132)
    ap.add_argument("--page-size", type=int, default=0)
    ap.add_argument("--attention-sms", type=int, default=None, help="as profiled (default: the compiler's choice)")
    ap.add_argument("--lowering", nargs="*", default=[], metavar="CHOICE=VALUE",
                    help="lowering choices as profiled (megakernel_step.py --lowering), e.g. residual_in_o_proj=1")


def spec_of(a: argparse.Namespace):
    """The model the timeline was profiled on."""
    return load_spec(a.config)


def lowering_of(a: argparse.Namespace) -> dict[str, bool | int | str | tuple[int, ...]]:
    """``--lowering CHOICE=VALUE`` pairs as plan's keyword arguments (booleans as 0 / 1, row lists as
    SIZExCOUNT terms joined by '+', such as expert_up_rows=80x6+48x6); SystemExit names a bad one."""
    out: dict[str, bool | int | str | tuple[int, ...]] = {}
    for p in a.lowering:
        name, _, value = p.partition("=")
        kind = type(DEFAULT_LOWERING.get(name))
        if (name not in LOWERING_CHOICES or (kind is bool and value not in ("0", "1"))
                or (kind is int and not value.isdigit()) or (kind is tuple and not tuning.ROW_LIST.fullmatch(value))):
            raise SystemExit(f"--lowering {p}: expected CHOICE=VALUE (0 / 1 for booleans, an integer for integers, "
                             f"SIZExCOUNT+... for row lists) with CHOICE one of {', '.join(LOWERING_CHOICES)}")
        if kind is tuple:
            out[name] = tuning.row_list(value)
        else:
            out[name] = value == "1" if kind is bool else int(value) if kind is int else value
    return out


def load(a: argparse.Namespace) -> tuple[Schedule, np.lib.npyio.NpzFile]:
    """The schedule planned from ``a`` and the timeline; SystemExit if they do not match."""
    spec = load_spec(a.config)
    sc = plan(spec, a.batch, a.context, a.num_sms, page_size=a.page_size, attention_sms=a.attention_sms,
              **lowering_of(a))
    tl = np.load(a.timeline)
    if len(tl["end"]) != len(sc.tasks) or not np.array_equal(tl["op"], [int(t.op) for t in sc.tasks]):
        raise SystemExit(f"{a.timeline}: its tasks are not this tree's schedule for batch {a.batch}, "
                         f"context {a.context}: profile again with the same options")
    return sc, tl
