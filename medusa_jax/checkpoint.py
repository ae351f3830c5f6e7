"""Training checkpoints with Orbax: trained params, optimizer state, step, data position.

One `ocp.CheckpointManager` per run directory (`<run>/checkpoints/<step>/`), each step a
Composite of three items:

    params     StandardSave: the trained subtrees only ({"heads": ...} for Medusa-1; the
               frozen backbone is reloaded from --model, not copied into every checkpoint)
    opt_state  StandardSave: the full optax state (frozen leaves hold no arrays)
    meta       JsonSave: {"step", "data_position", "config"}

Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it only once every item
is on disk, so a run killed mid-save leaves a temp directory that `all_steps()` never lists;
resuming always starts from the last complete step. `max_to_keep` prunes older steps.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from medusa_jax import sharding

from medusa_jax.train_step import TrainState

ITEMS = ("params", "opt_state", "meta")


class CheckpointError(ValueError):
    """No checkpoint to resume from, or one that does not match the run."""


def _abstract(tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (what StandardRestore fills in)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int | None = 3,
                 async_save: bool = True, create: bool = True):
        self.directory = Path(directory).absolute()
        if not create and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no checkpoint directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=create,
            enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def all_steps(self) -> list[int]:
        """Finalized steps only: temp directories of unfinished saves are never listed."""
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, trained: tuple[str, ...], data_position: int,
             config: dict, force: bool = False) -> bool:
        """Start saving `state` at its step (asynchronously); returns whether it saves."""
        step = int(state.step)
        params = {k: state.params[k] for k in trained}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.JsonSave({"step": step, "data_position": int(data_position),
                                    "config": config}))
        return self.manager.save(step, args=args, force=force)

    def restore(self, target: TrainState, shardings: TrainState, trained: tuple[str, ...],
                step: int | None = None) -> tuple[TrainState, dict]:
        """Restore into the structure/shardings of `target` (an abstract or real state).

        Frozen subtrees are taken from `target.params` unchanged. Returns (state, meta)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{self.directory}: no finished checkpoint to resume from")
        params_t = {k: target.params[k] for k in trained}
        params_s = {k: shardings.params[k] for k in trained}
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(params_t, params_s)),
                opt_state=ocp.args.StandardRestore(
                    _abstract(target.opt_state, shardings.opt_state)),
                meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(
                f"{self.directory}/{step}: checkpoint does not match this run "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        params = dict(target.params)
        params.update(out.params)
        state = TrainState(step=sharding.put(np.int32(out.meta["step"]), shardings.step),
                           params=params, opt_state=out.opt_state)
        return state, out.meta

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.close()
