"""The mkc command line as a user runs it: compile, check, import-hf, bad input."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, assert_one_line_error, run_main


def mkc(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "mkc.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, check=False)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    r = mkc("compile", "configs/tiny.yaml", "-o", out, "--batch", 2, "--context", 64, "--num-sms", 8, "--no-kernel")
    assert r.returncode == 0, r.stderr
    return out, r.stdout


def test_compile_writes_the_folder(compiled):
    out, stdout = compiled
    for f in ("schedule.json", "report.md", "trace.json", "schedule.html", "manifest.json"):
        assert (out / f).stat().st_size > 0, f
    assert "predicted step" in stdout and "critical path" in stdout and "of SOL" in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    # every choice the schedule was made with, as schedule.json's meta records them
    options = json.loads((out / "schedule.json").read_text())["meta"]["options"]
    assert manifest["options"] == options
    assert {k: options[k] for k in ("batch", "context", "num_sms", "page_size", "weights")} == {
        "batch": 2, "context": 64, "num_sms": 8, "page_size": 0, "weights": "bf16"}


def test_compile_says_how_the_branches_share_the_sms(compiled, tmp_path):
    """The compiler's choice of attention SMs, with every candidate's prediction; an asked count."""
    _, stdout = compiled
    line = next(ln for ln in stdout.splitlines() if ln.startswith("attention SMs"))
    assert "chosen by a probe's step under shared bandwidth" in line and "0: " in line, line
    r = mkc("compile", "configs/tiny.yaml", "-o", tmp_path, "--batch", 2, "--context", 64, "--num-sms", 8,
            "--attention-sms", 4, "--no-kernel")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("attention SMs"))
    assert "4 for the attention splits, 4 for the MLP tiles, as asked" in line, line
    meta = json.loads((tmp_path / "schedule.json").read_text())["meta"]
    assert meta["attention_sms"]["chosen"] == 4


def test_compile_ends_the_layer_as_asked(compiled, tmp_path):
    """--residual-in-o-proj on: no residual tiles, the O-projection tiles write the next layer's
    stream, and the summary says so (auto here: nothing measured, residual tiles)."""
    _, stdout = compiled
    assert next(ln for ln in stdout.splitlines() if ln.startswith("layer end")).endswith(
        "residual tiles add the attention and the MLP's output")
    r = mkc("compile", "configs/tiny.yaml", "-o", tmp_path, "--batch", 2, "--context", 64, "--num-sms", 8,
            "--residual-in-o-proj", "on", "--no-kernel")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("layer end"))
    assert line.endswith("the O-projection tiles add the residual and the MLP's output (no residual tiles), as asked")
    sc = json.loads((tmp_path / "schedule.json").read_text())
    assert sc["meta"]["residual_in_o_proj"] is True
    assert not any(t["op"] == "RESIDUAL" for t in sc["tasks"])


def test_compile_predicts_the_step_on_the_gpu_asked(compiled, tmp_path):
    """--gpu h100: the same schedule, its step and speed of light at an H100's read bandwidth."""
    r = mkc("compile", "configs/tiny.yaml", "-o", tmp_path, "--batch", 2, "--context", 64, "--num-sms", 8,
            "--no-kernel", "--gpu", "h100")
    assert r.returncode == 0, r.stderr
    assert "at 3.05 TB/s (an H100's read bandwidth)" in r.stdout
    assert "at 4.25 TB/s (an H200's read bandwidth)" in compiled[1]
    h100, h200 = (json.loads((d / "schedule.json").read_text()) for d in (tmp_path, compiled[0]))
    assert h100["queues"] == h200["queues"]
    assert h100["predicted"]["simulated_on"] == {"gpu": "h100", "read_bw": 3.05e12}
    bad = mkc("compile", "configs/tiny.yaml", "-o", tmp_path, "--no-kernel", "--gpu", "a100")
    assert bad.returncode == 2 and "--gpu: invalid choice: 'a100'" in bad.stderr


def test_check_accepts_the_compiled_schedule(compiled):
    out, _ = compiled
    r = mkc("check", out / "schedule.json")
    assert r.returncode == 0 and "safe" in r.stdout


def test_check_rejects_a_dropped_wait(compiled, tmp_path):
    out, _ = compiled
    d = json.loads((out / "schedule.json").read_text())
    victim = next(t for t in d["tasks"] if t["op"] == "ATTN_SPLIT" and t["wait"])
    victim["wait"] = []
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    r = mkc("check", bad)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "UNSAFE" in r.stdout and victim["name"] in r.stdout


def test_check_bad_files(tmp_path):
    r = mkc("check", tmp_path / "missing.json")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = mkc("check", tmp_path)
    assert r.returncode == 2 and f"{tmp_path}: a folder: expected a schedule.json" in r.stderr
    (tmp_path / "junk.json").write_text('{"format": "something else"}')
    r = mkc("check", tmp_path / "junk.json")
    assert r.returncode == 2 and "not a valid mkc schedule" in r.stderr and "Traceback" not in r.stderr


