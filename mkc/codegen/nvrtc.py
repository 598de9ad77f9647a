"""NVRTC: CUDA C++ source → sm_90a cubin, with the ptxas resource report.

Runs without a GPU (NVRTC needs no driver). Headers: the CUDA runtime and CCCL wheels, found by
``cuda.pathfinder`` (falling back to ``$CUDA_HOME/include``), plus ``templates/`` for the
hand-written ``*.cuh``. Cubins, never PTX, are loaded later: NVRTC 13.x PTX may be newer than
the driver's JIT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ARCH = "sm_90a"


class CompileError(RuntimeError):
    """NVRTC rejected the kernel: carries the log, the dumped source path and the options."""

    def __init__(self, log: str, source_path: Path | None, options: list[str]):
        self.log, self.source_path, self.options = log, source_path, options
        where = f"source dumped at {source_path}" if source_path else "source not dumped"
        super().__init__(f"NVRTC failed to compile the kernel ({where}).\noptions: {' '.join(options)}\n"
                         f"--- NVRTC log ---\n{log.strip()}")


@dataclass(frozen=True, slots=True)
class Resources:
    regs: int  # registers per thread
    smem: int  # static shared memory (bytes)
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # stack frame bytes

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


@lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """cudart and CCCL header folders (cuda_bf16.h needs both)."""
    dirs: list[str] = []
    try:
        import cuda.pathfinder as pf

        for lib in ("cudart", "cccl"):
            d = pf.find_nvidia_header_directory(lib)
            if d:
                dirs.append(str(d))
    except ImportError:
        pass
    if len(dirs) < 2:
        from mkc import settings

        home = settings.cuda_home()
        if home:
            dirs += [str(Path(home) / "include"), str(Path(home) / "include" / "cccl")]
    return tuple(dict.fromkeys(d for d in dirs if Path(d).is_dir()))


def options(template_dir: Path) -> list[str]:
    """NVRTC options; those without a path go into the cache key (see key_options)."""
    return [f"--gpu-architecture={ARCH}", "-std=c++17", "--ptxas-options=-v", "-lineinfo", "-DNDEBUG",
            f"-I{template_dir}", *(f"-I{d}" for d in include_dirs())]


def key_options(opts: list[str]) -> list[str]:
    """The options that change the binary (include paths differ between machines, not the code)."""
    return [o for o in opts if not o.startswith("-I")]


def compile_cubin(source: str, name: str, opts: list[str], dump_dir: Path | None) -> tuple[bytes, str]:
    """(cubin, log). On failure dumps the source under dump_dir and raises CompileError."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        enc = [o.encode() for o in opts]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        log = _log(prog)
        if cerr != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            path = None
            if dump_dir is not None:
                dump_dir.mkdir(parents=True, exist_ok=True)
                path = dump_dir / f"{name}.failed.cu"
                path.write_text(source)
            raise CompileError(log, path, opts)
        err, n = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        buf = bytearray(n)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check(err, "nvrtcGetCUBIN")
        return bytes(buf), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_resources(log: str, kernel: str) -> Resources:
    """Registers, static smem and spills of the entry ``kernel`` from the ptxas -v log."""
    # the log lists each function's "Function properties" then its "Used N registers" line
    sections = log.split("Function properties for ")
    for sec in sections[1:]:
        if sec.startswith(kernel):
            regs, smem, sp = _REGS.search(sec), _SMEM.search(sec), _SPILL.search(sec)
            return Resources(regs=int(regs.group(1)) if regs else -1, smem=int(smem.group(1)) if smem else 0,
                             stack=int(sp.group(1)) if sp else 0, spill_stores=int(sp.group(2)) if sp else 0,
                             spill_loads=int(sp.group(3)) if sp else 0)
    return Resources(regs=-1, smem=-1, spill_stores=-1, spill_loads=-1, stack=-1)


def _log(prog) -> str:
    from cuda.bindings import nvrtc

    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    buf = bytearray(n)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
