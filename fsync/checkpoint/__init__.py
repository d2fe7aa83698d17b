"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes what it owns.

A save is ``dcp.save(fsync.checkpoint.state_dict(params, state, step=step),
checkpoint_id=path)`` on every rank (``dcp.async_save`` too); a resume, at any world
size and in either ZeRO sharding mode, is ``params, state =
fsync.checkpoint.load(path, params, step=step)``, which checks the checkpoint
against the tree and the step before it reads anything. ``step`` is a ZeRO step, an
optimizer, a ``GradSync`` or a DiLoCo, or a tuple of them with the tuple of their
states (``step=(opt, sync)``, ``state=(opt_state, sync_state)``). The guide
"Checkpoints" says what each entry holds.
"""

from fsync.checkpoint._load import load
from fsync.checkpoint._state_dict import state_dict
from fsync.checkpoint._torch import torch_optimizer_state_dict

__all__ = ["load", "state_dict", "torch_optimizer_state_dict"]
