"""Model families beyond Cohere2-MoE, each against transformers as an independent oracle.

For every family a tiny random checkpoint is built with transformers (float32, eager attention),
written with ``save_pretrained`` and read back through ``load_spec`` + ``load_checkpoint`` (the
real importer and loader); the compiled task list, run on the CPU executor, must decode the same
greedy tokens as transformers for several prompts. The families cover every YAML choice that is
not North Mini Code's: sequential blocks with a post-attention norm, NeoX RoPE, all-global and
all-sliding attention, qk-norm, softmax routing with and without top-k renormalisation, dense
layers inside an MoE model, and untied LM heads.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_checkpoint

from mkc.ir.lower import lower
from mkc.ir.spec import load_spec
from mkc.runtime.generate import greedy_generate, greedy_generate_batch
from mkc.runtime.reference import DenseReference
from mkc.runtime.weights import load_checkpoint, random_weights
from mkc.schedule.cpu_ops import route
from mkc.schedule.executor import CpuExecutor
from mkc.schedule.scheduler import schedule

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
NEW_TOKENS = 10
PROMPT_LENGTHS = (4, 13)  # the Mixtral window is 8: the longer prompt decodes past it

# what the tiny checkpoints share: initializer_range 0.1 (0.02 gives flat logits and routing)
_COMMON = {"vocab_size": 512, "hidden_size": 128, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

# family → (transformers class, config class, config kwargs, tiny YAML the checkpoint must import as)
FAMILIES = {
    # Qwen3-MoE: qk-norm, softmax routing renormalised over the top-k, layer 0 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                   "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                   "intermediate_size": 192, "mlp_only_layers": [0], "norm_topk_prob": True, "rope_theta": 1e6,
                   "tie_word_embeddings": False},
                  "qwen3_moe_tiny.yaml"),
    # Llama (SmolLM2, TinyLlama): no qk-norm, untied head, head_dim = hidden / heads
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 256, "rope_theta": 100000.0, "tie_word_embeddings": False,
               "max_position_embeddings": 2048},
              "llama_tiny.yaml"),
    # Qwen3 dense: qk-norm, tied head (as Qwen3-0.6B), q width 2 x hidden
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
               "intermediate_size": 256, "rope_theta": 1e6, "tie_word_embeddings": True},
              "qwen3_tiny.yaml"),
    # Mixtral: softmax routing renormalised, every layer sliding (window 8)
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": 8,
                 "rope_theta": 1e6, "tie_word_embeddings": False},
                "mixtral_tiny.yaml"),
}


def build_checkpoint(family: str, folder: Path, **overrides) -> Path:
    """A tiny random transformers checkpoint of ``family`` saved into ``folder``."""
    cls, cfg_cls, kw, _ = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**_COMMON, **kw, **overrides})
    torch.manual_seed(2026)
    save_checkpoint(getattr(transformers, cls)(cfg), folder)
    return folder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint folder, transformers model, spec, float32 weights) per family."""
    name = request.param
    folder = build_checkpoint(name, tmp_path_factory.mktemp(name))
    model = getattr(transformers, FAMILIES[name][0]).from_pretrained(folder, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    spec = load_spec(folder)
    return name, folder, model, spec, load_checkpoint(folder, spec, torch.float32)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the whole sequence re-run each step (no KV cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_checkpoint_imports_as_the_tiny_yaml(family):
    name, _, _, spec, _ = family
    tiny = load_spec(CONFIGS / FAMILIES[name][3])
    assert dataclasses.replace(spec, name=tiny.name) == tiny


def test_greedy_tokens_match_transformers(family):
    name, _, model, spec, weights = family
    for i, prompt in enumerate(_prompts(spec.vocab_size)):
        want = hf_greedy(model, prompt, NEW_TOKENS)
        got = greedy_generate(spec, weights, prompt, NEW_TOKENS, dtype=torch.float32, seed=i)
        assert got == want, f"{name}, prompt of {len(prompt)} tokens: mkc {got} vs transformers {want}"
        assert len(set(want)) > 1, "degenerate oracle: the model repeats one token"


def test_batched_greedy_matches_transformers(family):
    name, _, model, spec, weights = family
    prompts = _prompts(spec.vocab_size)
    want = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert greedy_generate_batch(spec, weights, prompts, NEW_TOKENS, seed=3) == want, name


def test_prompt_logits_match_transformers(family):
    """Every position's logits, token-by-token decode (executor and dense reference) vs
    transformers' full forward."""
    name, _, model, spec, weights = family
    prompt = _prompts(spec.vocab_size)[1]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
    ex = CpuExecutor(schedule(lower(spec, 1, 64, 8), spec.name), spec, weights)
    ref = DenseReference(spec, weights)
    got = torch.stack([ex.step([t], [i], seed=i)[0][0] for i, t in enumerate(prompt)])
    dense = torch.cat([ref.step([t], [i]) for i, t in enumerate(prompt)])
    budget = 1e-4  # float32 everywhere, different summation orders (see test_executor.py)
    for what, x in (("executor", got), ("reference", dense)):
        err = (x - want).abs().max().item()
        assert err <= budget, f"{name} {what}: max logit error {err:.3g} > {budget} (max |logit| " \
                              f"{want.abs().max().item():.3g})"


def test_unnormalised_softmax_routing(tmp_path):
    """Qwen3-MoE's default norm_topk_prob: false (weights are softmax probabilities that do not
    sum to 1): the spec says so, and the executor decodes what transformers decodes."""
    folder = build_checkpoint("qwen3_moe", tmp_path / "ck", norm_topk_prob=False)
    spec = load_spec(folder)
    assert spec.moe.scoring == "softmax" and not spec.moe.normalize_top_k
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    prompt = _prompts(spec.vocab_size)[1]
    weights = load_checkpoint(folder, spec, torch.float32)
    assert greedy_generate(spec, weights, prompt, NEW_TOKENS, seed=1) == hf_greedy(model, prompt, NEW_TOKENS)


def test_route_semantics():
    logits = torch.tensor([[2.0, 0.5, 2.0, -1.0, 1.0]])
    idx, w = route(logits, 2, "softmax", normalize=False)
    probs = torch.softmax(logits, -1)
    assert idx.tolist() == [[0, 2]], "ties go to the lowest index, in index order"
    assert torch.allclose(w, probs[:, [0, 2]])
    idx, w = route(logits, 3, "softmax", normalize=True)
    assert idx.tolist() == [[0, 2, 4]] and torch.allclose(w, torch.softmax(logits[:, [0, 2, 4]], -1))
    idx, w = route(logits, 2, "sigmoid", normalize=False)
    assert idx.tolist() == [[0, 2]] and torch.allclose(w, torch.sigmoid(torch.tensor([[2.0, 2.0]])))


def test_qk_norm_bf16_executor_close_to_float32():
    """qk-norm in the bf16 executor (q/k rounded as transformers' Qwen3RMSNorm rounds them)
    stays close to the float32 run: 3 dense layers, no routing to flip."""
    spec = load_spec(CONFIGS / "qwen3_tiny.yaml")
    w = random_weights(spec, 3, torch.bfloat16, std=0.1)
    sc = schedule(lower(spec, 2, 64, 8), spec.name)
    f32, b16 = CpuExecutor(sc, spec, w), CpuExecutor(sc, spec, w, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for s in range(6):
        tokens = torch.randint(0, spec.vocab_size, (2,), generator=g)
        a, b = f32.step(tokens, [s, s], seed=s)[0], b16.step(tokens, [s, s], seed=s)[0]
        err, scale = (a - b).abs().max().item(), a.abs().max().item()
        # bf16 stores (2^-9 relative each) compounding over 3 layers: ~1% in practice
        assert err <= 0.03 * scale, f"step {s}: max error {err:.3g} > 3% of max |logit| {scale:.3g}"


@pytest.mark.parametrize("config", ["qwen3_moe_tiny.yaml", "llama_tiny.yaml", "qwen3_tiny.yaml", "mixtral_tiny.yaml"])
def test_cli_compiles_the_tiny_yaml(config, tmp_path, capsys):
    """``mkc compile`` in-process (the subprocess path is test_cli_compiles_a_checkpoint_folder)."""
    from mkc.cli import main

    assert main(["compile", str(CONFIGS / config), "-o", str(tmp_path / "o"), "--no-kernel", "--num-sms", "8",
                 "--context", "64", "--batch", "2"]) == 0
    assert "predicted step" in capsys.readouterr().out
    assert (tmp_path / "o" / "schedule.json").stat().st_size > 0


def test_cli_compiles_a_checkpoint_folder(tmp_path):
    folder = build_checkpoint("qwen3_moe", tmp_path / "ck")
    r = subprocess.run([sys.executable, "-m", "mkc.cli", "compile", str(folder), "-o", str(tmp_path / "o"),
                        "--no-kernel", "--num-sms", "8", "--context", "64", "--batch", "2"],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    assert "predicted step" in r.stdout


# ----------------------------------------------------------------------------------------------
# importers and full-size configs

# published parameter counts (model cards), to 3 significant digits
FULL_SIZE = {"smollm2_135m.yaml": 0.1345e9, "qwen3_0_6b.yaml": 0.596e9, "qwen3_30b_a3b.yaml": 30.5e9,
             "mixtral_8x7b.yaml": 46.7e9, "tinyllama_1_1b.yaml": 1.10e9}


@pytest.mark.parametrize("config,params", FULL_SIZE.items())
def test_full_size_configs_have_the_published_parameter_count(config, params):
    from math import prod

    from mkc.runtime.weights import weight_shapes

    total = sum(prod(s) for s in weight_shapes(load_spec(CONFIGS / config)).values())
    assert total == pytest.approx(params, rel=0.005), f"{config}: {total / 1e9:.4f}B parameters"


def _llama_cfg(**kw):
    return {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048, "rope_theta": 10000.0, "hidden_act": "silu", **kw}


@pytest.mark.parametrize("cfg,needle", [
    (_llama_cfg(rope_scaling={"rope_type": "llama3", "factor": 32.0}), "llama3"),  # Llama 3.1/3.2
    (_llama_cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "yarn"),
    (_llama_cfg(attention_bias=True), "attention_bias"),
    (_llama_cfg(mlp_bias=True), "mlp_bias"),
    (_llama_cfg(hidden_act="gelu"), "hidden_act"),
    (_llama_cfg(model_type="qwen3", head_dim=32, use_sliding_window=True), "use_sliding_window"),
    (_llama_cfg(model_type="qwen3", head_dim=32, layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (_llama_cfg(model_type="olmoe"), "model_type"),  # qk-norm over all heads at once: not expressible
])
def test_importer_refuses_what_it_cannot_express(cfg, needle):
    from mkc.ir.hf import spec_from_hf_config
    from mkc.ir.spec import SpecError

    with pytest.raises(SpecError, match=needle):
        spec_from_hf_config(cfg)


def test_importer_legacy_keys_and_mixtral_without_window():
    from mkc.ir.hf import spec_from_hf_config

    s = spec_from_hf_config(_llama_cfg(rope_scaling=None, tie_word_embeddings=True))  # a pre-5.x config.json
    assert s.tie_word_embeddings and s.attention.rope_theta == 10000.0 and s.attention.head_dim == 32
    assert s.block == "sequential" and s.moe is None and all(x == s.layers[0] for x in s.layers)
    m = spec_from_hf_config({**_llama_cfg(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
                             "sliding_window": None})
    assert {x.attention for x in m.layers} == {"global"} and m.moe.normalize_top_k and m.moe.scoring == "softmax"


@pytest.mark.parametrize("config", ["qwen3_moe_tiny.yaml", "mixtral_tiny.yaml"])
def test_torch_baseline_matches_dense_reference(config):
    """The PyTorch baseline decode step (bench baseline) on qk-norm, softmax routing and
    all-sliding layers, against the dense reference."""
    from mkc.runtime.torch_decode import TorchDecoder

    spec = load_spec(CONFIGS / config)
    w = random_weights(spec, 0, torch.float32, std=0.1)
    ref, dec = DenseReference(spec, w), TorchDecoder(spec, w, batch=2, context=32, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for pos in range(12):
        tokens = torch.randint(0, spec.vocab_size, (2,), generator=g)
        positions = torch.tensor([pos, max(0, pos - 3)])
        a, b = ref.step(tokens, positions), dec.step(tokens, positions)
        err = (a - b).abs().max().item()
        assert err < 1e-4, f"step {pos}: max error {err:.3g} > budget 1e-4 (float32 both sides)"


@pytest.mark.parametrize("config", ["qwen3_moe_tiny.yaml", "mixtral_tiny.yaml", "llama_tiny.yaml"])
def test_executor_matches_dense_reference_batch3(config):
    """Batch 3 with positions differing per sequence (one rewrites position 0 at first), random
    interleavings, poisoned scratch buffers and weights: the executor computes what the dense
    reference computes (qk-norm weights read only where declared, softmax routing shared by the
    batch's distinct-expert slots)."""
    spec = load_spec(CONFIGS / config)
    w = random_weights(spec, 1, torch.float32, std=0.1)
    ex = CpuExecutor(schedule(lower(spec, 3, 64, 8), spec.name), spec, w)
    ref = DenseReference(spec, w)
    g = torch.Generator().manual_seed(2)
    for step in range(12):
        tokens = torch.randint(0, spec.vocab_size, (3,), generator=g)
        pos = [max(0, step - 2 * b) for b in range(3)]
        got, want = ex.step(tokens, pos, seed=step)[0], ref.step(tokens, pos)
        err = (got - want).abs().max().item()
        # float32 both sides, the same math summed in another order: tests/test_executor.py's budget
        assert err <= 5e-5 + 5e-5 * want.abs().max().item(), f"step {step} positions {pos}: max error {err:.3g}"


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_token_by_token_decode(normalize, dtype):
    """The serving prefill (one batched forward) on qk-norm and softmax routing, with and without
    top-k renormalisation: the KV cache and last logits token-by-token decoding produces."""
    from mkc.runtime.prefill import Prefill

    spec = load_spec(CONFIGS / "qwen3_moe_tiny.yaml")
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, normalize_top_k=normalize))
    w = random_weights(spec, 2, torch.float32, std=0.1)
    ids = [(i * 37 + 11) % spec.vocab_size for i in range(13)]
    ex = CpuExecutor(schedule(lower(spec, 1, 64, 8), spec.name), spec, w, dtype=dtype)
    for p, t in enumerate(ids):
        want = ex.step([t], [p], seed=p)[0][0]
    a = spec.attention
    kv = [(torch.zeros(a.num_kv_heads, 64, a.head_dim, dtype=dtype), torch.zeros(a.num_kv_heads, 64, a.head_dim,
                                                                                  dtype=dtype)) for _ in spec.layers]
    got = Prefill(spec, w, act_dtype=dtype).run(ids, 0, kv)
    # float32: rounding of different summation orders (~1e-6). bf16: every stored activation is
    # rounded (2^-8 relative), in a different order on each side, compounding over 3 layers to
    # ~2% of the largest value with these std-0.1 weights (tiny.yaml shows the same): budget 5%
    rel = 1e-5 if dtype == torch.float32 else 5e-2
    for layer, (k, v) in enumerate(kv):
        kc, vc = ex.kv_cache(layer)
        for name, mine, theirs in (("k", k, kc), ("v", v, vc)):
            ref = theirs[0, :, :len(ids)].float()
            err = (mine[:, :len(ids)].float() - ref).abs().max().item()
            assert err <= rel * ref.abs().max().item(), f"layer {layer} {name} cache: max error {err:.2e}"
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"last logits: max error {err:.2e}"
