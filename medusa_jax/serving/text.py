"""The server's text: prompts from chat messages (the tokenizer's chat template, or Vicuna's
format) and incremental decoding of new tokens (`Detokenizer`)."""

from __future__ import annotations

import json
import re

from medusa_jax.serving.errors import APIError
from medusa_jax.text.encoder import TextEncoder
from medusa_jax.text.templates import vicuna_pieces


class Detokenizer:
    """Incremental text of new tokens after a prompt: `add(token)` -> (new text, stopped).

    Each token decodes a short window, not the whole text (prefix and read offsets, as vLLM
    and TGI do): the tokens since the last point where the text was whole, after a few
    tokens of context, so that a tokenizer that drops a word's leading space at the start of
    a decode (SentencePiece) decodes every new token as it would inside the whole text. A
    window that ends inside a UTF-8 character waits for the next token."""

    CONTEXT = 5  # prompt tokens decoded before the first new one

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.ids = list(prompt_ids[-self.CONTEXT:])  # context, then the new tokens
        self.prefix = 0  # the window's start in `ids`
        self.read = len(self.ids)  # `ids[:read]` are in `text` (the context as nothing)
        self.prefix_text = self._dec(self.ids)  # what the window's start decodes to
        self.sent = 0  # characters of the text already handed out
        self.text = ""
        self.longest_stop = max((len(s) for s in stops), default=0)

    def _dec(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def _extend(self, whole_only: bool) -> None:
        """Append the window's new text; move the window on when it ends on a whole text."""
        window = self._dec(self.ids[self.prefix:])
        if len(window) <= len(self.prefix_text) or (whole_only and window.endswith("\ufffd")):
            return
        self.text += window[len(self.prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self._dec(self.ids[self.prefix:self.read])

    def _stop_at(self) -> int | None:
        start = max(0, self.sent - self.longest_stop)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def add(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        self._extend(whole_only=True)
        cut = self._stop_at()
        if cut is not None:  # the text ends before the stop string
            self.text = self.text[:cut]
            return self._take(cut), True
        safe, hold = len(self.text), 0
        for s in self.stops:  # a tail that may still grow into a stop string
            for k in range(min(len(s) - 1, safe), hold, -1):
                if self.text[safe - k:safe] == s[:k]:
                    hold = k
                    break
        return self._take(safe - hold), False

    def flush(self) -> str:
        """The rest of the text (an unfinished character too), up to a stop string."""
        self._extend(whole_only=False)
        cut = self._stop_at()
        if cut is not None:
            self.text = self.text[:cut]
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's chat template, if any. The embedded model's tokenizer
    (`startup.EmbeddedTokenizer`) is asked through its tokenizer_config.json: asking the
    object would load transformers (a second of start-up) to say it has none."""
    if tokenizer is None:
        return None
    from medusa_jax.text.tokenizer import EmbeddedTokenizer

    if isinstance(tokenizer, EmbeddedTokenizer):
        try:
            config = json.loads((tokenizer.path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        if not (isinstance(config, dict) and config.get("chat_template")) and \
                not (tokenizer.path / "chat_template.jinja").is_file():
            return None
    return getattr(tokenizer, "chat_template", None)


def vicuna_prompt(messages: list[tuple[str, str]], tokenizer,
                  encoder: TextEncoder | None = None) -> list[int]:
    """Token ids of a conversation in the Vicuna template, as training renders it
    (`data`), ending with "ASSISTANT:" for the answer to come. The template has no control
    tokens but BOS and the EOS after each answer; the text is tokenized as text."""
    enc = (encoder or TextEncoder(tokenizer)).text
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text, answer in vicuna_pieces(messages):
        ids += enc(text) + (eos if answer else [])
    return ids


_MARK = re.compile("\ue000(\\d+)\ue001")


def template_prompt(messages: list[tuple[str, str]], tokenizer, encoder: TextEncoder,
                    ) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template. When a message holds
    the text of a control token, the template is rendered with a marker in place of each
    message's content, so the template's text and the users' text are told apart
    (`TextEncoder.template`: the user's "</s>" stays text); otherwise the rendered text is
    tokenized whole, exactly as the tokenizer does."""
    render = lambda contents: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": r, "content": c} for (r, _), c in zip(messages, contents)], tokenize=False,
        add_generation_prompt=True)
    find = encoder._special_re
    if find is None or not any(find.search(c) for _, c in messages):
        return list(tokenizer(render([c for _, c in messages]),
                              add_special_tokens=False)["input_ids"])
    text = render([f"\ue000{i}\ue001" for i in range(len(messages))])
    found = [int(m.group(1)) for m in _MARK.finditer(text)]
    if sorted(found) == list(range(len(messages))):
        parts, pos = [], 0
        for m in _MARK.finditer(text):
            parts += [(text[pos:m.start()], True), (messages[int(m.group(1))][1], False)]
            pos = m.end()
        return encoder.template(parts + [(text[pos:], True)])
    # a template that rewrites its contents: the whole text, refused if a message holds a
    # control token (it could not be told from the template's own)
    for i, (_, content) in enumerate(messages):
        hit = encoder._special_re.search(content) if encoder._special_re else None
        if hit:
            raise APIError(400, f"messages[{i}].content holds the control token "
                                f"{hit.group()!r}, which this model's chat template cannot "
                                f"keep apart from its own", f"messages[{i}].content")
    return encoder.template([(render([c for _, c in messages]), True)])
