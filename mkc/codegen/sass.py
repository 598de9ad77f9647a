"""SASS inspection of a built cubin with cuobjdump and nvdisasm (no GPU needed).

Both come from the ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels (found by
``cuda.pathfinder``) or a CUDA toolkit (``$CUDA_HOME/bin``). Used by CI to prove the kernel has no
local-memory traffic (spills or stack arrays show up as LDL / STL) and that the GEMV runs on the
tensor cores (HMMA), and by ``mkc compile`` to report the kernel's code size by op
(``instructions_by_op``): the kernel does not fit the SM's instruction cache, so code size costs
time (docs/kernel.md, "Code size").
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from mkc import settings


def find_binary_utility(name: str) -> str | None:
    """Path of a CUDA binary utility (cuobjdump, nvdisasm), or None."""
    try:
        import cuda.pathfinder as pf

        p = pf.find_nvidia_binary_utility(name)
        if p:
            return str(p)
    except (ImportError, AttributeError):
        pass
    home = settings.cuda_home()
    if home and (home / "bin" / name).is_file():
        return str(home / "bin" / name)
    return shutil.which(name)


def find_cuobjdump() -> str | None:
    """Path of a cuobjdump binary, or None."""
    return find_binary_utility("cuobjdump")


def disassemble(cubin: bytes, tool: str | None = None) -> str:
    """cuobjdump -sass of the cubin (raises FileNotFoundError without cuobjdump)."""
    tool = tool or find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found: install nvidia-cuda-cuobjdump or set CUDA_HOME")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True)
    return out.stdout


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?")


def opcode_counts(sass: str) -> Counter[str]:
    """How often each SASS opcode (without modifiers) occurs."""
    return Counter(m.group(1) for m in _OPCODE.finditer(sass))


def local_memory_ops(sass: str) -> list[str]:
    """SASS lines that touch local memory (LDL / STL): spills or stack arrays."""
    return [ln.strip() for ln in sass.splitlines() if re.search(r"\b(LDL|STL)(\.|\s)", ln)]


_CASE = re.compile(r"^\s*case OP_(\w+):")
_LINE_INFO = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+[A-Z@{]")
_FUNCTION = re.compile(r"^\s*\.type\s+(\S+),@function")
_MANGLED = re.compile(r"_Z(\d+)")
KERNEL_LOOP = "kernel loop"
# out-of-line device functions that belong to the kernel loop (its wait), by name
_LOOP_FUNCTIONS = ("wait_all",)


def function_name(symbol: str) -> str:
    """The plain name of an out-of-line device function's SASS symbol, e.g.
    ``$mkc_decode$_Z19route_tokens_sharedPKf`` -> ``route_tokens_shared``."""
    m = _MANGLED.search(symbol)
    if m is None:
        return symbol.strip("$").split("$")[-1]
    return symbol[m.end():m.end() + int(m.group(1))]


@functools.lru_cache(maxsize=2)
def _line_table(cubin: bytes, tool: str | None) -> str:
    """nvdisasm -gi of the cubin: its SASS with the line table's file and line comments (raises
    FileNotFoundError without nvdisasm). The last two listings are kept, so instruction_owners and
    instruction_lines of one cubin (benchmarks/stalls_by_op.py --op) run nvdisasm once."""
    tool = tool or find_binary_utility("nvdisasm")
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: install nvidia-cuda-nvdisasm or set CUDA_HOME")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([tool, "-gi", str(path)], capture_output=True, text=True, check=True).stdout


def instruction_owners(cubin: bytes, source: str, tool: str | None = None) -> list[str]:
    """The op each of the cubin's SASS instructions belongs to, in nvdisasm's order (the kernel,
    then each out-of-line function: the order of their addresses in the module, which is how
    ncu's source page lists them). ``source`` is the rendered kernel the cubin was built from with
    -lineinfo: nvdisasm's line table names, for each instruction, its source line and the line it
    was inlined at, and an instruction on or inlined at a dispatch ``case OP_<NAME>:`` line of the
    kernel belongs to that op. An out-of-line device function that ops share (``__noinline__``,
    e.g. the routing: ops.cuh route_tokens) goes under its own name; the kernel loop's wait
    (``wait_all``) and the compiler's own routines under ``KERNEL_LOOP``. Raises
    FileNotFoundError without nvdisasm."""
    cases = {i + 1: m.group(1) for i, line in enumerate(source.splitlines()) for m in [_CASE.match(line)] if m}
    out = _line_table(cubin, tool)
    owners: list[str] = []
    owner = KERNEL_LOOP
    function = None  # the out-of-line function being read, None inside the kernel itself
    for line in out.splitlines():
        f = _FUNCTION.match(line)
        if f:
            symbol = f.group(1)
            name = function_name(symbol)
            shared = symbol.startswith("$") and "__internal" not in symbol and name not in _LOOP_FUNCTIONS
            function = name if shared else None
            owner = function or KERNEL_LOOP
            continue
        m = _LINE_INFO.search(line)
        if m:
            owner = function or KERNEL_LOOP
            if function is None:
                for file, no in ((m.group(1), m.group(2)), (m.group(3), m.group(4))):
                    if file and file.endswith(".cu") and int(no) in cases:
                        owner = cases[int(no)]
            continue
        if _INSTRUCTION.match(line) and ".byte" not in line:
            owners.append(owner)
    return owners


def instruction_lines(cubin: bytes, tool: str | None = None) -> list[tuple[str, ...]]:
    """Where each of the cubin's SASS instructions comes from, in nvdisasm's order (as
    ``instruction_owners``): its source line and the lines it was inlined at, innermost first, each
    as ``file:line`` with the file's base name (``("gemv.cuh:162", "ops.cuh:88", ...)``); empty for
    an instruction without line information. The cubin must be built with -lineinfo (the kernel is).
    Raises FileNotFoundError without nvdisasm."""
    out = _line_table(cubin, tool)
    lines: list[tuple[str, ...]] = []
    chain: list[str] = []
    fresh = True  # the next line-info comment starts a new chain (an instruction came since)
    for line in out.splitlines():
        if _FUNCTION.match(line):
            chain, fresh = [], True
            continue
        m = _LINE_INFO.search(line)
        if m:
            if fresh:
                chain, fresh = [], False
            chain.append(f"{Path(m.group(1)).name}:{m.group(2)}")
            continue
        if _INSTRUCTION.match(line) and ".byte" not in line:
            lines.append(tuple(chain))
            fresh = True
    return lines


def instructions_by_op(cubin: bytes, source: str, tool: str | None = None) -> dict[str, int]:
    """The kernel's SASS instructions by the op they belong to (``instruction_owners``): opcode
    name → count, in descending order, the rest under ``KERNEL_LOOP`` (the task loop, the waits,
    the weights asked for while waiting)."""
    return dict(Counter(instruction_owners(cubin, source, tool)).most_common())
