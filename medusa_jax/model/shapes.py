"""Named backbone shapes (`infer.bench --shape`, `train.enlarge --shape`, `--memory-report
--shape`): ModelConfig fields, stdlib only, so the commands check a shape name before JAX
is imported. `bench` re-exports them."""


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, context: int, vocab: int = 32000, **more) -> dict:
    """A Llama backbone's ModelConfig fields."""
    return dict(model_type="llama", vocab_size=vocab, hidden_size=hidden,
                intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=context,
                **more)


# Named backbone shapes for random-weight step-time measurements.
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head dim, context
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 128, 4096),
    "llama-2-13b": _llama(5120, 13824, 40, 40, 40, 128, 4096),
    "llama-2-70b": _llama(8192, 28672, 80, 64, 8, 128, 4096),
    "llama-3-8b": _llama(4096, 14336, 32, 32, 8, 128, 8192, vocab=128256, rope_theta=500000.0),
    # llama2.c's stories110M shape: the mid size that runs on a 2-core CPU
    "llama-110m": _llama(768, 2048, 12, 12, 12, 64, 1024),
    "llama-15m": _llama(288, 768, 6, 6, 6, 48, 1024),
}
