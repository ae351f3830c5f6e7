"""Which backbone layers an EAGLE-3 drafter reads (`aux_layers`), JAX-free: `train.eagle`
checks its --aux-layers against the model before JAX starts, and a fresh drafter's `init`
reads the same default."""

from __future__ import annotations


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose inputs an EAGLE-3 drafter reads (low, mid, high), as `aux_layers`:
    (2, L // 2, L - 3), the rule of EAGLE's `modeling_llama_kv.py`, SGLang and vLLM (the
    outputs of layers 1, L // 2 - 1, L - 4: SpecForge's ids). Below 7 layers two of them
    coincide (or fall outside the model), which gives no three distinct features."""
    layers = (2, num_layers // 2, num_layers - 3)
    if not layers[0] < layers[1] < layers[2]:
        raise ValueError(f"EAGLE-3 reads the inputs of layers (2, L//2, L-3), three distinct "
                         f"layers only when L >= 7; this backbone has {num_layers} layers")
    return layers


def default_aux_layers(num_layers: int, name: str = "aux_layers") -> tuple[int, int, int]:
    """The layers a fresh drafter reads unless told (`train.eagle`'s default, a drafter's
    `init`): EAGLE's rule (`eagle3_layers`) from 7 layers on, (1, L // 2, L - 1) below (the
    embedded 5-layer model: 1, 2, 4); a one-line ValueError naming `name` below 4 layers."""
    if num_layers >= 7:
        return eagle3_layers(num_layers)
    if num_layers >= 4:
        return 1, num_layers // 2, num_layers - 1
    raise ValueError(f"{name}: a {num_layers}-layer backbone has no default; give three "
                     f"layers A,B,C with 0 <= A < B < C < {num_layers}")
