"""Hooks for [fsync.sync_grads][] and [fsync.GradSync][], and the ZeRO step (re-exported)."""

# The ZeRO step lives beside the sync (fsync/_zero/), not among the hooks, and the mean
# all-reduce below the reduce that falls back to it (fsync/_allreduce.py); both are
# re-exported here, where users have always found them.
from fsync._allreduce import allreduce
from fsync._zero import ZeroState, ZeroStep, replicated, zero, zero_state_dict
from fsync.ops._compress import bf16_compress, fp16_compress
from fsync.ops._noop import noop
from fsync.ops._powersgd import PowerSGDState, batched_powersgd, powersgd
from fsync.ops._quantize import quantize

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
    "replicated",
    "zero",
    "zero_state_dict",
]
