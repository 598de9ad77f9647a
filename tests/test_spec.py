"""ModelSpec: the YAML schema, the Hugging Face import, and one-line errors for bad files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mkc.ir.hf import spec_from_hf_config
from mkc.ir.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[1]
NMC = ROOT / "configs" / "north_mini_code.yaml"
# North Mini Code's config.json as in shared/reference (copied, so the test never depends on shared/)
REFERENCE = ROOT / "tests" / "data" / "north_mini_code.config.json"


def test_north_mini_code_architecture():
    s = load_spec(NMC)
    assert (s.num_layers, s.hidden_size, s.vocab_size) == (49, 2048, 262144)
    globals_ = [i for i, x in enumerate(s.layers) if x.attention == "global"]
    assert globals_ == list(range(0, 49, 4))  # 13 full-attention layers
    assert [i for i, x in enumerate(s.layers) if x.rope] == [i for i in range(49) if i == 0 or i % 4]
    assert [x.mlp for x in s.layers] == ["dense"] + ["moe"] * 48
    assert s.moe.num_experts == 128 and s.moe.top_k == 8 and s.moe.scoring == "sigmoid"
    assert s.attention.num_kv_heads == 4 and s.q_width == 2 * s.hidden_size


def test_hf_import_matches_yaml():
    hf = spec_from_hf_config(json.loads(REFERENCE.read_text()), name="north_mini_code")
    assert hf == load_spec(NMC)


def test_yaml_round_trip(tmp_path):
    s = load_spec(NMC)
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(s.to_yaml_dict(), sort_keys=False))
    assert load_spec(p) == s


def _bad(tmp_path, mutate):
    d = yaml.safe_load(NMC.read_text())
    mutate(d)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(SpecError) as e:
        load_spec(p)
    return str(e.value)


def test_unknown_key(tmp_path):
    msg = _bad(tmp_path, lambda d: d["attention"].update(num_haeds=32))
    assert "attention.num_haeds" in msg and "unknown key" in msg


def test_misspelt_key_is_named_not_reported_missing(tmp_path):
    """A key typed wrong is named with the key it resembles, not reported as the right one missing."""
    msg = _bad(tmp_path, lambda d: d["attention"].update(num_kv_head=d["attention"].pop("num_kv_heads")))
    assert "unknown key 'attention.num_kv_head': did you mean 'num_kv_heads'?" in msg, msg
    assert "missing" not in msg, msg
    msg = _bad(tmp_path, lambda d: d["layers"]["pattern"][0].update(mpl=d["layers"]["pattern"][0].pop("mlp")))
    assert "unknown key 'layers.pattern[0].mpl': did you mean 'mlp'?" in msg, msg


def test_wrong_type(tmp_path):
    msg = _bad(tmp_path, lambda d: d.update(hidden_size="big"))
    assert "hidden_size" in msg and "'big'" in msg and "integer" in msg


def test_bool_is_not_int(tmp_path):
    assert "num_layers" in _bad(tmp_path, lambda d: d.update(num_layers=True))


def test_missing_key(tmp_path):
    assert "missing key 'moe.top_k'" in _bad(tmp_path, lambda d: d["moe"].pop("top_k"))


def test_impossible_gqa(tmp_path):
    msg = _bad(tmp_path, lambda d: d["attention"].update(num_kv_heads=5))
    assert "num_kv_heads" in msg and "multiple" in msg


def test_top_k_above_experts(tmp_path):
    assert "moe.top_k" in _bad(tmp_path, lambda d: d["moe"].update(top_k=200))


def test_bad_choice(tmp_path):
    msg = _bad(tmp_path, lambda d: d["layers"]["pattern"][0].update(attention="local"))
    assert "layers.pattern[0].attention" in msg and "global" in msg


def test_override_out_of_range(tmp_path):
    assert "layers.overrides" in _bad(tmp_path, lambda d: d["layers"]["overrides"].update({99: d["layers"]["pattern"][0]}))


def test_not_yaml_and_missing_file(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(p)
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(tmp_path / "list.yaml")


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.update(hidden_size=-4), "hidden_size"),
    (lambda d: d["attention"].update(head_dim=33), "head_dim"),
])
def test_cli_reports_one_line(tmp_path, mutate, needle):
    d = yaml.safe_load(NMC.read_text())
    mutate(d)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    r = subprocess.run([sys.executable, "-m", "mkc.cli", "compile", str(p), "-o", str(tmp_path / "o"), "--no-kernel"],
                       check=False, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
