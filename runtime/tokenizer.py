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
    """ids 0..255 are the UTF-8 bytes, id 256 is EOS; the fallback when there are no tokenizer
    files, as in the random-weights demo.

    Every id decodes to visible text, so a demo's output shows that the model runs: valid UTF-8
    decodes as itself; an id above 256 and a byte that is not valid UTF-8 where it stands each
    decode as one printable ASCII character (``visible``), and a character Python does not call
    printable (control, format, unassigned; tab, newline and carriage return stay) as those of its
    bytes, stable as text grows. An incomplete UTF-8 character at the end
    decodes as U+FFFD, which tells the detokenizer to wait for more ids.
    """

    name = "bytes"
    EOS = 256

    def __init__(self, vocab_size: int):
        if vocab_size < 257:
            raise ValueError(f"vocab_size = {vocab_size}: the byte-level tokenizer needs at least 257 "
                             f"ids (256 bytes + EOS); pass a checkpoint with tokenizer files")
        self.eos_ids = (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], final: bool = False) -> str:
        """The text of ``ids``; ``final``: the sequence has ended, so an incomplete character at
        the end shows as its bytes' ``visible`` characters rather than U+FFFD."""
        parts: list[str] = []
        run = bytearray()  # consecutive byte ids, decoded together (a character spans several)
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                parts.append(_decode_bytes(bytes(run), final=True))
                run.clear()
            if i != self.EOS:
                parts.append(visible(i))
        if run:
            parts.append(_decode_bytes(bytes(run), final=final))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return plain_chat_template(messages, tools)


_PRINTABLE = 95  # the printable ASCII characters, space (32) to tilde (126)


def visible(i: int) -> str:
    """The printable ASCII character that ByteTokenizer shows for an id or byte it cannot show as
    text."""
    return chr(32 + i % _PRINTABLE)


def _visible_errors(e: UnicodeDecodeError) -> tuple[str, int]:
    """A codecs error handler: each byte that is not valid UTF-8 becomes ``visible(byte)``."""
    return "".join(visible(b) for b in e.object[e.start:e.end]), e.end


codecs.register_error("mkc.visible", _visible_errors)
def _decode_bytes(data: bytes, final: bool) -> str:
    """UTF-8 with every invalid byte and unprintable character shown as ``visible``; when not final,
    an incomplete character at the end decodes as U+FFFD."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="mkc.visible")
    text = "".join(map(_shown, dec.decode(data, final=final)))
    return text + "\ufffd" if not final and dec.getstate()[0] else text


def _shown(c: str) -> str:
    """A decoded character as ByteTokenizer shows it: itself where printable (tab, newline and
    carriage return too), else the ``visible`` characters of its bytes (control, format,
    unassigned, and U+FFFD itself, which marks an incomplete character)."""
    if (c.isprintable() and c != "\ufffd") or c in "\t\n\r":
        return c
    return "".join(visible(b) for b in c.encode("utf-8"))


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
        if isinstance(self.tok, ByteTokenizer):  # the sequence ended: no character is still incomplete
            text = self.tok.decode(self.ids[self.prefix_offset:], final=True)
        else:
            text = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
