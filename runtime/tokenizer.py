"""Tokenizers for the server: the checkpoint's own (transformers, local files only) or a byte-level
fallback so the random-weights demo needs nothing downloaded.

Both expose the same small surface: ``encode``, ``decode``, ``eos_ids``, ``apply_chat_template``.
``IncrementalDetokenizer`` turns a growing list of ids into text deltas that never split a UTF-8
character and never change text already handed out.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class Tokenizer(Protocol):
    name: str  # shown in logs
    eos_ids: tuple[int, ...]  # ids that end a sequence

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str: ...


def plain_chat_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The template used when the checkpoint has none: one ``<|role|>`` header per message.

    Tools are listed in a system block with the JSON tool-call format ``runtime/tool_calls.py``
    parses back.
    """
    parts = []
    if tools:
        parts.append('<|tools|>\nTo call a tool, reply {"name": ..., "arguments": {...}}\n'
                     + "\n".join(json.dumps(t.get("function", t), separators=(",", ":")) for t in tools) + "\n")
    for m in messages:
        parts.append(f"<|{m['role']}|>\n{message_text(m)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def message_text(m: dict[str, Any]) -> str:
    """The text of a chat message whose content is a string, a list of text parts, or null."""
    c = m.get("content")
    if c is None:
        calls = m.get("tool_calls") or []
        return "\n".join(json.dumps({"name": t["function"]["name"], "arguments": t["function"]["arguments"]})
                         for t in calls)
    if isinstance(c, str):
        return c
    return "".join(p.get("text", "") for p in c if isinstance(p, dict))


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes, id 256 is EOS; ids above 256 decode to nothing.

    Invalid bytes decode as ``\\xNN`` (readable, stable as text grows); an incomplete UTF-8
    character at the end decodes as U+FFFD, which tells the detokenizer to wait for more bytes.
    """

    name = "bytes"

    def __init__(self, vocab_size: int):
        if vocab_size < 257:
            raise ValueError(f"vocab_size = {vocab_size}: the byte-level tokenizer needs at least 257 "
                             f"ids (256 bytes + EOS); pass a checkpoint with tokenizer files")
        self.eos_ids = (256,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        dec = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
        text = dec.decode(bytes(i for i in ids if 0 <= i < 256), final=False)
        return text + "\ufffd" if dec.getstate()[0] else text

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return plain_chat_template(messages, tools)


class HFTokenizer:
    """The checkpoint's tokenizer through transformers, loaded from local files only."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.name = f"hf:{folder.name}"
        eos: list[int] = []
        if self.tok.eos_token_id is not None:
            eos.append(int(self.tok.eos_token_id))
        gen = folder / "generation_config.json"
        if gen.is_file():
            e = json.loads(gen.read_text()).get("eos_token_id")
            for x in (e if isinstance(e, list) else [e] if e is not None else []):
                if int(x) not in eos:
                    eos.append(int(x))
        self.eos_ids = tuple(eos)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        if not getattr(self.tok, "chat_template", None):
            return plain_chat_template(messages, tools)
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=False)

    def encode_chat(self, text: str) -> list[int]:
        # the rendered template already holds BOS and the other special tokens
        return list(self.tok.encode(text, add_special_tokens=False))


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer when its folder has tokenizer files, else the byte fallback."""
    if checkpoint is not None:
        folder = Path(checkpoint)
        if any((folder / f).is_file() for f in TOKENIZER_FILES):
            return HFTokenizer(folder)
    return ByteTokenizer(vocab_size)


def encode_chat(tok: Tokenizer, text: str) -> list[int]:
    """Encode a rendered chat prompt without adding special tokens twice."""
    f = getattr(tok, "encode_chat", None)
    return f(text) if f is not None else tok.encode(text)


class IncrementalDetokenizer:
    """Text deltas for a growing id list (the prefix/read offset method).

    A delta is released only when the decoded text does not end in U+FFFD, i.e. when no UTF-8
    character is still incomplete; ``flush`` releases the rest at the end of the sequence.
    """

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
