"""The options `infer.bench` takes: a frozen, JAX-free dataclass validated once.

Its fields with `option` metadata are the command's flags (`runtime.options.add_config_flags`;
--model, --heads, --mesh and the n-gram flags are `cli`'s, as every decoding command's). The
options it shares with `infer.generate` are declared once, in `decoding.config.DecodeConfig`.
This module imports no JAX, so `--help` and a bad flag stay immediate.
"""

from __future__ import annotations

import dataclasses

from medusa_jax.constants import MODES
from medusa_jax.decoding.config import DecodeConfig, check_temperature
from medusa_jax.drafters import registry, shipped
from medusa_jax.runtime.options import int_list, name_list, option, positive_int, same_option


def _switch(help: str):
    """A flag that turns a measurement on (no --no- form)."""
    return option(False, help, action="store_true")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `infer.bench` measures and how. `modes`, `trees` and `also_heads` are comma
    lists as typed (`mode_list`); the other lists are tuples."""

    HELP = {"dtype": "the random or --step-curve backbone's dtype (default {default})"}

    prompts: str | None = option(None, "text lines or MT-Bench/Spec-Bench question.jsonl "
                                 "(default: held-out TinyStories openings)", metavar="PROMPTS")
    num_prompts: int = option(16, "prompts decoded (default {default})", type=positive_int,
                              metavar="N")
    max_new_tokens: int = same_option(DecodeConfig, "max_new_tokens")
    modes: str = option("greedy", f"comma list of {','.join(MODES)} (default {{default}})",
                        metavar="MODES")
    trees: str | None = option(None, "comma list of tree names/files (default: the model's "
                               "default tree)", type=name_list, metavar="TREES")
    batch_sizes: tuple[int, ...] = option((1,), "comma list, e.g. 1,4,16: speculation pays "
                                          "less as batches grow (default 1)",
                                          flag=("--batch-size", "--batch-sizes"),
                                          type=int_list(1), metavar="BATCH_SIZES")
    cache_phases: tuple[int, ...] | None = option(
        None, "comma list: the decoders' most attention-window phases, e.g. 1,4 (1: attend "
              "over the whole KV cache every step; default: the decoders' own); each value "
              "gets its own plain and Medusa rows", type=int_list(1), metavar="CACHE_PHASES")
    also_heads: str | None = option(
        None, f"comma list of more drafters ({registry.help_kinds(files_only=True)}; "
              f"{shipped.help_names()}: the embedded model's shipped ones; {shipped.NGRAM!r}: "
              "n-gram drafts, on a chain unless --trees), each benchmarked against the same "
              "plain run, side by side with --heads", type=name_list, metavar="HEADS,...")
    temperature: float = same_option(DecodeConfig, "temperature")
    reps: int = option(3, "timed repetitions; the median is reported (default {default})",
                       type=positive_int, metavar="N")
    transformers: bool = option(True, "time the PyTorch (transformers) baseline too "
                                "(default: yes; --no-transformers skips it)")
    hf_prompts: int = option(4, "prompts for the (slow) transformers baseline, first batch "
                             "size only (default {default})", type=positive_int, metavar="N")
    hf_reps: int = option(1, "repetitions of the transformers baseline (default {default})",
                          type=positive_int, metavar="N")
    json: str | None = option(None, "results as JSON: on standard output, or into FILE",
                              nargs="?", const="-", metavar="FILE")
    plot: str | None = option(None, "write a PNG of tokens/step and speedup", metavar="PLOT")
    random_weights: bool = _switch("step-time curve of a random backbone of --shape (no "
                                   "decoding)")
    heads_cost: bool = _switch("with --random-weights: time the Medusa heads alone at "
                               "--shape's hidden size and vocabulary, per-head vs shared vs "
                               "reduced-vocabulary projections (one token, float32)")
    breakdown: bool = _switch("where a decoding step's time goes: kernels of the compiled "
                              "step and the time each stage adds (plain and each --trees "
                              "tree; greedy, batch 1)")
    step_curve: bool = _switch("step-time curve of --model (default: the embedded model), "
                               "no decoding")
    hardware_report: bool = _switch("whether Medusa pays on this device at --shape (random "
                                    "weights, --dtype): bandwidth, matrix peak, the pass time "
                                    "for T = 1 ... 65 tokens against its bound at two cache "
                                    "fills, loop and compile costs, and the speedup the "
                                    "shipped heads' tokens/step predicts")
    compare_layouts: bool = _switch("plain greedy decoding of --model with its layers stacked "
                                    "and scanned against the decoding layout (per-layer "
                                    "weights), alternating")
    report_layers: tuple[int, ...] = option((1, 2), "with --hardware-report: layer counts to "
                                            "measure (the shape's depth is extrapolated "
                                            "linearly from them; default 1,2)",
                                            type=int_list(1), metavar="REPORT_LAYERS")
    report_contexts: tuple[int, ...] = option((512, 4096), "with --hardware-report: cache "
                                              "fills to measure (default 512,4096)",
                                              type=int_list(1), metavar="REPORT_CONTEXTS")
    report_tokens: tuple[int, ...] = option((1, 5, 9, 17, 33, 65), "with --hardware-report: "
                                            "tokens per pass to measure (default "
                                            "1,5,9,17,33,65: plain decoding and trees of "
                                            "4 ... 64 nodes)", type=int_list(1),
                                            metavar="REPORT_TOKENS")
    shape: str = option("llama-110m", "the named shape of --random-weights, --hardware-report "
                        "and --layers (default {default})", metavar="SHAPE")
    dtype: str = same_option(DecodeConfig, "dtype")
    tree_sizes: tuple[int, ...] = option((0, 4, 8, 16, 32, 64, 128), "the step curve's tree "
                                         "sizes in nodes (default 0,4,8,16,32,64,128)",
                                         type=int_list(0), metavar="TREE_SIZES")
    prefix: int = option(256, "context length for the step curve (default {default})",
                         type=positive_int, metavar="PREFIX")
    layers: int | None = option(None, "with --random-weights: per-device memory of Medusa "
                                "decoding of --shape on --mesh, measured with this many "
                                "layers and extrapolated to all (parameters, heads, KV cache, "
                                "compiled temporaries)", type=positive_int, metavar="LAYERS")
    context: int = option(2048, "KV cache length for --layers (default {default})",
                          type=positive_int, metavar="CONTEXT")
    compare_kernels: bool = _switch("with --step-curve: time every pass with this project's "
                                    "CPU kernel and with XLA's products, alternating, in one "
                                    "process")

    def __post_init__(self):
        modes = self.mode_list
        if not modes:
            raise ValueError(f"--modes {self.modes!r}: give at least one of {', '.join(MODES)}")
        for m in modes:
            if m not in MODES:
                raise ValueError(f"--modes: {m!r} is not one of {', '.join(MODES)}")
        check_temperature(self.temperature, modes, f"--modes {self.modes}")

    @property
    def mode_list(self) -> list[str]:
        """--modes as a list ("greedy, typical" -> ["greedy", "typical"])."""
        return [m.strip() for m in self.modes.split(",") if m.strip()]
