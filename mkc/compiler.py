"""The compile pipeline, stage by stage: spec → task DAG → schedule → validation → artifacts.

Every stage leaves something a person can open in the output folder: schedule.json, report.md,
trace.json, schedule.html, manifest.json (and kernel.cu / kernel.cubin when codegen is asked for).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mkc.ir.spec import ModelSpec, load_spec
from mkc.schedule.plan import LOWERING_CHOICES, plan
from mkc.schedule.schedule import Schedule


@dataclass(slots=True)
class CompileResult:
    spec: ModelSpec
    schedule: Schedule
    files: dict[str, Path] = field(default_factory=dict)  # artifact name → path
    timings: dict[str, float] = field(default_factory=dict)  # stage → seconds


def compile_schedule(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0,
                     attention_sms: int | None = None, gpu: str = "h200", **lowering) -> tuple[Schedule, dict[str, float]]:
    """Lower, schedule (choosing the attention SMs unless given: mkc/schedule/plan.py) and
    validate; raises SpecError or ScheduleError. ``lowering``: plan's LOWERING_CHOICES (default:
    the planner's). ``gpu`` (a name of cost.GPUS) is the card whose read bandwidth the step is
    predicted at; the schedule does not depend on it."""
    from mkc.schedule.simulate import predict
    from mkc.schedule.validator import check

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    sc = plan(spec, batch, context, num_sms, page_size, attention_sms=attention_sms, **lowering)
    t1 = time.perf_counter()
    check(sc)
    t2 = time.perf_counter()
    predict(sc, gpu)  # the step's timeline under shared bandwidth, as reported (simulate.py)
    times.update(plan=t1 - t0, validate=t2 - t1, simulate=time.perf_counter() - t2)
    sc.meta.update(options={"batch": batch, "context": context, "num_sms": num_sms, "page_size": page_size, "gpu": gpu,
                            "attention_sms": sc.meta["attention_sms"]["chosen"],
                            **{k: sc.meta[k] for k in LOWERING_CHOICES}})
    return sc, times


def _check_kernel_resources(sc: Schedule, kernel_json: Path) -> None:
    """The validator's resource duty with the compiled kernel's registers and shared memory."""
    import json

    from mkc.schedule.validator import check_resources

    k = json.loads(kernel_json.read_text())
    check_resources(sc, smem_bytes=int(k["static_smem"]) + int(k["dynamic_smem"]), regs=int(k["regs"]),
                    threads=int(k["threads"]))


class OutputError(ValueError):
    """The output folder cannot be written (a file is in its place, or no permission)."""


def compile_to_folder(spec_path: str | Path, out_dir: str | Path, *, batch: int = 1, context: int = 8192,
                      num_sms: int = 132, page_size: int = 0, attention_sms: int | None = None,
                      kernel: bool = True, gpu: str = "h200", **lowering) -> CompileResult:
    """Run the whole pipeline and write every artifact into out_dir (``lowering``: as
    compile_schedule).

    All or nothing: the artifacts are written into a hidden folder beside out_dir and moved into
    it only once every stage has passed, so a failed or interrupted compile leaves out_dir as it
    was (or absent). Files of out_dir that the compile does not write are kept. Raises
    OutputError when out_dir cannot be written, before any work."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"-o {out}: a file of that name exists: expected a folder (new, or one to add "
                          f"the artifacts to)")
    with _staging(out) as stage:
        spec = load_spec(spec_path)
        sc, times = compile_schedule(spec, batch, context, num_sms, page_size, attention_sms, gpu, **lowering)
        files = _write_artifacts(spec_path, spec, sc, stage, times, kernel)
    return CompileResult(spec=spec, schedule=sc, files={k: out / p.name for k, p in files.items()}, timings=times)


def _write_artifacts(spec_path: str | Path, spec: ModelSpec, sc: Schedule, out: Path, times: dict[str, float],
                     kernel: bool) -> dict[str, Path]:
    """Every artifact of compile_to_folder, into ``out``; adds each stage's seconds to ``times``."""
    from mkc.schedule import visualize

    t0 = time.perf_counter()
    files = {
        "schedule.json": out / "schedule.json",
        "report.md": out / "report.md",
        "trace.json": out / "trace.json",
        "schedule.html": out / "schedule.html",
    }
    sc.save(files["schedule.json"])
    visualize.write_report(sc, spec, files["report.md"])
    visualize.write_trace(sc, files["trace.json"])
    visualize.write_html(sc, spec, files["schedule.html"])
    times["artifacts"] = time.perf_counter() - t0
    if kernel:
        t0 = time.perf_counter()
        from mkc.codegen import write_kernel

        files.update(write_kernel(sc, spec, out))
        times["kernel"] = time.perf_counter() - t0
        _check_kernel_resources(sc, files["kernel.json"])
    files["manifest.json"] = out / "manifest.json"
    spec_file = Path(spec_path) / "config.json" if Path(spec_path).is_dir() else Path(spec_path)  # a checkpoint folder
    visualize.write_manifest(files["manifest.json"], spec_path=spec_file, spec=spec,
                             options=sc.meta["options"],
                             files={k: v for k, v in files.items() if k != "manifest.json"})
    return files


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A fresh hidden folder beside ``out`` to write into; on success its files move into ``out``
    (the folder is renamed when ``out`` does not exist yet), on any failure it is removed, with
    the parent folders this call created."""
    created = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        _remove_empty(created)
        raise OutputError(f"-o {out}: cannot create the output folder ({e.strerror or e})") from None
    try:
        yield stage
        if out.exists():
            for f in stage.iterdir():
                os.replace(f, out / f.name)
            stage.rmdir()
        else:
            os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_empty([p for p in created if p != out.absolute()])
        raise


def _remove_empty(folders: list[Path]) -> None:
    """Remove the given folders, innermost first, where they are empty."""
    for p in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            p.rmdir()
