"""After training: the trained heads' greedy decoding against plain decoding on held-out
prompts (`tools.bench`), written to <run>/benchmark.json and the summary. The commands run it
after `trainer.train` returns; the training loop itself measures no decoding."""

from __future__ import annotations

import json
import time
from pathlib import Path

from medusa_jax.training.trainer import TrainResult


def finish(result: TrainResult) -> dict:
    """Benchmark a finished run's decoding (when it has prompts), update its summary.json
    and print where the run is. Returns the summary."""
    summary = result.summary
    if not result.finished:
        return summary
    run_dir = Path(summary["run_dir"])
    check = result.decoding
    if check is not None:
        from medusa_jax.drafters import registry as drafter
        from medusa_jax.tools import bench

        summary["benchmarks"] = []
        for tree in check.trees:
            c = bench.compare_decoding(check.backbone, check.heads, check.cfg, check.prompts,
                                       tree, max_new_tokens=check.max_new_tokens, eos=check.eos)
            summary["benchmarks"].append(c.to_json())
            bench.print_comparison(c, f"greedy decoding ({check.name})",
                                   drafter.kind_of(check.heads))
        summary["benchmark"] = summary["benchmarks"][0]
        (run_dir / "benchmark.json").write_text(json.dumps(summary["benchmarks"], indent=2))
        # true of the 1 MB embedded model only: a larger one is bound by reading its weights
        print("\n(on this model a step is bound by per-kernel overhead, not by reading the "
              "weights; where Medusa pays: docs/performance.md)" if check.embedded else
              "\n(where Medusa pays: docs/performance.md)")
    summary["wall_seconds"] = round(time.perf_counter() - result.t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\ndone in {summary['wall_seconds']:.0f}s; run directory: {run_dir}")
    return summary
