"""``python -m fsync``: versions, available backends, a one-line self-check, whether it compiles."""

from __future__ import annotations

import os
import sys
import tempfile

import optree
import torch
import torch.distributed as dist

import fsync
from fsync import _tree
from fsync._plan import count


def _backends() -> str:
    names = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available() and torch.cuda.is_available(),
        "mpi": dist.is_mpi_available(),
        "ucc": dist.is_ucc_available(),
    }
    return ", ".join(name for name, ok in names.items() if ok) or "none"


def _self_check() -> str:
    """Plans, packs, syncs and unpacks a small tree on a one-rank gloo group."""
    conv = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    bias = torch.randn(4, dtype=torch.bfloat16)
    tree = {"conv": conv, "bias": bias, "unused": None}
    plan = fsync.plan_buckets(tree)
    back = fsync.unpack(fsync.pack(tree, plan), plan)
    with tempfile.TemporaryDirectory() as tmp:
        owns_group = not dist.is_initialized()
        if owns_group:
            init = f"file://{os.path.join(tmp, 'init')}"
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        try:
            synced = fsync.sync_grads(tree)
        finally:
            if owns_group:
                dist.destroy_process_group()
    for out in (back, synced):
        if out["unused"] is not None or not out["conv"].is_contiguous(
            memory_format=torch.channels_last
        ):
            raise AssertionError("the tree came back with another structure or layout")
        for name, value in (("conv", conv), ("bias", bias)):
            if not torch.equal(out[name], value):
                raise AssertionError(f"leaf {name!r} came back with other values")
    buckets = count(len(plan.buckets), "bucket")
    return f"self-check ok: {buckets} planned, packed, synced and unpacked"


def _compile_check() -> tuple[bool, str]:
    """Whether ``torch.compile`` can trace fsync with this torch and optree, in words."""
    problem = _tree.compile_problem()
    if problem is None:
        return True, "torch.compile: ok"
    return False, f"torch.compile: FAILS here: {problem}"


def main() -> int:
    print(f"fsync {fsync.__version__}")
    print(
        f"torch {torch.__version__}, optree {optree.__version__}, Python {sys.version.split()[0]}"
    )
    print(f"backends: {_backends()}")
    try:
        print(_self_check())
    except Exception as error:  # report, do not hide: the exit status says it failed
        print(f"self-check FAILED: {type(error).__name__}: {error}")
        return 1
    compiles, words = _compile_check()
    print(words)
    return 0 if compiles else 1


if __name__ == "__main__":
    sys.exit(main())
