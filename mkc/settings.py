"""Every environment variable mkc reads, declared once with its default and a one-line reason.

Nothing else in mkc reads ``os.environ``: code calls the accessor functions below, which read the
environment at call time (so a test can set a variable with ``monkeypatch.setenv``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str  # the environment variable
    default: str  # used when it is unset or empty
    doc: str  # what it controls

    def get(self) -> str:
        return os.environ.get(self.name) or self.default


MKC_CACHE_DIR = EnvVar("MKC_CACHE_DIR", "~/.cache/mkc",
                       "where compiled kernels are cached (content-addressed; safe to delete)")
MKC_TUNING_FILE = EnvVar("MKC_TUNING_FILE", "",
                         "the one file of measured schedule choices (mkc bench --tune) to read and write; "
                         "default: tuning.json in the kernel cache, over the tables in configs/tuning/")
MKC_WATCHDOG_MS = EnvVar("MKC_WATCHDOG_MS", "2000",
                         "a task waiting longer than this on one counter aborts the decode step")

CUDA_HOME = EnvVar("CUDA_HOME", "/usr/local/cuda",
                   "CUDA toolkit root: header fallback when the NVIDIA wheels are absent; cuobjdump")

MKC_TEST_SERVE_BACKEND = EnvVar("MKC_TEST_SERVE_BACKEND", "cpu",
                                "backend the server tests start (cpu anywhere; cuda on an H100/H200)")

ALL: tuple[EnvVar, ...] = (MKC_CACHE_DIR, MKC_TUNING_FILE, MKC_WATCHDOG_MS, CUDA_HOME, MKC_TEST_SERVE_BACKEND)


def cache_dir() -> Path:
    """Root of the compiled-kernel cache (created on first write, not here)."""
    return Path(MKC_CACHE_DIR.get()).expanduser()


def tuning_file() -> Path:
    """The measured choices mkc bench --tune writes and the planner reads (mkc/schedule/tuning.py)."""
    return Path(MKC_TUNING_FILE.get()).expanduser() if MKC_TUNING_FILE.get() else cache_dir() / "tuning.json"


def tuning_tables() -> list[Path]:
    """Measured choices shipped with mkc (configs/tuning/*.json of a source checkout), read under
    tuning_file(); none when MKC_TUNING_FILE names the one file to use."""
    if MKC_TUNING_FILE.get():
        return []
    return sorted((Path(__file__).resolve().parents[1] / "configs" / "tuning").glob("*.json"))


def watchdog_ns() -> int:
    """Device-side bound on one counter wait, in nanoseconds of %globaltimer."""
    raw = MKC_WATCHDOG_MS.get()
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{MKC_WATCHDOG_MS.name}={raw!r}: expected a number of milliseconds") from None
    if ms <= 0:
        raise ValueError(f"{MKC_WATCHDOG_MS.name}={raw!r}: expected a positive number of milliseconds")
    return int(ms * 1e6)


def cuda_home() -> Path | None:
    """The CUDA toolkit root if it exists."""
    p = Path(CUDA_HOME.get())
    return p if p.is_dir() else None
