"""``mkc quantize``: a bf16/fp32 Hugging Face checkpoint folder → an FP8 (e4m3) checkpoint.

Every matrix a decode step streams is stored as float8_e4m3fn beside a float32 scale, in the
layouts the ecosystem reads (transformers, vLLM; ``load_checkpoint`` reads both back):

- ``--scheme block`` (default): transformers' FineGrainedFP8, ``quant_method: "fp8"``,
  ``weight_block_size: [B, B]``; tensor ``<name>_scale_inv`` [ceil(out/B), ceil(in/B)] holds the
  multiplier of each B x B block (w = fp8 * scale_inv, despite the name).
- ``--scheme channel``: compressed-tensors ``float-quantized``, weight strategy ``channel``;
  tensor ``<name>_scale`` [out, 1], one multiplier per output row.

Quantised: the attention projections (q, k, v, o), the dense MLP's gate/up/down, every expert's
gate/up/down, and the LM head when it is untied. Kept as they are (their dtype unchanged):
embeddings (a decode step gathers B rows of them, so FP8 would save no bytes, and a tied LM head
is the embedding), norms, and the MoE routers: a router is about 0.1% of a layer's bytes, and its
top-k is discontinuous, so a rounding error there picks other experts instead of perturbing one
(FP8 releases and llm-compressor leave ``mlp.gate`` unquantised too).

Scales: amax / 448 per block or row (448: e4m3's largest value), so the largest |w| of each block
lands on 448; w / scale is clamped to ±448 before the cast (float32 rounding can overshoot, and an
out-of-range cast may give NaN). An all-zero block gets scale 1: any positive scale stores its
zeros exactly, while amax / 448 = 0 would make w / scale NaN and reads as a broken scale.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the loader are imported where used: `mkc --help` builds this parser
    import torch

    from mkc.runtime.weights import Fp8Format

SCHEMES = ("block", "channel")

# HF tensor names of the matrices that are stored in FP8 (per-expert, fused and Mixtral layouts)
_QUANTIZED = re.compile(
    r"^model\.layers\.\d+\.("
    r"self_attn\.[qkvo]_proj\.weight"  # attention
    r"|mlp\.(gate|up|down)_proj\.weight"  # dense MLP
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj\.weight"  # experts, one tensor each
    r"|mlp\.experts\.(gate_up|down)_proj"  # experts, fused [E, out, in]
    r"|block_sparse_moe\.experts\.\d+\.w[123]\.weight"  # Mixtral experts
    r")$")
_ROUTER = re.compile(r"^(model\.layers\.\d+\.(mlp|block_sparse_moe)\.gate)\.weight$")  # group 1: the module
_NOT_COPIED = ("config.json", "model.safetensors.index.json")  # rewritten, not copied


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mkc quantize``."""
    p.add_argument("checkpoint", help="Hugging Face checkpoint folder (config.json + bf16/fp32 *.safetensors) of a "
                                      "model mkc loads")
    p.add_argument("-o", "--output", required=True, help="folder for the FP8 checkpoint (new or empty)")
    p.add_argument("--scheme", choices=SCHEMES, default="block",
                   help="block: one scale per --block x --block tile, transformers' FineGrainedFP8 layout "
                        "(quant_method fp8, weight_scale_inv); channel: one scale per output row, compressed-tensors "
                        "float-quantized (weight_scale [out, 1]) (default block)")
    p.add_argument("--block", type=_block, default=128,
                   help="rows and columns of a scale's tile with --scheme block (default 128, what FP8 "
                        "checkpoints ship)")


