"""User text as token ids, one rule for every caller (`Medusa.encode`, `infer.generate`, the
server): text is text, so a "</s>" typed in a prompt is those four characters, never the
EOS id; control tokens come only from the tokenizer's own additions (BOS) and from a chat
template's own text (`TextEncoder.template`). A caller that means a control token gives its
id (prompts as token ids)."""

from __future__ import annotations

import re


class TextEncoder:
    """User text -> token ids with no special tokens parsed ("</s>" is four characters),
    from a copy of the tokenizer's `tokenizers` backend (`encode_special_tokens`); chat
    templates' own text is split at the control tokens it holds (`template`).

    `max_token_chars` bounds the characters one token covers (the longest vocabulary
    entry), so a text longer than `max_token_chars * n` cannot fit in n tokens: the length
    check that runs before tokenizing."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        backend = _backend(tokenizer)
        self.plain = None
        self.specials: dict[str, object] = {}
        if backend is not None:
            from tokenizers import Tokenizer

            self.plain = Tokenizer.from_str(backend.to_str())
            self.plain.encode_special_tokens = True  # text is text
            self.specials = {t.content: (i, t) for i, t in
                             backend.get_added_tokens_decoder().items()}
            vocab = backend.get_vocab(with_added_tokens=False)
            self.max_token_chars = max((len(p) for p in vocab), default=1)
        else:  # a tokenizer without a `tokenizers` backend
            self.specials = {t: (i, None) for t, i in
                             getattr(tokenizer, "get_added_vocab", dict)().items()}
            self.max_token_chars = max((len(p) for p in tokenizer.get_vocab()), default=1)
        self._special_re = re.compile("|".join(
            re.escape(t) for t in sorted(self.specials, key=len, reverse=True))) \
            if self.specials else None

    def prompt(self, text: str) -> list[int]:
        """A completion prompt: the tokenizer's own additions (BOS) and the text as text."""
        if self.plain is not None:
            return list(self.plain.encode(text, add_special_tokens=True).ids)
        return list(self.tok(text, split_special_tokens=True)["input_ids"])

    def text(self, text: str) -> list[int]:
        """Text alone (no BOS), as text."""
        if not text:
            return []
        if self.plain is not None:
            return list(self.plain.encode(text, add_special_tokens=False).ids)
        return list(self.tok(text, add_special_tokens=False,
                             split_special_tokens=True)["input_ids"])

    def template(self, parts: list[tuple[str, bool]]) -> list[int]:
        """A rendered chat template as (text, is_template) parts: control tokens are found
        in the template's parts only; the text between them (template text and user text
        alike) is tokenized in one piece, as the tokenizer splits a text at its control
        tokens."""
        ids, buf = [], ""
        for text, is_template in parts:
            if not is_template or self._special_re is None:
                buf += text
                continue
            pos = 0
            for m in self._special_re.finditer(text):
                i, tok = self.specials[m.group()]
                before = text[pos:m.start()]
                buf += before.rstrip() if getattr(tok, "lstrip", False) else before
                ids += self.text(buf)
                buf = ""
                ids.append(int(i))
                pos = m.end()
                if getattr(tok, "rstrip", False):
                    while pos < len(text) and text[pos].isspace():
                        pos += 1
            buf += text[pos:]
        return ids + self.text(buf)


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer`, or None."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    for name in ("_tokenizer", "backend_tokenizer"):
        inner = tokenizer.__dict__.get(name) if name == "_tokenizer" else \
            getattr(tokenizer, name, None)
        if isinstance(inner, Tokenizer):
            return inner
    return None
