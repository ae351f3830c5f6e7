"""A small handle on the backbone a drafter drafts for (`Backbone`): its config, and from its
parameters the input embedding, the output logits, the rope table and its decoder layer,
so a kind that needs them (EAGLE-3; a DeepSeek-style MTP module that runs the backbone's
own layer and shared head) neither binds the config into its parameters for them nor
reaches into `model.backbone`'s internals one by one. The hidden states the step hands a
drafter are the backbone's after its final norm (`Drafter.begin` / `advance`)."""

from __future__ import annotations

import dataclasses
import functools

import jax

from medusa_jax.model import backbone
from medusa_jax.model.config import ModelConfig

Params = object  # a parameter pytree


@dataclasses.dataclass(frozen=True)
class Backbone:
    """`cfg` the backbone's config, `params` its parameters (either layout). `cfg` None: a
    plain table lookup for `embed` only (drafters bound without a backbone config)."""

    cfg: ModelConfig | None
    params: Params

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [...] -> [..., H]: the backbone's own input embedding."""
        if self.cfg is None:
            return self.params["embed"][tokens]
        return backbone.embed_tokens(self.cfg, self.params, tokens)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., H] after the final norm -> logits [..., V] in float32 (the output
        head, shared)."""
        return backbone.logits_from_hidden(self.cfg, self.params, hidden)

    def rope(self, positions: jax.Array):
        """positions [B, T] -> the rope table a decoder layer takes."""
        return backbone.rope_table(positions, backbone.rope_frequencies(self.cfg))

    @property
    def decoder_layer(self):
        """`model.backbone.decoder_layer` for this config: (x, layer weights, k_cache,
        v_cache, rope, prefix_mask, new_mask, extra=None, attn_input=None) -> (x, k, v)."""
        return functools.partial(backbone.decoder_layer, self.cfg)
