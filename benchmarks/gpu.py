"""The whole GPU check in one command: ``python benchmarks/gpu.py`` writes docs/benchmarks-gpu.md.

It runs, each part in a process of its own under a time limit (a part that fails or
runs over is reported on the page, and the others still run), in under 8 minutes on
one H100:

1. ``tests``: the CUDA tests (``tests/test_cuda.py``, ``tests/test_cuda_streams.py``)
   under pytest. They leave their figures (``tests/_cuda.py``'s ``report``) for the
   page's sections 2 and 3: every entry point with CUDA tensors on 2 ranks sharing the
   GPU over gloo, against DDP in the same processes; the eager gradient call's stream
   handoff under stress, as shipped and with its wait removed.
2. ``kernels``: the compiled sync's pack + scale and unpack, taken apart with
   ``torch.profiler``: kernels per bucket, and bandwidth against a device-to-device copy
   of the same bytes, for the MLP, deep MLP and GPT trees in float32 and bfloat16.
3. ``gpt``: the compiled GPT step (forward, backward, sync, update) on one GPU, NCCL
   with one rank, against DDP eager and DDP compiled: time, graph breaks, recompiles.

Without a CUDA device each part is skipped, saying so, and the page says that it was
not made on a GPU. ``--only`` runs some parts; ``--out`` names the page's folder.

On a GPU machine of this project (torch 2.11 + CUDA 13, Python 3.12, pytest on the
image, no package registry), fsync's one missing dependency, optree, must be carried as
a cp312 wheel (``.whl/`` is git-ignored), not 0.20.0, whose registry lookup torch 2.11's
dynamo cannot trace (``fsync/_tree.py``, ``compile_problem``)::

    # here, once, in the repository's root:
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl 'optree>=0.13,!=0.20.0'
    # there (the device tool: carry=[".whl"]):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
        && PYTHONPATH=/tmp/site python3 benchmarks/gpu.py && cp docs/benchmarks-gpu.md $OUT/

Nothing here but the workloads of ``benchmarks/models.py``, fsync's public API, the
tests and torch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import page  # noqa: E402
from benchmarks.constants import DOCS  # noqa: E402
from benchmarks.gpu_page import EAGER, SHIPPED, Outcome, render  # noqa: E402

PAGE = "benchmarks-gpu.md"
CUDA_TESTS = ("tests/test_cuda.py", "tests/test_cuda_streams.py")
REPORTS = "FSYNC_GPU_REPORTS"  # tests/_cuda.py's name for the reports' folder


class Part(NamedTuple):
    """One part of the check: a process of its own, killed at ``limit_s``."""

    name: str
    limit_s: float
    needs_cuda: bool = True


# The limits add up to 9 2/3 minutes. On an H100 (2026-11-27) the parts took 4.6 minutes in
# all: the tests 139 s (89 of them compiling examples/train.py over NCCL), the kernels 34 s
# (one variant then; three took 67 s on an H200; four now), the GPT 99 s (its step compiled twice:
# fsync's and DDP's; a third compile now).
PARTS = (
    Part("environment", 30, needs_cuda=False),
    Part("tests", 180),
    Part("kernels", 150),
    Part("gpt", 220),
)
NO_CUDA = "no CUDA device"

# --- running the parts ---------------------------------------------------------------------------


def tail(output: str, lines: int = 12) -> str:
    """The last lines of a part's output, for the page."""
    return "\n".join(output.strip().splitlines()[-lines:])


def environment_for_children(reports: pathlib.Path) -> dict[str, str]:
    """This process's environment, the repository first on ``PYTHONPATH``, the tests'
    reports folder named, and more inductor compile workers than the tests' two."""
    env = page.children_env({REPORTS: str(reports)})
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_part(part: Part, cuda: bool, workdir: pathlib.Path, env: dict[str, str]) -> Outcome:
    """Runs one part in a child process: pytest for ``tests``, else this file's ``--child``."""
    if part.needs_cuda and not cuda:
        return Outcome("skipped", 0.0, part.limit_s, note=NO_CUDA)
    if part.name == "tests":
        junit = workdir / "junit.xml"
        command = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-v", "-p", "no:cacheprovider"]
        done = page.run_child([*command, f"--junitxml={junit}"], limit_s=part.limit_s, env=env)
        found: Any = read_outcomes(junit, done.output)
    else:  # what the part saved last, if it was killed
        command = [sys.executable, __file__, "--child", part.name]
        done, found = page.child_json(command, limit_s=part.limit_s, env=env)
    note = "" if done.status == "ok" else tail(done.output)
    return Outcome(done.status, done.seconds, part.limit_s, found, note)


