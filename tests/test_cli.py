"""The mkc command line as a user runs it: compile, check, import-hf, bad input."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT


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
    assert manifest["options"] == {"batch": 2, "context": 64, "num_sms": 8}


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
    ("configs/mixtral_tiny.yaml", 2, "weights row-major (weight L0.w_router (8, 128)"),  # an 8-row router
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
