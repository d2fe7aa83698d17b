"""Hooks for :func:`fsync.sync_grads` and :class:`fsync.GradSync`, and the ZeRO step."""

from fsync.ops._allreduce import allreduce
from fsync.ops._zero import ZeroState, ZeroStep, zero, zero_state_dict

__all__ = ["ZeroState", "ZeroStep", "allreduce", "zero", "zero_state_dict"]
