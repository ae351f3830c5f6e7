"""The switch of the CPU kernels, importable without JAX (commands parse flags first)."""

from __future__ import annotations

import argparse
import os

ENV = "MEDUSA_JAX_CPU_KERNELS"
FLAG = "--no-cpu-kernels"


def off_by_env() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")


def add_flag(ap: argparse.ArgumentParser):
    ap.add_argument(FLAG, dest="no_cpu_kernels", action="store_true",
                    help=f"multiply with XLA's own products on the CPU instead of this "
                         f"project's few-row kernel ({ENV}=0 does the same)")


def apply_flag(args: argparse.Namespace):
    """Honour --no-cpu-kernels (before anything loads a model)."""
    if getattr(args, "no_cpu_kernels", False):
        os.environ[ENV] = "0"
