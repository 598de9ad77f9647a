"""FP8 (e4m3) weights as the compiler sees them: the weight formats, where each matrix's scales
are, and what the CPU executor reads.

A model is compiled for one weight format (``LowerOptions.weights``, ``--weights``):

- ``bf16``: every matrix as the checkpoint's bfloat16.
- ``fp8``: the matrices a GEMV streams (attention, dense MLP, experts, LM head) as float8_e4m3fn
  with one float32 scale per output row: w = float(q) * scale[row].
- ``fp8-block``: the same with one scale per 128 x 128 block (the layout most FP8 checkpoints
  ship): w = float(q) * scale[row // 128, col // 128].

Embeddings, norms and routers stay bf16 (a router's top-k is discontinuous: a rounding error
there picks other experts). Logical weights (runtime/weights.py) hold an FP8 matrix ``name`` as
the e4m3 tensor and its scales as ``name + SCALE_SUFFIX``, shape ``scale_shape``; on the GPU the
scales follow the matrix in one allocation (``scales_offset``), where the kernel finds them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WEIGHT_FORMATS = ("bf16", "fp8", "fp8-block")
SCALE_BLOCK = 128  # rows and columns of one block scale (fp8-block)
SCALE_SUFFIX = ".scale"  # logical name of a matrix's scales: name + SCALE_SUFFIX


# the weights a GEMV streams as matrices, by their names' ends (mkc/ir/lower.py: _Lowerer.matrix)
MATRIX_NAMES = (".w_qkv", ".w_o", ".w_gate_up", ".w_down", ".w_experts_gate_up", ".w_experts_down", "lm_head")


def fp8_matrices(weight_names, tied: bool) -> list[str]:
    """The weights an FP8 lowering stores as e4m3 (its ``fp8`` buffers), from a model's weight
    names (runtime/weights.py: weight_shapes) without lowering it: its matrices, and "lm_head",
    which a tied embedding gets as an FP8 copy."""
    names = [n for n in weight_names if n.endswith(MATRIX_NAMES)]
    return names + ["lm_head"] if tied and "lm_head" not in names else names


def weights_choice(fmt: str) -> dict[str, str]:
    """plan()'s lowering choice for the weight format ``fmt``: none for bf16, the default."""
    return {} if fmt == "bf16" else {"weights": fmt}


def is_fp8(fmt: str) -> bool:
    return fmt in ("fp8", "fp8-block")


def scale_grid(fmt: str, rows: int, k: int) -> tuple[int, int]:
    """Rows and columns one scale covers in a matrix of ``rows`` x ``k``."""
    return (SCALE_BLOCK, SCALE_BLOCK) if fmt == "fp8-block" else (1, k)


def scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales of an FP8 weight of ``shape`` [..., rows, k]: [..., rows, 1] (fp8) or
    [..., ceil(rows / 128), ceil(k / 128)] (fp8-block)."""
    *lead, rows, k = shape
    br, bk = scale_grid(fmt, rows, k)
    return (*lead, math.ceil(rows / br), math.ceil(k / bk))


def scale_bytes(fmt: str, rows: int, k: int) -> int:
    """Bytes of the scales a tile of ``rows`` x ``k`` of one matrix reads (float32)."""
    if not is_fp8(fmt):
        return 0
    br, bk = scale_grid(fmt, rows, k)
    return 4 * math.ceil(rows / br) * math.ceil(k / bk)


def stored_bytes(weights: dict[str, tuple[int, ...]], fmt: str, tied: bool) -> int:
    """Device bytes of a model's weights (name -> shape, runtime/weights.py: weight_shapes) in
    format ``fmt``: its matrices in FP8 with their scales, the rest bf16; a tied embedding's FP8
    copy for the LM head included."""
    fp8 = set(fp8_matrices(weights, tied)) if is_fp8(fmt) else set()
    total = 0
    for name in [*weights, *(["lm_head"] if "lm_head" in fp8 and "lm_head" not in weights else [])]:
        shape = weights.get(name) or weights["embed"]
        numel = math.prod(shape)
        total += numel + 4 * math.prod(scale_shape(fmt, shape)) if name in fp8 else 2 * numel
    return total


def scales_offset(numel: int) -> int:
    """Byte offset of an FP8 weight's scales in its device allocation: after its numel bytes,
    rounded up to 16 (templates/common.cuh: Task::scales)."""
    return (numel + 15) // 16 * 16


def given(name: str, shape: tuple[int, ...], fmt: str, weights: dict) -> torch.Tensor:
    """The float32 dequantised weight ``name`` of ``shape`` from logical ``weights`` (its e4m3
    tensor and its scales); raises ValueError naming the tensor when either is missing or wrong."""
    check(name, shape, fmt, weights)
    return dequantize(weights[name], weights[name + SCALE_SUFFIX])


def check(name: str, shape: tuple[int, ...], fmt: str, weights: dict) -> None:
    """Raise ValueError naming the tensor unless ``weights`` holds FP8 weight ``name`` of ``shape``
    (float8_e4m3fn) and its finite, positive float32 scales of scale_shape(fmt, shape)."""
    import torch

    scale_name = name + SCALE_SUFFIX
    for n in (name, scale_name):
        if n not in weights:
            raise ValueError(f"weight {n} is missing: --weights {fmt} reads an e4m3 matrix and its scales "
                             f"{scale_shape(fmt, shape)}")
    q, s = weights[name], weights[scale_name]
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != tuple(shape):
        raise ValueError(f"weight {name} is {q.dtype} {list(q.shape)}: expected float8_e4m3fn {list(shape)}")
    want = scale_shape(fmt, shape)
    if tuple(s.shape) != want or not s.is_floating_point():
        raise ValueError(f"weight {scale_name} is {s.dtype} {list(s.shape)}: expected float32 {list(want)} "
                         f"(--weights {fmt})")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"weight {scale_name} holds a scale that is not finite and positive")


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 w = float(q) * scale, each scale broadcast over its block: a scale per row where
    the scales have a row per row ([..., rows, 1]: fp8), else per 128 x 128 block (fp8-block, the
    edge blocks ragged)."""
    rows = q.shape[-2]
    if scale.shape[-2] == rows and scale.shape[-1] == 1:
        return q.float() * scale.float()
    s = scale.float().repeat_interleave(SCALE_BLOCK, -2)[..., :rows, :]
    return q.float() * s.repeat_interleave(SCALE_BLOCK, -1)[..., :q.shape[-1]]
