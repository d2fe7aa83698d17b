"""fsync: gradient synchronisation for data-parallel PyTorch as a pure function over a pytree.

Inside a functional train step, ``grads = fsync.sync_grads(grads)`` does what DDP's
Reducer does (bucketed all-reduce mean, DDP's bucket layout and scaling), eagerly or
under ``torch.compile(fullgraph=True)``; ``fsync.grad_and_value(loss_fn)`` is
``torch.func.grad_and_value`` whose gradients come back synced, communication started
as backward completes each bucket. Hooks (``fsync.ops``) transform the buckets;
``fsync.GradSync`` threads their state; ``fsync.diloco`` syncs a pseudo-gradient every H
steps (DiLoCo, local SGD); ``fsync.checkpoint`` saves and resumes the parameters and
optimizer states (ZeRO's sharded ones too) through ``torch.distributed.checkpoint``.
"""

from fsync import checkpoint, ops, optim
from fsync._accumulate import DeferredState, DeferredSync, accumulate
from fsync._broadcast import broadcast, sync_buffers
from fsync._compile import compile
from fsync._diloco import DiLoCo, DiLoCoState, diloco
from fsync._grad import grad, grad_and_value
from fsync._hook import Hook, SyncContext, chain
from fsync._options import SyncOptions
from fsync._pack import pack, unpack
from fsync._plan import BucketPlan, BucketSpec, LeafSpec
from fsync._planner import compute_bucket_assignment_by_size, plan_buckets
from fsync._stats import SyncStats, sync_stats
from fsync._sync import GradSync, SyncState, sync_grads
from fsync._verify import verify

__version__ = "0.1.0"

__all__ = [
    "BucketPlan",
    "BucketSpec",
    "DeferredState",
    "DeferredSync",
    "DiLoCo",
    "DiLoCoState",
    "GradSync",
    "Hook",
    "LeafSpec",
    "SyncContext",
    "SyncOptions",
    "SyncState",
    "SyncStats",
    "__version__",
    "accumulate",
    "broadcast",
    "chain",
    "checkpoint",
    "compile",
    "compute_bucket_assignment_by_size",
    "diloco",
    "grad",
    "grad_and_value",
    "ops",
    "optim",
    "pack",
    "plan_buckets",
    "sync_buffers",
    "sync_grads",
    "sync_stats",
    "unpack",
    "verify",
]
