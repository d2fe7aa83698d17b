"""Hooks for :func:`fsync.sync_grads` and :class:`fsync.GradSync`, and the ZeRO step."""

from fsync.ops._allreduce import allreduce
from fsync.ops._compress import bf16_compress, fp16_compress
from fsync.ops._noop import noop
from fsync.ops._powersgd import PowerSGDState, batched_powersgd, powersgd
from fsync.ops._quantize import quantize
from fsync.ops._zero import ZeroState, ZeroStep, zero, zero_state_dict

__all__ = [
    "PowerSGDState",
    "ZeroState",
    "ZeroStep",
    "allreduce",
    "batched_powersgd",
    "bf16_compress",
    "fp16_compress",
    "noop",
    "powersgd",
    "quantize",
    "zero",
    "zero_state_dict",
]
