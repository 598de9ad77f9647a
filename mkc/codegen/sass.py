"""SASS inspection of a built cubin with cuobjdump (no GPU needed).

cuobjdump comes from the ``nvidia-cuda-cuobjdump`` wheel (found by ``cuda.pathfinder``) or a CUDA
toolkit (``$CUDA_HOME/bin``). Used by CI to prove the kernel has no local-memory traffic (spills
or stack arrays show up as LDL / STL) and that the GEMV runs on the tensor cores (HMMA).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from mkc import settings


def find_cuobjdump() -> str | None:
    """Path of a cuobjdump binary, or None."""
    try:
        import cuda.pathfinder as pf

        p = pf.find_nvidia_binary_utility("cuobjdump")
        if p:
            return str(p)
    except (ImportError, AttributeError):
        pass
    home = settings.cuda_home()
    if home and (home / "bin" / "cuobjdump").is_file():
        return str(home / "bin" / "cuobjdump")
    return shutil.which("cuobjdump")


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