def _block(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{v!r}: expected a positive number of rows and columns, e.g. 128")
    return n


def quantize_main(a: argparse.Namespace) -> int:
    """``mkc quantize``: write the checkpoint, print what was quantised and the bytes saved."""
    stats = quantize_checkpoint(a.checkpoint, a.output, scheme=a.scheme, block=a.block)
    print(f"quantized {stats['quantized']} matrices to float8_e4m3fn ({a.scheme} scales), kept "
          f"{stats['kept']} tensors as they were; {_size(stats['bytes_in'])} -> {_size(stats['bytes_out'])}")
    print(f"wrote {a.output}")
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def fp8_format_for(scheme: str, block: int) -> Fp8Format:
    """The layout ``--scheme`` writes (what ``load_checkpoint`` reads back from its config)."""
    from mkc.runtime.weights import Fp8Format

    if scheme == "block":
        return Fp8Format("fp8", "block", (block, block), "_scale_inv")
    return Fp8Format("compressed-tensors", "channel", None, "_scale")


def quantize_weight(w: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] → (e4m3 [..., out, in], float32 scale ``fmt.scale_shape(w.shape)``).

    scale = amax / 448 over each block (edge blocks ragged), 1 where a block is all zeros;
    q = clamp(w / scale, ±448) rounded to nearest e4m3. Raises ValueError on a non-finite w."""
    import torch

    from mkc.runtime.weights import E4M3_MAX

    out, inp = w.shape[-2:]
    bo, bi = fmt.blocks(out, inp)
    ro, ri = math.ceil(out / bo), math.ceil(inp / bi)
    lead = w.shape[:-2]
    wf = w.float().reshape(-1, out, inp)
    padded = torch.nn.functional.pad(wf.abs(), (0, ri * bi - inp, 0, ro * bo - out))  # zeros: amax unchanged
    amax = padded.reshape(-1, ro, bo, ri, bi).amax(dim=(2, 4))  # [N, ro, ri]
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("holds inf or NaN values")
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero blocks (or amax underflowing)
    full = scale.repeat_interleave(bo, 1)[:, :out].repeat_interleave(bi, 2)[:, :, :inp]
    q = (wf / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scale.reshape(*lead, ro, ri)


def quantization_config(fmt: Fp8Format, keep: list[str]) -> dict:
    """config.json's ``quantization_config``; ``keep``: the modules left unquantised that an
    engine would otherwise convert (the tied LM head, the routers), by full name."""
    if fmt.quant_method == "fp8":
        assert fmt.block is not None
        # activation_scheme is for engines that also quantise activations; mkc keeps them bf16
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(fmt.block), "modules_to_not_convert": keep}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": fmt.strategy,
               "group_size": None, "block_structure": list(fmt.block) if fmt.block else None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": keep, "kv_cache_scheme": None}


def quantize_checkpoint(src: str | Path, dst: str | Path, *, scheme: str = "block", block: int = 128) -> dict[str, int]:
    """Write the FP8 checkpoint of folder ``src`` into ``dst``, shard by shard (the same file
    names; one shard's tensors in memory at a time), with config.json (plus its
    ``quantization_config``), an updated index and every other file (tokenizer, generation
    config) copied. Returns counts: quantized, kept, bytes_in, bytes_out.

    The files are written into a temporary folder beside ``dst`` that is renamed to ``dst`` at
    the end, so a failure halfway leaves no partial checkpoint. Raises ``CheckpointError`` (one
    line, naming the folder or tensor) on a missing folder, a folder without config.json or
    safetensors, a model mkc does not load, an already quantised checkpoint, a non-finite weight,
    or an output folder that is not new or empty."""
    from mkc.ir.spec import SpecError, load_spec
    from mkc.runtime.weights import CheckpointError

    src, dst = Path(src), Path(dst)
    if scheme not in SCHEMES:
        raise CheckpointError(f"--scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if block < 1:
        raise CheckpointError(f"--block {block}: expected a positive number of rows and columns")
    if not src.is_dir():
        what = "a file" if src.exists() else "no such folder"
        raise CheckpointError(f"{src}: {what}: expected a Hugging Face checkpoint folder (config.json + *.safetensors)")
    if not any(src.glob("*.safetensors")):
        raise CheckpointError(f"{src}: no *.safetensors files: expected a Hugging Face checkpoint folder")
    try:
        spec = load_spec(src)  # the model must be one mkc loads (config.json read and checked)
    except SpecError as e:
        raise CheckpointError(str(e)) from None
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise CheckpointError(f"{src / 'config.json'}: already quantized (quant_method "
                              f"{config['quantization_config'].get('quant_method')!r}): expected a bf16/fp32 checkpoint")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"-o {dst}: the input folder: expected a new or empty folder")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"-o {dst}: exists and is not an empty folder: expected a new or empty folder")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"  # mkdir, unlike mkdtemp, keeps the umask's mode
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        stats = _write(src, tmp, config, spec.tie_word_embeddings, fp8_format_for(scheme, block))
        os.replace(tmp, dst)  # an empty dst is replaced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


def _write(src: Path, dst: Path, config: dict, tied: bool, fmt: Fp8Format) -> dict[str, int]:
    """quantize_checkpoint's work, into the existing empty folder ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mkc.runtime.weights import CheckpointError

    stats = {"quantized": 0, "kept": 0, "bytes_in": 0, "bytes_out": 0}
    weight_map: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118 - safe_open handles are not iterable
                t = h.get_tensor(name)
                stats["bytes_in"] += t.numel() * t.element_size()
                if _QUANTIZED.match(name) or (name == "lm_head.weight" and not tied):
                    if t.dim() < 2 or not t.is_floating_point():
                        raise CheckpointError(f"{f}: tensor '{name}' is {t.dtype} of shape {list(t.shape)}: "
                                              f"expected a bf16/fp16/fp32 matrix")
                    try:
                        q, s = quantize_weight(t, fmt)
                    except ValueError as e:
                        raise CheckpointError(f"{f}: tensor '{name}' {e}: expected finite weights") from None
                    out[name], out[name + fmt.scale_suffix] = q, s
                    stats["quantized"] += 1
                else:
                    out[name] = t
                    stats["kept"] += 1
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        stats["bytes_out"] += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(out, f.name))

    keep = ["lm_head"] if tied else []
    keep += sorted({m.group(1) for m in map(_ROUTER.match, weight_map) if m}, key=lambda n: int(n.split(".")[2]))
    config = {**config, "quantization_config": quantization_config(fmt, keep)}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": stats["bytes_out"]}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for p in src.iterdir():  # tokenizer, generation config, chat template, ...
        if p.is_file() and p.suffix != ".safetensors" and p.name not in _NOT_COPIED:
            shutil.copy2(p, dst / p.name)
    return stats


