"""Hooks for :func:`fsync.sync_grads` and :class:`fsync.GradSync`."""

from fsync.ops._allreduce import allreduce

__all__ = ["allreduce"]
