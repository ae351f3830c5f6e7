"""The server's incremental detokenizer: the same text as decoding prompt and answer
together, whole characters only, stop strings cut, and a cost per token that does not grow
with the text."""

import random

import pytest

from medusa_jax.runtime import assets
from medusa_jax.serving.server import Detokenizer
from medusa_jax.text.tokenizer import load_hf_tokenizer, load_tokenizer


@pytest.fixture(scope="module", params=["embedded", "transformers"])
def tok(request):
    path = assets.model_dir()
    return load_tokenizer(path) if request.param == "embedded" else load_hf_tokenizer(path)


def whole(tok, prompt, ids) -> str:
    """What the answer decodes to inside the whole text (prompt and answer together)."""
    dec = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    full, head = dec(prompt + ids), dec(prompt)
    return full[len(head):] if full.startswith(head) else dec(ids)


def stream(d: Detokenizer, ids) -> tuple[str, bool]:
    out, stopped = "", False
    for t in ids:
        delta, stopped = d.add(t)
        out += delta
        if stopped:
            return out, True
    return out + d.flush(), False


def test_the_text_equals_the_whole_decode_on_stories(tok):
    text = " ".join(assets.heldout_prompts()[:6]) + " café ☃ naïve — “quoted” 你好"
    ids = tok.encode(text)
    for cut in (1, 3, 10):
        prompt, answer = ids[:cut], ids[cut:]
        assert stream(Detokenizer(tok, prompt, []), answer) == (whole(tok, prompt, answer),
                                                                False)


def test_random_text_gives_the_whole_decode(tok):
    """Random strings of many scripts (spelled with byte tokens where the vocabulary has no
    piece), cut at a random token where the prompt is whole text (as a prompt the server
    tokenized from text is): the concatenated pieces equal the whole decode, and no piece
    holds a half character."""
    rng = random.Random(0)
    alphabet = "abc XYZ 019 .,!?'\n éüß ñ ΩπΣ жЯ ☃★ 你好世界 こんにちは 🙂🚀 \u0301"
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tok.encode("Once " + text)
        cuts = [c for c in range(1, len(ids))
                if not tok.decode(ids[:c], skip_special_tokens=True).endswith("\ufffd")]
        cut = rng.choice(cuts)
        prompt, answer = ids[:cut], ids[cut:]
        d = Detokenizer(tok, prompt, [])
        pieces = [d.add(t)[0] for t in answer] + [d.flush()]
        assert "".join(pieces) == whole(tok, prompt, answer)
        assert not any(p.endswith("\ufffd") for p in pieces)


def test_stop_strings_cut_the_text_where_the_whole_text_has_them(tok):
    ids = tok.encode("Once upon a time, there was a little girl named Lily. She liked cats.")
    prompt, answer = ids[:3], ids[3:]
    full = whole(tok, prompt, answer)
    for stop in ("Lily", "l", "cats.", "girl named", "zzz"):
        out, stopped = stream(Detokenizer(tok, prompt, [stop]), answer)
        assert out == full.split(stop)[0] and stopped == (stop in full)


class Counting:
    """A real tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_a_token_costs_the_same_however_long_the_text(tok):
    ids = tok.encode(" ".join(assets.heldout_prompts()[:20]))[:400]
    counting = Counting(tok)
    d = Detokenizer(counting, ids[:5], [])
    for t in ids[5:]:
        d.add(t)
    assert counting.decoded < 12 * len(ids)  # a whole decode per token: ~len(ids)**2 / 2
