"""Named backbone shapes (`infer.bench --shape`, `train.enlarge --shape`, `--memory-report
--shape`): ModelConfig fields, stdlib only, so the commands check a shape name before JAX
is imported. `bench` re-exports them."""

# Named backbone shapes for random-weight step-time measurements.
SHAPES = {
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                       intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                       head_dim=128, max_position_embeddings=4096),
    "llama-2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120,
                        intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40,
                        head_dim=128, max_position_embeddings=4096),
    "llama-2-70b": dict(model_type="llama", vocab_size=32000, hidden_size=8192,
                        intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                        head_dim=128, max_position_embeddings=4096),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=8192, rope_theta=500000.0),
    # llama2.c's stories110M shape: the mid size that runs on a 2-core CPU
    "llama-110m": dict(model_type="llama", vocab_size=32000, hidden_size=768,
                       intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=12,
                       head_dim=64, max_position_embeddings=1024),
    "llama-15m": dict(model_type="llama", vocab_size=32000, hidden_size=288,
                      intermediate_size=768, num_layers=6, num_heads=6, num_kv_heads=6,
                      head_dim=48, max_position_embeddings=1024),
}