def test_import_hf_round_trip(tmp_path):
    from mkc.ir.spec import load_spec

    cfg = {"model_type": "cohere2_moe", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 5,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16,
           "num_experts_per_tok": 4, "intermediate_size": 64, "first_k_dense_replace": 1,
           "prefix_dense_intermediate_size": 192, "sliding_window": 8, "expert_selection_fn": "sigmoid",
           "norm_topk_prob": False, "rms_norm_eps": 1e-6, "logit_scale": 0.5, "rope_theta": 50000.0,
           "hidden_act": "silu", "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = mkc("import-hf", tmp_path, "-o", tmp_path / "m.yaml", "--name", "tiny")
    assert r.returncode == 0, r.stderr
    assert load_spec(tmp_path / "m.yaml") == load_spec(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize("args,needle", [
    (("compile", "configs/tiny.yaml", "--batch", "9"), "--batch"),
    (("compile", "nope.yaml", "--no-kernel"), "no such file"),
    (("import-hf", "configs"), "config.json"),
    (("import-hf", "configs/tiny.yaml", "-o", "configs"), "-o configs: cannot write it (Is a directory)"),
    (("compile", "configs/tiny.yaml", "--page-size", "-3", "--no-kernel"), "--page-size"),
    (("compile", "configs/tiny.yaml", "--context", "64", "--page-size", "65", "--no-kernel"), "--page-size 65"),
    (("bench", "--config", "configs/tiny.yaml", "--random-weights", "--context", "128", "--page-size", "256"),
     "--page-size 256 is longer than the context 128"),
    (("compile", "configs/tiny.yaml", "--attention-sms", "some", "--no-kernel"), "'some': expected 'auto' or a number"),
    (("compile", "configs/tiny.yaml", "--num-sms", "8", "--attention-sms", "8", "--no-kernel"),
     "--attention-sms 8: expected 0 (every op fills all SMs) or fewer than the 8 SMs"),
    (("compile", "configs/mixtral_tiny.yaml", "--attention-sms", "4", "--no-kernel"), "sequential block"),
    (("bench", "--config", "configs/tiny.yaml", "--random-weights", "--tune", "--tune-rounds", "0"),
     "argument --tune-rounds: 0: expected a positive integer"),
    (("compile", "configs/tiny.yaml", "--residual-in-o-proj", "yes", "--no-kernel"),
     "invalid choice: 'yes' (choose from 'auto', 'on', 'off')"),
])
def test_bad_input_is_one_clear_line(args, needle):
    r = mkc(*args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("config", "batch", "layout"), [
    ("configs/tiny.yaml", 1, "weights in tile order, tagged router logits"),
    ("configs/mixtral_tiny.yaml", 2, "weights in tile order"),  # its 8-row router stored with zero rows
])
def test_compile_names_the_kernel_and_its_weight_layout(config, batch, layout, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    r = mkc("compile", config, "-o", tmp_path, "--batch", batch, "--context", 64, "--num-sms", 8)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("kernel "))
    assert "registers" in line and layout in line, line
    # tagged logits: on up to batch 4 (CodegenOptions.tagged_logits "auto"); at batch 2-4 the
    # expert gate/up tiles warm the O-projection in L2, with evict-first streams (l2_warm and
    # weights_evict_first "auto")
    warm = ", L2 warm-up o_proj:expert_up, evict-first streams" if batch == 2 else ""
    assert line.endswith(", tagged router logits" + warm), line
    code = next(ln for ln in r.stdout.splitlines() if ln.startswith("code "))  # nvdisasm: the cuda extra
    assert "SASS instructions; the largest: " in code, code
    by_op = json.loads((tmp_path / "kernel.json").read_text())["sass_by_op"]
    assert f"{sum(by_op.values()):,} SASS instructions" in code and by_op["LINEAR"] > 0, by_op


# -- a newcomer's mistakes: one line, exit 2, nothing half-written --------------------------------


def _mutations(d: dict) -> dict[str, tuple[object, str]]:
    """A compiled schedule.json broken in the ways a hand edit or a wrong file breaks it, each with
    what the error must name."""
    import copy

    def edit(f):
        e = copy.deepcopy(d)
        f(e)
        return e
    return {
        "array": ([1, 2], "a JSON array"),
        "null": (None, "a JSON null"),
        "no tasks": (edit(lambda e: e.pop("tasks")), "missing key 'tasks'"),
        "unknown op": (edit(lambda e: e["tasks"][0].update(op="NOPE")), "op 'NOPE'"),
        "wait not a list": (edit(lambda e: e["tasks"][1].update(wait=7)), "wrong type"),
        "queue past the tasks": (edit(lambda e: e["queues"][0].append(10**6)), "task 1000000"),
        "counter past the counters": (edit(lambda e: e["tasks"][1].update(signal=10**6)), "counter 1000000"),
        "producer past the tasks": (edit(lambda e: e["counters"][0].update(producers=[-5])), "producer -5"),
        "unknown buffer": (edit(lambda e: e["tasks"][0]["reads"].append(["nope", [[0, 1]]])), "'nope'"),
    }


def test_check_names_what_is_wrong_with_a_malformed_schedule(compiled, tmp_path, capsys):
    out, _ = compiled
    d = json.loads((out / "schedule.json").read_text())
    for name, (doc, needle) in _mutations(d).items():
        bad = tmp_path / f"{name.replace(' ', '_')}.json"
        bad.write_text(json.dumps(doc))
        rc, _, err = run_main(capsys, "check", bad)
        assert_one_line_error(rc, err, "not a valid mkc schedule")
        assert needle in err, (name, err)
    (tmp_path / "text.json").write_text("not json at all")
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe\x00binary")
    for f in ("text.json", "bytes.json"):
        rc, _, err = run_main(capsys, "check", tmp_path / f)
        assert_one_line_error(rc, err, "not a valid mkc schedule")


def test_compile_into_a_file_is_refused_before_any_work(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("mine")
    rc, out, err = run_main(capsys, "compile", "configs/tiny.yaml", "-o", f, "--no-kernel")
    assert_one_line_error(rc, err, f"-o {f}: a file of that name exists")
    assert f.read_text() == "mine" and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failed_compile_leaves_nothing_half_written(tmp_path, monkeypatch, error):
    """A stage failing after planning (here the trace writer) leaves no output folder, no partial
    folder beside it, and no parent folder it created; an existing folder keeps its files as they
    were."""
    from mkc.compiler import compile_to_folder
    from mkc.schedule import visualize

    def broken(*a, **k):
        raise error

    monkeypatch.setattr(visualize, "write_trace", broken)
    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(type(error)):
        compile_to_folder(ROOT / "configs" / "tiny.yaml", out, context=64, num_sms=8, kernel=False)
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "report.md").write_text("an earlier report")
    (kept / "notes.txt").write_text("the user's")
    with pytest.raises(type(error)):
        compile_to_folder(ROOT / "configs" / "tiny.yaml", kept, context=64, num_sms=8, kernel=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert {p.name: p.read_text() for p in kept.iterdir()} == {"report.md": "an earlier report",
                                                                 "notes.txt": "the user's"}
    monkeypatch.undo()
    res = compile_to_folder(ROOT / "configs" / "tiny.yaml", kept, context=64, num_sms=8, kernel=False)
    assert (kept / "notes.txt").read_text() == "the user's"  # the compile's own files replaced, others kept
    assert (kept / "report.md").read_text().startswith("# Schedule report: tiny")
    assert all(p.parent == kept and p.is_file() for p in res.files.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_bare_mkc_prints_help_and_version(capsys):
    rc, out, _ = run_main(capsys)
    assert rc == 0 and "usage: mkc" in out and "compile" in out and "generate" in out
    import mkc

    with pytest.raises(SystemExit) as e:
        run_main(capsys, "--version")
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mkc {mkc.__version__}"


@pytest.mark.parametrize("command,needles", [
    ("check", ["the schedule.json written by mkc compile", "--max-problems MAX_PROBLEMS", "(default 20)"]),
    ("generate", ["tokens to generate (default 16)", "(default cpu)", "(default float32", "--context"]),
    ("compile", [".gguf"]),
])
def test_help_documents_every_argument(capsys, command, needles):
    with pytest.raises(SystemExit) as e:
        run_main(capsys, command, "--help")
    out = capsys.readouterr().out
    assert e.value.code == 0
    for n in needles:
        assert n in " ".join(out.split()), (n, out)


def test_bench_tune_help_is_short(capsys):
    with pytest.raises(SystemExit):
        run_main(capsys, "bench", "--help")
    out = capsys.readouterr().out
    block = out[out.index("--tune "):out.index("--tune-rounds")]
    assert len(block.splitlines()) <= 5, block


@pytest.mark.parametrize("args,needle", [
    (("--max-new-tokens", 100000), "pass --context 131072 to compile for it"),
    (("--max-new-tokens", 100, "--context", 64), "more than --context 64: expected at most 61 new tokens"),
    (("--prompt-ids", "1,2,600"), "600 is outside the vocabulary"),
])
def test_generate_refuses_what_does_not_fit_up_front(capsys, args, needle):
    base = {"--prompt-ids": "1,2,3"}
    argv = ["generate", "--config", "configs/tiny.yaml", "--random-weights"]
    argv += [x for k, v in base.items() if k not in args for x in (k, v)] + list(args)
    rc, out, err = run_main(capsys, *argv)
    assert_one_line_error(rc, err, needle)
    assert out == ""


def test_generate_refuses_past_the_models_positions(tmp_path, capsys):
    """A Hugging Face config's max_position_embeddings bounds the request."""
    cfg = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
           "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_main(capsys, "generate", "--config", tmp_path, "--random-weights", "--prompt-ids", "1,2",
                          "--max-new-tokens", 40)
    assert_one_line_error(rc, err, "the model allows 32 (max_position_embeddings): expected at most 30 new tokens")


@pytest.mark.parametrize("command", ["compile", "check", "import-hf", "generate", "bench", "serve", "bench-serve",
                                     "quantize"])
def test_every_argument_has_help(command):
    import argparse

    from mkc.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [a.option_strings or a.dest for a in sub.choices[command]._actions
               if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not missing, missing
