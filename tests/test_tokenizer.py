"""The byte-level tokenizer of the random-weights demo: every id shows as visible text."""

import random

from mkc.runtime.tokenizer import ByteTokenizer, IncrementalDetokenizer

V = 512


def shown(text: str) -> bool:
    """Text a terminal or a JSON stream shows as characters: no escapes, no replacement character."""
    return all(c.isprintable() or c in "\t\n\r" for c in text) and "\ufffd" not in text


def test_every_id_but_eos_decodes_to_a_visible_character():
    tok = ByteTokenizer(V)
    for i in range(V):
        text = tok.decode([i], final=True)
        if i in tok.eos_ids:
            assert text == ""
        else:
            assert text and shown(text), (i, text)


def test_random_ids_stream_as_visible_text_and_the_stream_matches_the_whole():
    tok = ByteTokenizer(V)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(V) for _ in range(rng.randrange(1, 40))]
        ids = [i for i in ids if i not in tok.eos_ids]
        d = IncrementalDetokenizer(tok)
        deltas = [d.push(i) for i in ids] + [d.flush()]
        whole = tok.decode(ids, final=True)
        assert "".join(deltas) == whole and shown(whole), (ids, deltas)
        assert len(whole) >= sum(1 for i in ids if i > 256)  # an id above the bytes is never dropped


def test_text_round_trips_unchanged():
    tok = ByteTokenizer(V)
    text = "héllo €uro 😀!\n\tline two\r\n"
    assert tok.decode(tok.encode(text), final=True) == text
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push(t) for t in tok.encode(text)) + d.flush() == text


def test_incomplete_character_waits_until_the_sequence_ends():
    tok = ByteTokenizer(V)
    euro = "€".encode()
    assert tok.decode(list(euro[:2])).endswith("\ufffd")  # more ids may complete it
    assert shown(tok.decode(list(euro[:2]), final=True))  # the sequence ended: its bytes, shown
    assert tok.decode([*euro[:2], 300, *euro]) == tok.decode(list(euro[:2]), final=True) + tok.decode([300]) + "€"


def test_the_readme_demo_shows_text():
    """The README's serve example: tiny, random weights (seed 0), prompt "Hello", 8 tokens."""
    import torch
    from conftest import ROOT

    from mkc.ir.spec import load_spec
    from mkc.runtime.generate import greedy_generate
    from mkc.runtime.weights import random_weights

    spec = load_spec(ROOT / "configs" / "tiny.yaml")
    tok = ByteTokenizer(spec.vocab_size)
    ids = greedy_generate(spec, random_weights(spec, 0, torch.float32), tok.encode("Hello"), 8, backend="reference")
    ids = ids[:ids.index(256)] if 256 in ids else ids
    text = tok.decode(ids, final=True)
    assert len(text) >= len(ids) and shown(text), (ids, text)
