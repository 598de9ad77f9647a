"""Task words: the schedule encoded as device data.

The kernel binary depends only on shapes and tiling; the schedule reaches it as four arrays:

* ``records`` — int32 ``[tasks, RECORD_WORDS]`` in queue order (SM 0's queue, then SM 1's, ...).
  Words: opcode, task id, wait offset, wait count, signal counter (-1 = none), one buffer-table
  index per operand role of ``OP_INFO`` (-1 = absent), the integer arguments, a copy of the
  first ``INLINE_WAITS`` waits (counter, target; zeros past the count), an L2 warm-up hint
  (buffer-table index or -1, first 16-byte piece, pieces: ``l2_warm_hints``), zero padding. The
  kernel copies the next record into shared memory while a task runs, so a task reads those waits
  without a round trip to device memory.
* ``queue_start`` — int32 ``[num_sms + 1]``: SM ``i`` runs records ``queue_start[i]:queue_start[i+1]``.
* ``waits`` — int32 ``[n, 2]``: ``(counter id, target per step)``, indexed by the wait offset. An
  EXPERT_DOWN (and EXPERT_DOWN_SPLIT) record lists the counter of the router tiles first (implied by its other waits,
  so redundant for the schedule): the kernel may wait for it alone, derive which expert's weights
  it streams and ask L2 for them, then wait for the rest (ops.cuh: op_expert_down). An
  EXPERT_SWIGLU (and EXPERT_MLP) record lists it first too: a kernel built with ``tagged_logits`` skips that wait
  and reads the logits' tagged copy instead (ops.cuh: await_tagged_logits), so the counter must
  be the router tiles' alone.
* the buffer table — ``BUF_DESC`` records ``{ptr, shape (left-padded with 1s), dtype}`` in
  ``buffer_names`` order; the runtime fills in the pointers (``buffer_table``).

The C++ side (templates/common.cuh, kernel.cu.j2) reads the same layout from the constants
``RECORD_LAYOUT``, ``MAX_RANK`` and ``DTYPE_CODES`` rendered into the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mkc.codegen.weight_tiles import padded_weights, stored_shape
from mkc.ir.ops import OP_INFO, Opcode
from mkc.schedule.schedule import Schedule, logits_operand

MAX_OPERANDS = max(len(i.operands) for i in OP_INFO.values())
MAX_ARGS = max(len(i.args) for i in OP_INFO.values())
MAX_RANK = 5
# the opcodes whose records list the router tiles' counter first (see the module doc)
ROUTED_OPS = (Opcode.EXPERT_DOWN, Opcode.EXPERT_SWIGLU, Opcode.EXPERT_MLP, Opcode.EXPERT_DOWN_SPLIT)

W_OP, W_ID, W_WAIT_OFF, W_WAIT_CNT, W_SIGNAL = range(5)
W_OPERANDS = 5
W_ARGS = W_OPERANDS + MAX_OPERANDS
W_WAITS = W_ARGS + MAX_ARGS
INLINE_WAITS = 4  # (counter, target) pairs copied into the record itself (every task of North Mini Code has <= 3)
W_WARM = W_WAITS + 2 * INLINE_WAITS  # buffer index (-1: none), first 16-byte piece, pieces
RECORD_WORDS = (W_WARM + 3 + 3) // 4 * 4  # 16-byte records

RECORD_LAYOUT: tuple[tuple[str, int], ...] = (
    ("W_OP", W_OP), ("W_ID", W_ID), ("W_WAIT_OFF", W_WAIT_OFF), ("W_WAIT_CNT", W_WAIT_CNT),
    ("W_SIGNAL", W_SIGNAL), ("W_OPERANDS", W_OPERANDS), ("W_ARGS", W_ARGS), ("W_WAITS", W_WAITS),
    ("INLINE_WAITS", INLINE_WAITS), ("W_WARM", W_WARM), ("RECORD_WORDS", RECORD_WORDS),
)
# bf16_tiles: weight_tiles.py; f32_tagged: an f32 buffer followed by its tagged copy (routing_logits)
# fp8_tiles: e4m3 weights in tile order, their float32 scales after them (mkc/ir/fp8.py)
DTYPE_CODES: dict[str, int] = {"bf16": 0, "f32": 1, "i32": 2, "bf16_tiles": 3, "f32_tagged": 4, "fp8_tiles": 5}

# struct BufDesc { void* ptr; int shape[MAX_RANK]; int dtype; }  (32 bytes)
BUF_DESC = np.dtype([("ptr", "<u8"), ("shape", "<i4", (MAX_RANK,)), ("dtype", "<i4")])
assert BUF_DESC.itemsize == 32


class EncodeError(ValueError):
    """The schedule cannot be encoded (the message names the task or buffer)."""


@dataclass(frozen=True, slots=True)
class TaskWords:
    records: np.ndarray  # int32 [tasks, RECORD_WORDS], queue order
    queue_start: np.ndarray  # int32 [num_sms + 1]
    waits: np.ndarray  # int32 [n, 2] (counter, target per step); at least one row
    buffer_names: tuple[str, ...]  # buffer-table order
    num_counters: int  # counters the kernel touches


def routing_wait(schedule: Schedule, tid: int, writers: dict[str, set[int]]) -> tuple[int, int]:
    """(counter, target) of the tiles that write the router logits an EXPERT_DOWN(_SPLIT), EXPERT_SWIGLU or
    EXPERT_MLP task reads; ``writers`` maps each buffer to the counters whose producers write it. For
    EXPERT_SWIGLU and EXPERT_MLP every producer of that counter must write the logits (a kernel that reads the
    tagged logits instead of waiting for the counter waits for nothing else through it)."""
    t = schedule.tasks[tid]
    logits = logits_operand(t)
    found = writers.get(logits, set())
    if len(found) != 1:
        raise EncodeError(f"task {t.id} ({t.name}): the router logits {logits} are written under "
                          f"{len(found)} counters: expected the router tiles to signal exactly one")
    c = schedule.counters[next(iter(found))]
    if t.op in (Opcode.EXPERT_SWIGLU, Opcode.EXPERT_MLP):
        others = [p for p in c.producers if all(r.buffer != logits for r in schedule.tasks[p].writes)]
        if others:
            raise EncodeError(f"task {t.id} ({t.name}): the router tiles' counter {c.id} is also signalled by "
                              f"{schedule.tasks[others[0]].name}, which does not write {logits}: expected a "
                              f"counter of the router tiles alone")
    return c.id, c.target


def routing_logits(schedule: Schedule) -> frozenset[str]:
    """The router logits buffers the expert-up tiles read: with ``CodegenOptions.tagged_logits``
    the runtime gives each a tagged copy (dtype f32_tagged) and the router tiles fill it."""
    out = set()
    for t in schedule.tasks:
        if t.op in (Opcode.EXPERT_SWIGLU, Opcode.EXPERT_MLP):
            out.add(logits_operand(t))
    return frozenset(out)


# L2 warm-up (CodegenOptions.l2_warm): "TARGET:CARRIER" rules, comma-separated. While a carrier
# task waits for its inputs its warps 1.. ask L2 for one share of a target's weights (the layer's
# carriers split the target's bytes evenly), so the target's tiles later stream them from L2.
# Targets, per layer L: the weights of the LINEAR tiles that read layer L's attention output (the
# O-projection), or of layer L + 1's router tiles or its QKV tiles; carriers: layer L's attention
# splits, expert gate/up tiles or attention-combine tasks.
L2_WARM_TARGETS = ("o_proj", "next_router", "next_qkv")
L2_WARM_CARRIERS = {"splits": Opcode.ATTN_SPLIT, "expert_up": Opcode.EXPERT_SWIGLU,
                    "combine": Opcode.ATTN_COMBINE}


def parse_l2_warm(rules: str) -> tuple[tuple[str, str], ...]:
    """(target, carrier) pairs of an l2_warm string ("off" or "": none); raises ValueError naming
    the bad rule."""
    if rules in ("", "off"):
        return ()
    out = []
    for rule in rules.split(","):
        target, _, carrier = rule.strip().partition(":")
        if target not in L2_WARM_TARGETS or carrier not in L2_WARM_CARRIERS:
            raise ValueError(f"l2_warm rule {rule.strip()!r}: expected TARGET:CARRIER with TARGET one of "
                             f"{', '.join(L2_WARM_TARGETS)} and CARRIER one of {', '.join(L2_WARM_CARRIERS)}")
        out.append((target, carrier))
    carriers = [c for _, c in out]
    if len(set(carriers)) != len(carriers):
        raise ValueError(f"l2_warm = {rules!r}: a carrier takes one rule (each task carries one hint)")
    return tuple(out)


def _target_weights(schedule: Schedule, target: str) -> dict[int, list[str]]:
    """Per layer L, the weight buffers of the target's LINEAR tiles that rule L's carriers warm."""
    tasks = schedule.tasks
    if target == "o_proj":  # LINEAR tiles whose input is the attention output, of the carriers' layer
        found = {t.operand("out") for t in tasks if t.op == Opcode.ATTN_COMBINE}
        role, shift = "x", 0
    elif target == "next_router":  # LINEAR tiles that write the router logits, of the layer after
        found = {logits_operand(t) for t in tasks if t.op in (Opcode.EXPERT_SWIGLU, Opcode.EXPERT_DOWN,
                                                              Opcode.EXPERT_DOWN_SPLIT, Opcode.EXPERT_MLP,
                                                              Opcode.TOPK)}
        role, shift = "out", 1
    else:  # LINEAR tiles that write the QKV projection the attention reads, of the layer after
        found = {t.operand("qkv") for t in tasks if t.op in (Opcode.ATTN_SPLIT, Opcode.ROPE_APPEND)} - {"-"}
        role, shift = "out", 1
    out: dict[int, list[str]] = {}
    for t in tasks:
        if t.op == Opcode.LINEAR and t.operand(role) in found:
            w = t.operand("weight")
            layer_buffers = out.setdefault(t.layer - shift, [])
            if w not in layer_buffers:
                layer_buffers.append(w)
    return out


def l2_warm_hints(schedule: Schedule, rules: str) -> dict[int, tuple[str, int, int]]:
    """Task id -> (buffer, first 16-byte piece, pieces) of its L2 warm-up (see L2_WARM_TARGETS).
    A layer's carriers split the concatenated bytes of its target buffers evenly; a share that
    spans two buffers warms its part in the first."""
    hints: dict[int, tuple[str, int, int]] = {}
    for target, carrier in parse_l2_warm(rules):
        weights = _target_weights(schedule, target)
        carriers: dict[int, list[int]] = {}
        for t in schedule.tasks:
            if t.op == L2_WARM_CARRIERS[carrier]:
                carriers.setdefault(t.layer, []).append(t.id)
        for layer, ids in carriers.items():
            segments = []  # (buffer, first piece, end piece) in the concatenation's order
            total = 0
            for name in weights.get(layer, []):
                pieces = schedule.buffers[name].nbytes // 16
                segments.append((name, total, total + pieces))
                total += pieces
            if not total:
                continue
            share = -(-total // len(ids))
            for i, tid in enumerate(ids):
                lo, hi = i * share, min(total, (i + 1) * share)
                for name, s0, s1 in segments:
                    if s0 <= lo < s1:
                        hints[tid] = (name, lo - s0, min(hi, s1) - lo)
                        break
    return hints


def encode(schedule: Schedule, l2_warm: str = "off") -> TaskWords:
    """Encode the schedule's queues, waits and signals, and the L2 warm-up hints of ``l2_warm``
    (CodegenOptions.l2_warm; raises EncodeError on bad indices)."""
    names = tuple(schedule.buffers)
    index = {n: i for i, n in enumerate(names)}
    try:
        hints = l2_warm_hints(schedule, l2_warm)
    except ValueError as e:
        raise EncodeError(str(e)) from None
    for n, b in schedule.buffers.items():
        if len(b.shape) > MAX_RANK:
            raise EncodeError(f"buffer {n} has rank {len(b.shape)}: the kernel's table holds at most {MAX_RANK}")
        if any(not 0 < s < 2**31 for s in b.shape):
            raise EncodeError(f"buffer {n} shape {b.shape}: every dim must be in [1, 2^31)")
    n_tasks = sum(len(q) for q in schedule.queues)
    if n_tasks != len(schedule.tasks):
        raise EncodeError(f"queues hold {n_tasks} tasks, the schedule has {len(schedule.tasks)}")
    records = np.zeros((n_tasks, RECORD_WORDS), dtype=np.int32)
    queue_start = np.zeros(schedule.num_sms + 1, dtype=np.int32)
    waits: list[tuple[int, int]] = []
    writers: dict[str, set[int]] = {}
    for c in schedule.counters:
        for p in c.producers:
            for region in schedule.tasks[p].writes:
                writers.setdefault(region.buffer, set()).add(c.id)
    row = 0
    for sm, queue in enumerate(schedule.queues):
        queue_start[sm] = row
        for tid in queue:
            t = schedule.tasks[tid]
            info = OP_INFO[t.op]
            r = records[row]
            r[W_OP], r[W_ID] = int(t.op), t.id
            task_waits = [tuple(w) for w in schedule.waits[tid]]
            if t.op in ROUTED_OPS:  # the routing first (see the module doc)
                first = routing_wait(schedule, tid, writers)
                task_waits = [first, *(w for w in task_waits if w[0] != first[0])]
            r[W_WAIT_OFF], r[W_WAIT_CNT] = len(waits), len(task_waits)
            waits.extend(task_waits)
            for i, (c, target) in enumerate(task_waits[:INLINE_WAITS]):
                r[W_WAITS + 2 * i], r[W_WAITS + 2 * i + 1] = c, target
            r[W_SIGNAL] = schedule.signals[tid]
            if len(t.operands) != len(info.operands) or len(t.args) != len(info.args):
                raise EncodeError(f"task {t.id} ({t.name}): operands/args do not match OP_INFO[{t.op.name}]")
            for i, name in enumerate(t.operands):
                if name != "-" and name not in index:
                    raise EncodeError(f"task {t.id} ({t.name}): operand {info.operands[i]} = {name!r} "
                                      f"is not a buffer of the schedule")
                r[W_OPERANDS + i] = index[name] if name != "-" else -1
            for i in range(len(t.operands), MAX_OPERANDS):
                r[W_OPERANDS + i] = -1
            r[W_ARGS:W_ARGS + len(t.args)] = t.args
            warm = hints.get(tid)
            r[W_WARM:W_WARM + 3] = (index[warm[0]], warm[1], warm[2]) if warm else (-1, 0, 0)
            row += 1
    queue_start[schedule.num_sms] = row
    w = np.array(waits if waits else [(0, 0)], dtype=np.int32).reshape(-1, 2)
    return TaskWords(records, queue_start, w, names, len(schedule.counters))


def record_descriptors(words: TaskWords, table: np.ndarray) -> np.ndarray:
    """Per record, the BUF_DESC of each operand role (zeros where absent): ``[records,
    MAX_OPERANDS]``. The kernel copies a record's block into shared memory together with the
    record (CodegenOptions.descriptors "record"), so a task finds its operands' pointers and shapes
    there without a dependent read of the buffer table."""
    idx = words.records[:, W_OPERANDS:W_OPERANDS + MAX_OPERANDS]
    out = np.zeros(idx.shape, dtype=BUF_DESC)
    present = idx >= 0
    out[present] = table[idx[present]]
    return out


def buffer_table(schedule: Schedule, names: tuple[str, ...], pointers: dict[str, int],
                 tiled: frozenset[str] = frozenset(), tagged: frozenset[str] = frozenset()) -> np.ndarray:
    """The BUF_DESC array for the kernel: shape and dtype from the schedule, pointers from the
    runtime; the bf16 weights named in ``tiled`` are stored in tile order (bf16_tiles), the f32
    buffers named in ``tagged`` are followed by their tagged copy (f32_tagged), a GEMV weight whose
    K is not whole 64-column blocks has the padded shape it is stored in (weight_tiles.padded_weights)."""
    padded = padded_weights(schedule)
    table = np.zeros(len(names), dtype=BUF_DESC)
    for i, n in enumerate(names):
        b = schedule.buffers[n]
        table[i]["ptr"] = pointers[n]
        table[i]["shape"] = (1,) * (MAX_RANK - len(b.shape)) + stored_shape(b.shape, n in padded)
        dtype = "f32_tagged" if n in tagged else b.dtype
        if n in tiled:
            dtype = "fp8_tiles" if b.dtype == "fp8" else "bf16_tiles"
        elif b.dtype == "fp8":
            raise EncodeError(f"buffer {n} is fp8: FP8 weights are read in tile order only")
        if n in tagged and b.dtype != "f32":
            raise EncodeError(f"buffer {n} is {b.dtype}: only an f32 buffer has a tagged copy")
        table[i]["dtype"] = DTYPE_CODES[dtype]
    return table


def tagged_words(numel: int) -> tuple[int, int]:
    """(offset, length) in float32 words of a tagged buffer's copy within its allocation: after
    its numel floats rounded up to 8 bytes, two words (value, step) per element (common.cuh:
    Task::tagged)."""
    off = 2 * ((numel + 1) // 2)
    return off, 2 * numel
