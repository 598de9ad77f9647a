"""`mkc generate --backend cuda` on a GPU: the same greedy tokens as the CPU executor (tiny model)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generate(backend: str, dtype: str) -> list[int]:
    r = subprocess.run([sys.executable, "-m", "mkc.cli", "generate", "--config", "configs/tiny.yaml", "--random-weights",
                        "--seed", "3", "--prompt-ids", "5,17,99,3,250,41,7,8,9,10,11", "--max-new-tokens", "16",
                        "--backend", backend, "--dtype", dtype, "--json"], check=False, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["tokens"]


@pytest.mark.gpu
def test_generate_cuda_matches_cpu_executor_bf16():
    # both sides round activations to bf16 at the same points; greedy tokens of a random tiny
    # model have wide top-2 margins, so the sequences must agree exactly
    assert _generate("cuda", "bfloat16") == _generate("cpu", "bfloat16")


def test_generate_cuda_without_gpu_is_a_clear_error():
    from mkc.runtime.cuda_backend import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "mkc.cli", "generate", "--config", "configs/tiny.yaml", "--random-weights",
                        "--prompt-ids", "1,2", "--backend", "cuda"], check=False, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "no usable CUDA GPU" in r.stderr and "Traceback" not in r.stderr
