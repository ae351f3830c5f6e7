"""The Vicuna conversation template, written once: training renders conversations with it
(`data`) and the server renders chat requests with it (`serving.server`)."""

from __future__ import annotations

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's "
                 "questions.")


def vicuna_pieces(conv: list[tuple[str, str]]) -> list[tuple[str, bool]]:
    """A conversation [(role, text)] in the Vicuna template as text pieces, each tokenized
    on its own: (the prompt up to "ASSISTANT:", False) before each answer and (" " + the
    answer, True) for it; a last prompt piece when the conversation ends with user turns.
    The system messages (or `VICUNA_SYSTEM`) open the first prompt piece."""
    system = " ".join(t for r, t in conv if r == "system") or VICUNA_SYSTEM
    pending = system + " "
    pieces: list[tuple[str, bool]] = []
    for role, text in conv:
        if role == "system":
            continue
        if role == "user":
            pending += f"USER: {text} ASSISTANT:"
            continue
        pieces += [(pending, False), (" " + text, True)]
        pending = ""
    if pending:
        pieces.append((pending, False))
    return pieces