def fp8_weights(weights: dict, buffers: dict, fmt: str) -> dict:
    """Logical weights for a schedule compiled with ``--weights fp8|fp8-block`` (mkc/ir/fp8.py):
    every fp8 buffer of ``buffers`` as its e4m3 matrix and scales, quantised here from the bf16 or
    float32 ``weights`` (an FP8 LM head from a tied embedding); the other weights as they were.
    One matrix at a time, on the weights' device; the bf16 source of a quantised matrix is dropped
    from the result."""
    from mkc.ir.fp8 import SCALE_SUFFIX

    scheme = _scheme(fmt)
    out = dict(weights)
    for name, b in buffers.items():
        if b.kind != "weight" or b.dtype != "fp8":
            continue
        source = name if name in weights else "embed" if name == "lm_head" else None
        if source is None or source not in weights:
            raise ValueError(f"weight {name} is missing from the weights given: --weights {fmt} quantises it")
        try:
            q, s = quantize_weight(weights[source], scheme)
        except ValueError as e:
            raise ValueError(f"weight {source}: {e}") from None
        out[name], out[name + SCALE_SUFFIX] = q, s
    return out


def fp8_device_weights(weights: dict, names: list[str], fmt: str):
    """fp8_weights laid out as the kernel reads them, for a CudaDecoder to take as they are: each
    FP8 matrix ``names`` (mkc/ir/fp8.py: fp8_matrices) quantised on its source's device
    (fp8_device_matrix). Returns a TiledWeights naming
    those matrices (their scales under name + SCALE_SUFFIX). Consumes ``weights``: each bf16 source
    matrix is dropped from it once quantised (a tied embedding stays), so the GPU holds the model
    once."""
    import torch

    from mkc.codegen.weight_tiles import TiledWeights
    from mkc.ir.fp8 import SCALE_SUFFIX

    for name in names:
        if name in weights and weights[name].dtype == torch.float8_e4m3fn and name + SCALE_SUFFIX in weights:
            continue  # laid out already (device_random_fp8_weights, or an earlier call)
        source = name if name in weights else "embed" if name == "lm_head" and "embed" in weights else None
        if source is None:
            raise ValueError(f"weight {name} is missing from the weights given: --weights {fmt} quantises it")
        data, scales = fp8_device_matrix(weights[source], fmt, name)
        if source == name:
            del weights[name]
        weights[name], weights[name + SCALE_SUFFIX] = data, scales
    return TiledWeights(weights, names)


def fp8_device_matrix(w: torch.Tensor, fmt: str, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix [..., R, K] quantised (quantize_weight) into one allocation on its device, as the
    kernel reads it (mkc/codegen/weight_tiles.py: fp8_stored). Returns the views (elements,
    scales)."""
    from mkc.codegen.weight_tiles import fp8_stored

    try:
        q, s = quantize_weight(w, _scheme(fmt))
    except ValueError as e:
        raise ValueError(f"weight {name}: {e}") from None
    return fp8_stored(q, s, w.device)


def _scheme(fmt: str) -> Fp8Format:
    """The scale layout of a weight format (mkc/ir/fp8.py) as quantize_weight takes it."""
    from mkc.ir.fp8 import SCALE_BLOCK, is_fp8

    if not is_fp8(fmt):
        raise ValueError(f"--weights {fmt}: expected fp8 or fp8-block")
    return fp8_format_for("block" if fmt == "fp8-block" else "channel", SCALE_BLOCK)