_VERBOSE = re.compile(r"^(tests/\S+::\S+(?:\[[^\]]*\])?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def read_outcomes(junit: pathlib.Path, output: str) -> list[dict[str, Any]]:
    """Each test's outcome: from pytest's JUnit XML, or, where pytest was killed before
    writing it, from its ``-v`` lines."""
    if not junit.exists():
        matches = [_VERBOSE.match(line) for line in output.splitlines()]
        found = {m.group(1): m.group(2).lower() for m in matches if m}
        return [{"test": t, "outcome": o, "seconds": None, "message": ""} for t, o in found.items()]
    out = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error"}.get(child.tag, "skipped")
                message = (child.get("message") or "").strip().split("\n")[0][:240]
        path = case.get("classname", "").replace(".", "/") + ".py"
        seconds = float(case.get("time") or 0.0)
        out.append(
            {
                "test": f"{path}::{case.get('name')}",
                "outcome": outcome,
                "seconds": seconds,
                "message": message,
            }
        )
    return out


def read_reports(folder: pathlib.Path) -> dict[str, Any]:
    """The figures the CUDA tests left, by report name."""
    if not folder.is_dir():
        return {}
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


# --- the parts that run here (``--part NAME``) ---------------------------------------------------


# A part is a function of ``save``, which it calls with what it has found so far (JSON), at
# least once before it returns: what a part killed at its limit had saved is still shown.
Save = Callable[[Any], None]


def part_environment(save: Save) -> None:
    """What the page's header says about the machine."""
    import platform

    import torch

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else NO_CUDA,
    }
    try:
        import optree

        found["optree"] = optree.__version__
    except ImportError as error:
        found["optree"] = f"missing ({error})"
    found["driver"] = _output(
        ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
    )
    # "-dirty" where the tree differs from its commit (none in a copy without .git)
    found["commit"] = _output(["git", "describe", "--always", "--dirty", "--abbrev=7"])
    save(found)


def _output(command: list[str]) -> str:
    """What ``command`` prints, or ``""`` where it cannot run or fails."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


# The mean's factor in the pack: that of two ranks (a world of one scales by nothing).
MEAN_OF = 2
PROFILED_CALLS = 20
BUCKET_MB = 25.0
# The pack's candidates on CUDA, each timed beside the others (issue 51). The compiled pack
# is one ``fsync::pack`` op per bucket; "as shipped" runs the op's own CUDA kernels (a
# batched copy, then the scale in place), "one Triton kernel" ``benchmarks/triton_pack``'s
# copy-and-scale in one pass. The others lower the op as fsync.compile does on the CPU, to
# inductor's ``cat`` of scaled leaves, whose CUDA lowering made a copy kernel per leaf of a
# bucket of more than ``max_pointwise_cat_inputs`` (8) leaves on an H100 and an H200
# (2026-11-27); combo kernels launch such independent kernels as one, at most
# ``combo_kernel_max_num_nodes`` (8) in each. A variant's ``options`` go to fsync.compile
# on top of its own; a lowering changed behind inductor's back needs its caches off.
TRITON = "one Triton kernel"
CAT = "inductor's cat"
COMBO = {"combo_kernels": True}
COMBO_64 = {"combo_kernels": True, "combo_kernel_max_num_nodes": 64}
UNCACHED = {"fx_graph_cache": False}  # the cached graph would be another variant's
PACK_VARIANTS: dict[str, dict[str, Any]] = {
    SHIPPED: {},
    TRITON: {},
    CAT: UNCACHED,
    f"{CAT}, combo kernels, 64 a kernel": {**UNCACHED, **COMBO_64},
}


@contextlib.contextmanager
def _packing(variant: str) -> Iterator[None]:
    """``fsync::pack`` as ``variant`` makes it: through Triton, or lowered to inductor's cat."""
    from fsync import _compile

    if variant == TRITON:
        from benchmarks import triton_pack

        triton_pack.install()
        with triton_pack.using():
            yield
    elif variant.startswith(CAT):
        lowered = (_compile.FUSED_CAT_DEVICES, _compile.FUSED_CAT_LEAVES)
        _compile.FUSED_CAT_DEVICES, _compile.FUSED_CAT_LEAVES = ("cpu", "cuda"), 1 << 30
        try:
            yield
        finally:
            _compile.FUSED_CAT_DEVICES, _compile.FUSED_CAT_LEAVES = lowered
    else:
        yield


