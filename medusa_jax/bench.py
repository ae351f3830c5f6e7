"""Benchmark building blocks: timed decoding runs, the transformers baseline, step-time curves.

Everything is measured in one process on the same prompts; compile and warm-up are excluded
(each timed function runs once before the clock starts) and the median of several repetitions
is reported. Speed claims are ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.acceptance import Sampling
from medusa_jax.backbone import KVCache, causal_mask, forward, init_params
from medusa_jax.config import ModelConfig
from medusa_jax.decode import generate, medusa_generate, pad_prompts
from medusa_jax.tree import Tree

# Named backbone shapes for random-weight step-time measurements.
SHAPES = {
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                       intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
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


def random_backbone(shape: str, dtype: str = "bfloat16", seed: int = 0):
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape], param_dtype=dtype, compute_dtype=dtype)
    return cfg, init_params(cfg, jax.random.key(seed))


def read_prompt_file(path: str | Path) -> list[tuple[str, str | None]]:
    """(prompt, category) pairs: text lines, or JSONL with `prompt` or `turns` (first turn).
    Bad input raises ValueError in one line naming the file and line."""
    from medusa_jax.data import read_text  # UTF-8, with file:line errors

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such prompts file")
    out = []
    for n, line in enumerate(read_text(file).splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{n}: invalid JSON ({e.msg})") from None
            if "prompt" in rec:
                field, text = "prompt", rec["prompt"]
            elif "turns" in rec:
                if not isinstance(rec["turns"], list) or not rec["turns"]:
                    raise ValueError(f"{file}:{n}: 'turns' must be a non-empty list of strings, "
                                     f"got {type(rec['turns']).__name__} {rec['turns']!r:.40}")
                field, text = "turns[0]", rec["turns"][0]
            else:
                raise ValueError(f"{file}:{n}: no 'prompt' or 'turns' field")
            if not isinstance(text, str):
                raise ValueError(f"{file}:{n}: '{field}' must be a string, got "
                                 f"{type(text).__name__} {text!r:.40}")
            if not text.strip():
                raise ValueError(f"{file}:{n}: '{field}' is empty")
            out.append((text, rec.get("category")))
        else:
            out.append((line, None))
    if not out:
        raise ValueError(f"{file}: no prompts in it")
    return out


def _median_time(fn, reps: int) -> tuple[float, object]:
    result = jax.block_until_ready(fn())  # compile + warm-up, not timed
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


@dataclasses.dataclass
class RunResult:
    name: str
    batch_size: int
    seconds: float  # median wall time over all prompts
    new_tokens: int
    steps: int  # decoding steps, summed over rows
    rows: list[list[int]]  # new tokens per prompt
    per_row_steps: list[int]
    loop_steps: int = 0  # iterations of the decode loops (a batch runs until its slowest row)

    @property
    def step_seconds(self) -> float:
        return self.seconds / max(self.loop_steps, 1)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


def run_decoder(params, cfg: ModelConfig, prompts: list[list[int]], *, batch_size: int,
                max_new_tokens: int, eos: tuple[int, ...], sampling: Sampling = Sampling(),
                heads=None, tree: Tree | None = None, reps: int = 3, seed: int = 0,
                name: str = "") -> RunResult:
    """Time plain (heads=None) or Medusa decoding of all prompts in fixed-size batches."""
    batches = []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        batches.append((len(chunk), *pad_prompts(chunk + [chunk[-1]] * (batch_size - len(chunk)))))
    key = jax.random.key(seed)

    def run():
        outs = []
        for _, tokens, lengths in batches:
            if heads is None:
                outs.append(generate(params, cfg, tokens, lengths, key, sampling=sampling,
                                     max_new_tokens=max_new_tokens, eos=eos))
            else:
                outs.append(medusa_generate(params, heads, cfg, tokens, lengths, key, tree=tree,
                                            sampling=sampling, max_new_tokens=max_new_tokens,
                                            eos=eos))
        return outs

    seconds, outs = _median_time(run, reps)
    rows, steps, loop_steps = [], [], 0
    for (n, _, _), out in zip(batches, outs):
        out = jax.device_get(out)
        loop_steps += int(out.steps.max())
        for i in range(n):
            rows.append(out.tokens[i, : out.num_new[i]].tolist())
            steps.append(int(out.steps[i]))
    return RunResult(name, batch_size, seconds, sum(map(len, rows)), sum(steps), rows, steps,
                     loop_steps)


def run_transformers(model_dir: str | Path, prompts: list[list[int]], *, batch_size: int,
                     max_new_tokens: int, eos: tuple[int, ...], reps: int = 3) -> RunResult | None:
    """transformers' PyTorch greedy `generate` on the same prompts (None without torch)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    batches = []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        width = max(map(len, chunk))
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding, as transformers expects for generation
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        batches.append((ids, mask))

    def run():
        outs = []
        with torch.no_grad():
            for ids, mask in batches:
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=list(eos) or None,
                                     pad_token_id=0)
                outs.append(out[:, ids.shape[1]:])
        return outs

    seconds, outs = _median_time(run, reps)
    rows = []
    for out in outs:
        for row in out.tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
    n = sum(map(len, rows))
    return RunResult("transformers", batch_size, seconds, n, n, rows, [len(r) for r in rows],
                     len(batches) * max_new_tokens)


def step_time_curve(cfg: ModelConfig, params, tree_sizes: list[int], *, prefix: int = 256,
                    batch: int = 1, reps: int = 10) -> dict[int, float]:
    """Seconds for one backbone pass over T new tokens after a `prefix`-token cache, for each
    tree size N (T = N + 1; N = 0 is a plain decoding step). The cost of a pass does not depend
    on the mask's pattern, so a causal block stands in for the tree."""
    out = {}
    for size in tree_sizes:
        t = size + 1
        capacity = prefix + t
        cache = KVCache.init(cfg, batch, capacity)
        cache = cache.replace(lengths=jnp.full((batch,), prefix, jnp.int32))
        mask = causal_mask(cache.lengths, t, capacity)
        tokens = jnp.ones((batch, t), jnp.int32)
        positions = cache.lengths[:, None] + jnp.arange(t)[None]
        fn = jax.jit(lambda p, c, tk=tokens, ps=positions, m=mask: forward(p, cfg, tk, ps, m, c)[0])
        out[size] = _median_time(lambda: fn(params, cache), reps)[0]
    return out
