"""build_kernel / write_kernel: schedule + spec → rendered source → cached sm_90a cubin.

The cache is content-addressed: the key hashes the rendered source, every template file, the mkc
version, the NVRTC version, the architecture and the options. An entry is a folder
``<cache>/kernels/<name>/`` (``<name>`` = ``<model>-b<batch>-sm90a-<sha8>``) holding
``kernel.cu``, ``kernel.cubin`` and ``kernel.json``; each file is written to a temporary file and
renamed into place (``os.replace``), and builds of one key are serialised by a file lock
(load → lock → check again → build), so concurrent processes never see a torn entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import mkc
from mkc import settings
from mkc.codegen import nvrtc
from mkc.codegen.render import (
    KERNEL_NAME,
    TEMPLATE_DIR,
    CodegenOptions,
    KernelConfig,
    kernel_config,
    render_source,
    template_files,
)
from mkc.ir.spec import ModelSpec
from mkc.schedule.schedule import Schedule


@dataclass(frozen=True, slots=True)
class KernelArtifact:
    name: str  # <model>-b<batch>-sm90a-<sha8>
    cu_source: str  # rendered CUDA C++
    cubin: bytes  # sm_90a
    log: str  # NVRTC / ptxas log
    regs: int  # registers per thread
    smem: int  # static shared memory, bytes (the dynamic part is config.smem_bytes)
    spills: int  # spill stores + loads, bytes (0 expected)
    config: KernelConfig  # constants the kernel was built with (threads, dynamic smem, ...)
    kernel_name: str = KERNEL_NAME  # entry point in the cubin

    @property
    def threads(self) -> int:
        return self.config.threads

    @property
    def dynamic_smem(self) -> int:
        return self.config.smem_bytes


def cache_key(source: str, opts: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, mkc.__version__, nvrtc.nvrtc_version(), nvrtc.ARCH, "\0".join(nvrtc.key_options(opts))):
        h.update(part.encode())
        h.update(b"\0")
    for f in template_files(TEMPLATE_DIR):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def artifact_name(spec: ModelSpec, batch: int, key: str) -> str:
    return f"{spec.name}-b{batch}-{nvrtc.ARCH.replace('_', '')}-{key[:8]}"


def build_kernel(schedule: Schedule, spec: ModelSpec, options: CodegenOptions | None = None,
                 cache_dir: Path | None = None) -> KernelArtifact:
    """Render and compile (or fetch from the cache) the kernel for this spec and batch.

    Raises CodegenError (a shape the kernel cannot take) or nvrtc.CompileError (with the log, the
    dumped .cu path and the options). Idempotent; safe to call from several processes at once.
    """
    cfg = kernel_config(schedule, spec, options or CodegenOptions())
    banner = f"mkc {mkc.__version__}: {spec.name}, batch {cfg.batch}, {cfg.threads} threads/CTA"
    source = render_source(cfg, banner)
    opts = nvrtc.options(TEMPLATE_DIR)
    key = cache_key(source, opts)
    name = artifact_name(spec, cfg.batch, key)
    root = (cache_dir or settings.cache_dir()) / "kernels"
    entry = root / name
    hit = _load(entry, name, source, cfg)
    if hit is not None:
        return hit
    with _locked(root / f"{name}.lock"):
        hit = _load(entry, name, source, cfg)
        if hit is not None:
            return hit
        cubin, log = nvrtc.compile_cubin(source, name, opts, dump_dir=root)
        res = nvrtc.parse_resources(log, KERNEL_NAME)
        art = KernelArtifact(name=name, cu_source=source, cubin=cubin, log=log, regs=res.regs, smem=res.smem,
                             spills=res.spills, config=cfg)
        entry.mkdir(parents=True, exist_ok=True)
        _atomic_write(entry / "kernel.cu", source.encode())
        _atomic_write(entry / "kernel.cubin", cubin)
        _atomic_write(entry / "kernel.json", json.dumps(_manifest(art), indent=1).encode())
        return art


def write_kernel(schedule: Schedule, spec: ModelSpec, out_dir: str | Path,
                 options: CodegenOptions | None = None) -> dict[str, Path]:
    """Build (or fetch) the kernel; write kernel.cu, kernel.cubin and kernel.json (name, registers,
    shared memory, spills, constants, ptxas log) into out_dir. Returns {file name: path}."""
    art = build_kernel(schedule, spec, options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"kernel.cu": out / "kernel.cu", "kernel.cubin": out / "kernel.cubin", "kernel.json": out / "kernel.json"}
    _atomic_write(files["kernel.cu"], art.cu_source.encode())
    _atomic_write(files["kernel.cubin"], art.cubin)
    meta = _manifest(art)
    try:  # the code size by op (sass.instructions_by_op), where nvdisasm is installed
        from mkc.codegen.sass import instructions_by_op

        meta["sass_by_op"] = instructions_by_op(art.cubin, art.cu_source)
    except (FileNotFoundError, subprocess.CalledProcessError):
        pass
    _atomic_write(files["kernel.json"], json.dumps(meta, indent=1).encode())
    return files


def _manifest(art: KernelArtifact) -> dict:
    return {"name": art.name, "kernel": art.kernel_name, "regs": art.regs, "static_smem": art.smem,
            "dynamic_smem": art.dynamic_smem, "spills": art.spills, "threads": art.threads,
            "config": asdict(art.config), "log": art.log}


def _load(entry: Path, name: str, source: str, cfg: KernelConfig) -> KernelArtifact | None:
    try:
        cubin = (entry / "kernel.cubin").read_bytes()
        meta = json.loads((entry / "kernel.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("name") != name or not cubin:
        return None
    return KernelArtifact(name=name, cu_source=source, cubin=cubin, log=meta.get("log", ""), regs=meta["regs"],
                          smem=meta["static_smem"], spills=meta["spills"], config=cfg)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