def classify(name: str, activity: str | None) -> str | None:
    """A GPU event as ``"kernel"`` or ``"copy"`` (memcpy, memset); ``None``: not work
    of its own (an annotation the profiler projects onto the GPU's timeline)."""
    if activity is not None:
        return {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "copy"}.get(activity)
    if name.startswith(("Memcpy", "Memset")):
        return "copy"
    return None if name.startswith("##") else "kernel"


def gpu_work(events: Sequence[tuple[str, str | None, float]], calls: int) -> dict[str, Any]:
    """Per call: kernels, copies and GPU microseconds of ``(name, activity, us)`` events."""
    kinds = [(classify(name, activity), us) for name, activity, us in events]
    return {
        "kernels": sum(kind == "kernel" for kind, _ in kinds) / calls,
        "copies": sum(kind == "copy" for kind, _ in kinds) / calls,
        "us": sum(us for kind, us in kinds if kind is not None) / calls,
    }


def profiled(fn: Callable[[], Any], device: Any, calls: int = PROFILED_CALLS) -> dict[str, Any]:
    """``gpu_work`` of ``calls`` calls of ``fn`` (after three more), from ``torch.profiler``.

    On a CPU ``device`` (to try the code where there is no GPU) its CPU ops count instead.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(3):
        fn()
    _synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        _synchronize(device)
    kind = torch.profiler.DeviceType.CUDA if cuda else torch.profiler.DeviceType.CPU
    events = [
        (e.name, getattr(e, "activity_type", None) if cuda else None, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == kind and not getattr(e, "is_user_annotation", False)
    ]
    return gpu_work(events, calls)


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_kernels(save: Save) -> None:
    """Pack + scale and unpack of each workload's gradient tree, compiled, taken apart;
    saved tree by tree."""
    import torch
    import torch._dynamo

    from benchmarks import models

    rows: list[dict[str, Any]] = []
    found = {"rows": rows, "mean_of": MEAN_OF, "calls": PROFILED_CALLS, "bucket_mb": BUCKET_MB}
    for make in (models.mlp, models.deep_mlp, models.gpt):
        work = make()
        for dtype in (torch.float32, torch.bfloat16):
            for variant in _known(PACK_VARIANTS):
                torch._dynamo.reset()  # each tree compiles as in a fresh process
                try:
                    with _packing(variant):
                        rows.append(_kernels_of(work, dtype, torch.device("cuda", 0), variant))
                except Exception:
                    name = str(dtype).removeprefix("torch.")  # as _kernels_of's rows say it
                    error = traceback.format_exc()
                    rows.append(
                        {"tree": work.name, "dtype": name, "variant": variant, "error": error}
                    )
                save(found)


def _known(variants: dict[str, dict[str, Any]]) -> list[str]:
    """The variants whose options this torch's inductor has (``combo_kernel_max_num_nodes``
    is newer than torch 2.11, which the lent GPUs run)."""
    from torch._inductor import config

    return [name for name, options in variants.items() if all(hasattr(config, k) for k in options)]


def _kernels_of(work: Any, dtype: Any, device: Any, variant: str = SHIPPED) -> dict[str, Any]:
    """The compiled halves of the sync of a gradient tree shaped like ``work``'s parameters.

    Pack + scale is what the compiled sync does before the collective (``fsync.pack``
    and the mean's ``1/world_size``, which ``fsync.compile`` folds into the pack);
    unpack is what it does after (``fsync.unpack`` of the reduced buckets). The
    collective itself is left out: it is the wire's, not fsync's. ``variant`` names the
    inductor options (``PACK_VARIANTS``) given to ``fsync.compile`` on top of its own;
    the caller sets up the rest of it (``_packing``).
    """
    import torch

    import fsync

    g = torch.Generator().manual_seed(0)
    grads = {
        name: torch.randn(p.shape, generator=g).to(device, dtype)
        for name, p in work.model.named_parameters()
    }
    # DDP's cap, without its first bucket of 1 MiB: the targets are about buckets of 4 MiB
    # and more, and a tree's last bucket is what is left.
    plan = fsync.plan_buckets(grads, bucket_cap_mb=BUCKET_MB, first_bucket_mb=BUCKET_MB)
    factor = 1.0 / MEAN_OF

    def pack_and_scale(tree: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [b * factor for b in fsync.pack(tree, plan)]

    def unpack(buffers: list[torch.Tensor]) -> Any:
        return fsync.unpack(buffers, plan)

    options = PACK_VARIANTS[variant]
    compiled_pack = fsync.compile(pack_and_scale, options=options)
    compiled_unpack = fsync.compile(unpack, options=options)
    started = time.perf_counter()
    buffers = compiled_pack(grads)
    leaves = compiled_unpack(buffers)
    _synchronize(device)
    compile_s = time.perf_counter() - started
    same = all(torch.equal(a, b) for a, b in zip(buffers, pack_and_scale(grads), strict=True))
    same = same and all(torch.equal(leaves[k], v) for k, v in unpack(buffers).items())
    sources = [b.clone() for b in buffers]
    sizes = [spec.numel * spec.dtype.itemsize for spec in plan.specs]
    return {
        "tree": work.name,
        "dtype": str(dtype).removeprefix("torch."),
        "variant": variant,
        "leaves": len(grads),
        "buckets": len(sizes),
        "bucket_mib": [min(sizes) / 2**20, max(sizes) / 2**20],
        "bytes": sum(sizes),
        "compile_s": compile_s,
        "same_as_eager": same,
        "pack": profiled(lambda: compiled_pack(grads), device),
        "unpack": profiled(lambda: compiled_unpack(buffers), device),
        # The floor: the same bytes read and written once, in the buckets' sizes.
        "copy": profiled(lambda: [s.clone() for s in sources], device),
    }


# The GPT's batch on a GPU: 4,096 tokens a step, enough that the step is not all launches.
GPT_BATCH, GPT_BLOCK, LR = 16, 256, 1e-3
GPT_TURNS = {"rounds": 10, "steps": 5, "warmup": 3}


def part_gpt(save: Save) -> None:
    """The compiled GPT step on one GPU against DDP eager and compiled, NCCL with one rank."""
    import torch
    import torch.distributed as dist

    from benchmarks import models

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl", init_method=f"file://{tmp}/init", rank=0, world_size=1, device_id=device
        )
        try:
            work = models.gpt(batch=GPT_BATCH, block_size=GPT_BLOCK)
            work.model.to(device)
            batches = [tuple(t.to(device) for t in work.batch(rank)) for rank in range(4)]
            save(_gpt_steps(work, batches, device))
        finally:
            dist.destroy_process_group()


def _gpt_steps(work: Any, batches: list[Any], device: Any) -> dict[str, Any]:
    """Each setting's step, the compiled fsync step's graphs counted; then all timed in turns."""
    import copy

    import torch
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fsync
    from benchmarks import harness

    calls: dict[str, Callable[[int], Any]] = {}

    def module_step(model: Any, optimizer: Any) -> Callable[[int], Any]:
        def step(k: int) -> Any:
            optimizer.zero_grad(set_to_none=True)
            loss = work.loss(model, batches[k % len(batches)])
            loss.backward()
            optimizer.step()
            return loss

        return step

    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(copy.deepcopy(work.model), device_ids=ids)
    calls["DDP eager"] = module_step(ddp, torch.optim.SGD(ddp.parameters(), lr=LR))
    ddp_c = DDP(copy.deepcopy(work.model), device_ids=ids)
    compiled_ddp = torch.compile(ddp_c)
    calls["DDP compiled"] = module_step(compiled_ddp, torch.optim.SGD(ddp_c.parameters(), lr=LR))

    optimizer = fsync.optim.sgd(LR)
    grad_fn = fsync.grad_and_value(work.functional_loss)

    def stepping(opt: Any) -> Callable[..., Any]:
        """The fsync step ``(params, opt_state, batch) -> (params, opt_state, loss)``."""

        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            grads, loss = grad_fn(params, batch)
            params, opt_state = opt.update(params, grads, opt_state)
            return params, opt_state, loss

        return step

    train_step = stepping(optimizer)
    # Eagerly the update runs torch.optim.SGD's in-place kernels, as DDP eager's step does,
    # so that the eager row compares the gradient calls; compiled, the pure one.
    eager_step = stepping(fsync.optim.sgd(LR, in_place=True))

    def functional(
        fn: Callable[..., Any], init: Callable[[Any], Any] = optimizer.init
    ) -> Callable[[int], Any]:
        """``fn(params, state, batch) -> (params, state, loss)`` as a step that threads
        both, the state starting from ``init(params)``."""
        params = work.params()
        state = {"params": params, "opt": init(params)}

        def step(k: int) -> Any:
            batch = batches[k % len(batches)]
            state["params"], state["opt"], loss = fn(state["params"], state["opt"], batch)
            return loss

        return step

    calls[EAGER] = functional(eager_step)

    def zero_call(update_in_backward: bool) -> Callable[[int], Any]:
        """ZeRO's overlapped call with AdamW, each bucket updated in or after backward
        (``update_in_backward``: which default a GPU should have; the CPU's is after)."""
        step = fsync.ops.zero(fsync.optim.adamw(LR), update_in_backward=update_in_backward)
        call = step.value_and_step(work.functional_loss)

        def train(params: Any, state: Any, batch: Any) -> Any:
            (params, loss), state = call(state, params, batch)
            return params, state, loss

        return functional(train, step.init)

    calls["ZeRO value_and_step (AdamW), update in backward"] = zero_call(True)
    calls["ZeRO value_and_step (AdamW), update after backward"] = zero_call(False)
    counters.clear()
    compiled = functional(fsync.compile(train_step))
    started = time.perf_counter()
    compiled(0)
    _synchronize(device)
    compile_s = time.perf_counter() - started
    graphs = [counters["stats"]["unique_graphs"]]
    for k in range(1, 10):  # new values at every step, the same shapes
        compiled(k)
        graphs.append(counters["stats"]["unique_graphs"])
    breaks = sum(counters["graph_break"].values())
    calls["fsync.compile, whole step"] = compiled
    # Combo kernels on the whole step (the pack's fewer launches): do they cost the rest?
    combo = functional(fsync.compile(train_step, options=COMBO))
    calls["fsync.compile, whole step, combo kernels"] = combo
    # Every round runs each setting 5 steps in a block, the GPU synchronised before and
    # after, so that a drift of the machine weighs on every setting alike.
    sync = functools.partial(_synchronize, device)
    return {
        "rounds": harness.in_turns(calls, **GPT_TURNS, before=sync, after=sync)["wall"],
        "graphs_after_step": graphs,
        "graph_breaks": breaks,
        "recompiles_after_step_2": graphs[-1] - graphs[1],
        "compile_s": compile_s,
        "params": work.num_params,
        "tokens": GPT_BATCH * GPT_BLOCK,
    }


PART_FUNCTIONS: dict[str, Callable[[Save], None]] = {
    "environment": part_environment,
    "kernels": part_kernels,
    "gpt": part_gpt,
}

# --- the command ---------------------------------------------------------------------------------


def _cuda_available(environment: Outcome | None) -> bool:
    """Whether torch sees a GPU: the environment part's answer, else this process's."""
    if environment is not None and isinstance(environment.result, dict):
        return bool(environment.result["cuda_available"])
    import torch

    return torch.cuda.is_available()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DOCS, help="the page's folder")
    names = [p.name for p in PARTS]
    only = "parts to run, comma-separated"
    parser.add_argument("--only", type=page.listed(names), default=names, help=only)
    parser.add_argument("--child", choices=sorted(PART_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=pathlib.Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:  # one part, its result as JSON
        PART_FUNCTIONS[args.child](lambda found: page.save_json(args.json, found))
        return 0
    started = time.monotonic()
    cuda = None  # as the environment part finds it (it runs first), or as torch here says
    with tempfile.TemporaryDirectory(prefix="fsync-gpu-") as tmp:
        workdir = pathlib.Path(tmp)
        env = environment_for_children(workdir / "reports")
        outcomes: dict[str, Outcome] = {}
        for part in PARTS:
            if part.name not in args.only:
                continue
            if cuda is None and part.needs_cuda:
                cuda = _cuda_available(outcomes.get("environment"))
            print(f"--- {part.name} (limit {part.limit_s:.0f} s)", flush=True)
            outcomes[part.name] = outcome = run_part(part, bool(cuda), workdir, env)
            print(f"    {outcome.status} in {outcome.seconds:.0f} s {outcome.note}", flush=True)
        reports = read_reports(workdir / "reports")
    cuda = _cuda_available(outcomes.get("environment")) if cuda is None else cuda
    text = render(outcomes, reports, cuda=cuda, seconds=time.monotonic() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / PAGE).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
