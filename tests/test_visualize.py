"""The human-readable artifacts of a schedule: summary, report.md, trace.json, schedule.html,
manifest.json, generated for the tiny config (fast: the whole file runs in about a second)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jinja2
import pytest

from mkc.ir.lower import lower
from mkc.ir.spec import load_spec
from mkc.schedule import visualize as viz
from mkc.schedule.schedule import Schedule
from mkc.schedule.scheduler import schedule

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def spec():
    return load_spec(CONFIG)


@pytest.fixture(scope="module")
def sc(spec) -> Schedule:
    return schedule(lower(spec, 2, 64, 8), spec.name)


@pytest.fixture(scope="module")
def out(sc, spec, tmp_path_factory) -> dict[str, Path]:
    return viz.write_artifacts(sc, spec, tmp_path_factory.mktemp("artifacts"), spec_path=CONFIG)


def test_summary_is_consistent(sc, spec):
    d = viz.summary(sc, spec)
    assert d["tasks"] == len(sc.tasks)
    assert d["counters"] == len(sc.counters)
    assert d["waits"] == sum(len(w) for w in sc.waits)
    # the tiny model at batch 2 routes to 7 distinct experts of its 8 slots on average (4 of 16 each)
    one_expert = sum(t.weight_bytes for t in sc.tasks  # one slot's expert, in every MoE layer
                     if t.op.name in ("EXPERT_SWIGLU", "EXPERT_DOWN") and t.arg("slot") == 0)
    assert d["bytes_every_slot"] == sum(t.weight_bytes + t.act_bytes for t in sc.tasks)
    assert d["bytes"] == pytest.approx(d["bytes_every_slot"] - (8 - 16 * (1 - (12 / 16) ** 2)) * one_expert)
    assert d["bytes"] == d["weight_bytes"] + d["act_bytes"]
    assert d["sol_us"] == pytest.approx(d["bytes"] / d["read_bw"] * 1e6)
    assert 0 < d["sol_fraction"] <= 1
    assert d["sol_fraction"] == pytest.approx(d["sol_us"] / d["step_us"])
    assert d["tok_s"] == pytest.approx(sc.batch / d["step_us"] * 1e6)
    assert d["critical_path_tasks"] == len(viz.chain(sc).tasks)
    tp = d["tasks_per_sm"]
    assert tp["min"] <= tp["mean"] <= tp["max"]
    assert tp["mean"] * sc.num_sms == pytest.approx(len(sc.tasks))
    assert d["bytes_per_sm"]["mean"] * sc.num_sms == pytest.approx(d["bytes"])
    text = viz.format_summary(d)
    assert 8 <= len(text.splitlines()) <= 10
    assert spec.name in text and "SOL" in text


def test_summary_of_a_loaded_schedule_matches(sc, spec):
    """Artifacts can be made from schedule.json alone."""
    loaded = Schedule.from_json(json.loads(json.dumps(sc.to_json())))
    assert viz.summary(loaded, spec) == viz.summary(sc, spec)


def test_trace_is_valid_and_complete(sc, out):
    doc = json.loads(out["trace"].read_text())
    ev = doc["traceEvents"]
    used = {i for i, q in enumerate(sc.queues) if q}
    threads = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(threads) == used
    assert all(name == f"SM {tid}" for tid, name in threads.items())

    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == len(sc.tasks)
    assert sorted(e["args"]["id"] for e in xs) == list(range(len(sc.tasks)))
    sm = sc.sm_of()
    for e in xs:
        t = sc.tasks[e["args"]["id"]]
        assert e["name"] == t.name and e["tid"] == sm[t.id] and e["pid"] == 0
        assert e["ts"] == sc.predicted["start_us"][t.id] and e["dur"] >= 0
        assert e["args"]["weight_bytes"] == t.weight_bytes

    # non-metadata events are sorted by time
    ts = [e["ts"] for e in ev if e["ph"] != "M"]
    assert ts == sorted(ts)

    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    assert starts and set(starts) == set(ends)
    assert len(starts) == sum(len(w) for w in sc.waits)  # one arrow per (counter, waiting task)
    slices: dict[int, list[tuple[float, float]]] = {}
    for e in xs:
        slices.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))

    def enclosed(e) -> bool:
        return any(lo <= e["ts"] <= hi for lo, hi in slices[e["tid"]])

    for fid, s in starts.items():
        f = ends[fid]
        assert f["bp"] == "e" and (s["cat"], s["name"]) == (f["cat"], f["name"])
        assert s["ts"] <= f["ts"]
        assert enclosed(s) and enclosed(f)


def test_html_is_self_contained(sc, out):
    html = out["html"].read_text()
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=", html, re.IGNORECASE)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", html, re.IGNORECASE)
    m = re.search(r'<script type="application/json" id="mkc-data">(.*?)</script>', html, re.DOTALL)
    assert m
    data = json.loads(m.group(1))
    assert len(data["t"]["n"]) == len(data["t"]["s"]) == len(sc.tasks)
    assert data["t"]["n"] == [t.name for t in sc.tasks]
    assert data["crit"] == viz.chain(sc).tasks
    assert data["meta"]["num_sms"] == sc.num_sms
    assert set(data["dag"]) == set(data["layers"])


def test_layer_dags_cover_every_op_and_flow_forward(sc, spec):
    data = viz.html_data(sc, spec)
    for layer, g in data["dag"].items():
        own = {n[0] for n in g["nodes"] if not n[6]}
        expect = {viz.op_label(t) for t in sc.tasks if viz.layer_label(t.layer, spec.num_layers) == layer}
        assert own == expect, layer
        for a, b, n in g["edges"]:
            assert g["nodes"][a][1] < g["nodes"][b][1] and n >= 0  # columns are generations
        if len(g["nodes"]) > 1:  # every op is joined to what it depends on or what depends on it
            joined = {i for a, b, _ in g["edges"] for i in (a, b)}
            assert joined == set(range(len(g["nodes"]))), (layer, [n[0] for n in g["nodes"]])
    assert any(n > 0 for g in data["dag"].values() for _, _, n in g["edges"])


def test_an_op_ordered_without_a_wait_of_its_own_keeps_its_edge(sc, spec):
    """topk reads the router's logits: an edge, with no wait where queue order or other waits
    order it (the scheduler leaves such a wait out)."""
    edges = viz.op_edges(sc)
    for t in sc.tasks:
        if t.op.name == "TOPK":
            assert ((t.layer, "router"), (t.layer, "topk")) in edges
    # every wait still counts on an edge: at least one per wait, one per producer op of its counter
    assert sum(edges.values()) >= sum(len(w) for w in sc.waits) > 0


def test_report_per_op_counts_sum_to_tasks(sc, out):
    text = out["report"].read_text()
    section = text.split("## Per op")[1].split("\n## ")[0]
    rows = [r.strip("|").split("|") for r in section.splitlines() if r.startswith("| ")]
    body = [r for r in rows[1:] if r[0].strip() not in ("op", "---", "**total**")]
    counts = {r[0].strip(): int(r[2]) for r in body}
    assert sum(counts.values()) == len(sc.tasks)
    assert set(counts) == {viz.op_label(t) for t in sc.tasks}
    assert "## Per layer" in text and "## Per-SM load" in text
    crit = text.split("## Critical path")[1].split("\n## ")[0]
    assert sum(1 for r in crit.splitlines() if re.match(r"\| \d+ \|", r)) == len(viz.chain(sc).tasks)


@pytest.fixture(scope="module")
def simulated(spec) -> Schedule:
    from mkc.schedule.simulate import predict

    return predict(schedule(lower(spec, 2, 64, 8), spec.name))


def _table_rows(text: str, section: str) -> list[list[str]]:
    part = text.split(f"## {section}")[1].split("\n## ")[0]
    rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in part.splitlines() if r.startswith("| ")]
    return [r for r in rows[2:]]  # past the header and its rule


def test_report_numbers_agree(simulated, spec, tmp_path):
    """Every time in report.md comes from the one simulated timeline: the per-op total is the
    summary's utilisation, the critical path fits in the step and its per-layer parts add up to it,
    and each layer's time to the next layer adds up to the step."""
    sc = simulated
    d = viz.summary(sc, spec)
    text = viz.write_report(sc, spec, tmp_path / "report.md").read_text()
    assert "report.md" not in text  # the report does not send the reader to itself
    total = _table_rows(text, "Per op")[-1]
    assert total[0] == "**total**" and total[5] == f"{d['utilisation']:.1%}", total
    assert d["critical_path_us"] <= d["step_us"]
    assert d["critical_path_us"] == pytest.approx(d["critical_run_us"] + d["critical_handoff_us"])
    layers = _table_rows(text, "Per layer")
    # the table prints each layer's times to 0.1 µs (off by at most 0.05 each): twice that per row
    assert sum(float(r[8]) for r in layers) == pytest.approx(d["critical_path_us"], abs=0.1 * len(layers))
    assert sum(float(r[7]) for r in layers) == pytest.approx(d["step_us"], abs=0.1 * len(layers))
    assert float(layers[0][6]) == 0.0  # the first layer starts the step
    ch = viz.chain(sc)
    start, end = sc.predicted["start_us"], sc.predicted["end_us"]
    assert all(start[b] >= end[a] for a, b in zip(ch.tasks, ch.tasks[1:]))  # each waits for the one before


def test_manifest_hashes_every_file(out):
    m = json.loads(out["manifest"].read_text())
    root = out["manifest"].parent
    assert m["inputs"]["spec"]["sha256"] == hashlib.sha256(CONFIG.read_bytes()).hexdigest()
    assert set(m["files"]) == {"report", "trace", "html"}
    for f in m["files"].values():
        assert hashlib.sha256((root / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    assert set(m["options"]) == {"batch", "context", "num_sms"}
    assert {"mkc", "python", "torch", "networkx", "jinja2"} <= set(m["versions"])
    assert m["created"]


def test_template_rendering_is_strict():
    with pytest.raises(jinja2.UndefinedError):
        viz._environment().from_string("{{ missing }}").render()


def test_template_found_without_the_installed_package(monkeypatch):
    """A plain checkout (mkc.templates not installed) falls back to the repo's templates/."""
    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(viz.importlib.resources, "files", missing)
    assert "mkc-data" in viz._template_text(viz.HTML_TEMPLATE)
