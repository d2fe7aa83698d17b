"""docs/benchmarks-gpu.md from what ``benchmarks/gpu.py``'s parts found.

Each section makes its table and its lines of the targets table from one part's result
(or the CUDA tests' reports); a part that was skipped, failed or ran over its limit is
said so in its section, and its targets read "not measured". Nothing here runs anything.
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

from benchmarks import table
from benchmarks.table import Target

# The targets.
MOST_KERNELS = 2  # per bucket, each way
LEAST_OF_COPY = 0.8  # pack and unpack bandwidth, of a device-to-device copy of the same bytes
FROM_MIB = 4  # ... for buckets this large and larger
SHIPPED = "as shipped"  # the pack's kernels with fsync.compile's options alone
EAGER = "fsync.grad_and_value, eager"  # the GPT part's eager fsync step, in-place SGD


class Outcome(NamedTuple):
    """How a part ended: ``status`` is ok, failed, timed out or skipped; ``result`` what it
    found (JSON), ``note`` why it was skipped or the end of its output where it failed."""

    status: str
    seconds: float
    limit_s: float
    result: Any = None
    note: str = ""


class Section(NamedTuple):
    """A section of the page and its lines of the targets table."""

    lines: list[str]
    targets: list[Target]


def render(
    outcomes: dict[str, Outcome], reports: dict[str, Any], *, cuda: bool, seconds: float
) -> str:
    """The page: what ran where, the targets, then a section per part."""
    tests = outcomes.get("tests")
    sections = [
        _tests(tests),
        _parity(tests, reports),
        _streams(tests, reports),
        _kernels(outcomes.get("kernels")),
        _gpt(outcomes.get("gpt")),
    ]
    parts = [[n, o.status, f"{o.seconds:.0f}", f"{o.limit_s:.0f}"] for n, o in outcomes.items()]
    targets = [[what, found, _verdict(met)] for s in sections for what, found, met in s.targets]
    lines = [
        *_intro(outcomes.get("environment"), cuda, seconds),
        table.markdown(["Part", "Status", "Seconds", "Limit (s)"], parts),
        "",
        *table.section(("Targets", ["Target", "Found", ""], targets)),
    ]
    for section in sections:
        lines += section.lines
    return "\n".join(lines).rstrip() + "\n"


def _intro(environment: Outcome | None, cuda: bool, seconds: float) -> list[str]:
    facts = _result(environment, dict) or {}
    today = datetime.date.today().isoformat()
    if cuda:
        where = (
            f"Measured {today} by `python benchmarks/gpu.py` in {seconds / 60:.1f} minutes on "
            f"{facts.get('device', 'a GPU')} (driver, memory: {facts.get('driver') or '?'}), "
            f"torch {facts.get('torch', '?')}, CUDA {facts.get('cuda', '?')}, Python "
            f"{facts.get('python', '?')}, optree {facts.get('optree', '?')}, fsync at "
            f"{facts.get('commit') or '?'}."
        )
    else:
        where = (
            f"**Not yet run on a GPU.** Written {today} on a machine without a CUDA device "
            f"(torch {facts.get('torch', '?')}), where every part that needs one is skipped. "
            "`python benchmarks/gpu.py` on a machine with a GPU fills this page in; its "
            "docstring says what to carry to this project's GPU machines."
        )
    return [
        "# On a GPU",
        "",
        "<!-- Written by benchmarks/gpu.py: run it again rather than edit this page. -->",
        "",
        where,
        "",
        "What runs: the CUDA tests of the suite; two ranks sharing the GPU over gloo with CUDA "
        "tensors (NCCL refuses two ranks on one device), every entry point against DDP in the "
        "same processes; the eager gradient call's stream handoff under stress; the compiled "
        "sync's kernels under `torch.profiler`; the compiled GPT step on one GPU (NCCL, one "
        "rank) against DDP. Each part runs in a process of its own under a time limit.",
        "",
    ]


# --- the sections --------------------------------------------------------------------------------


def _tests(outcome: Outcome | None) -> Section:
    found = _result(outcome, list) or []
    target = "Every CUDA test passes"
    command = "`python -m pytest tests/test_cuda.py tests/test_cuda_streams.py` on the GPU."
    lines = table.heading("1. The CUDA tests", command)
    if not found:
        return Section(lines + _not_run(outcome, "pytest"), [(target, "-", None)])
    counts = {kind: sum(t["outcome"] == kind for t in found) for kind in ("passed", "skipped")}
    bad = len(found) - counts["passed"] - counts["skipped"]
    words = f"{counts['passed']} passed, {bad} failed, {counts['skipped']} skipped"
    met = counts["passed"] == len(found) and outcome is not None and outcome.status == "ok"
    rows = [
        [f"`{t['test']}`", t["outcome"], _number(t["seconds"], ".1f"), t["message"]] for t in found
    ]
    lines += [table.markdown(["Test", "Outcome", "Seconds", "Message"], rows), ""]
    if outcome is not None and outcome.status != "ok":
        lines += _not_run(outcome, "pytest")
    return Section(lines, [(target, words, met)])


def _parity(tests: Outcome | None, reports: dict[str, Any]) -> Section:
    rows = [
        r for name in ("entry_points", "hooks", "zero", "deferred") for r in reports.get(name, [])
    ]
    exact = [r for r in rows if r["expected"].startswith("bit for bit")]
    target = "2 ranks over gloo with CUDA tensors: DDP's results bit for bit where layouts agree"
    found = f"{sum(r['ok'] for r in exact)} of {len(exact)} checks" if exact else "-"
    targets = [(target, found, all(r["ok"] for r in exact) if exact else None)]
    lines = table.heading(
        "2. Two ranks on one GPU over gloo, CUDA tensors, against DDP",
        "Each check runs on both ranks; a row holds the worse of the two. On two ranks the mean "
        "`a * 0.5 + b * 0.5` is the exact mean rounded once, whatever the bucket layout: "
        "fsync's results must be DDP's bit for bit wherever the local gradients are "
        "(`torch.func.grad` against autograd on the module, a test's first row). Hooks without "
        "a DDP counterpart that runs here are checked against the same sync of the same "
        "gradients as CPU tensors, but quantisation against DDP's hook operations step by step "
        "on the GPU (CUDA divides by a Python number as a product by its reciprocal, and so do "
        "DDP's hooks there). From `tests/test_cuda.py`.",
    )
    if not rows:
        return Section(lines + _no_figures(tests), targets)
    cells = [
        [
            r["check"],
            r["reference"],
            r["expected"],
            "yes" if r["bitwise"] else "no",
            f"{r['max_diff']:.3g}",
            "ok" if r["ok"] else "**fails**",
        ]
        for r in rows
    ]
    header = ["Check", "Reference", "Asked", "Bit for bit", "Max abs difference", ""]
    return Section([*lines, table.markdown(header, cells), ""], targets)


def _streams(tests: Outcome | None, reports: dict[str, Any]) -> Section:
    runs = [run for name, run in sorted(reports.items()) if name.startswith("streams_")]
    target = "Stream handoff under stress: DDP's results at every step, and not without the wait"
    met = None
    if runs:
        met = all((r["equal"] == r["steps"]) == (r["patch"] == "as shipped") for r in runs)
    found = "; ".join(f"{r['setting']}, {r['patch']}: {r['equal']}/{r['steps']}" for r in runs)
    lines = table.heading(
        "3. The eager gradient call's stream handoff, under stress",
        "`fsync.grad_and_value` on two ranks with the forward pass (so autograd's copies into "
        "the buckets) on side streams, and a sleep queued on the producing stream before every "
        "layer's backward; DDP on the same processes is the reference at every step. Busy: the "
        "steps where the producing streams still had work queued when the first bucket was "
        "issued. The patched runs remove fsync's wait before issuing (`_DeviceOrder.wait`), or "
        "keep only the event of the stream that completed the bucket (fsync before it waited "
        "for every stream that wrote into one): they must differ from DDP, or the check has no "
        "teeth. From `tests/test_cuda_streams.py`.",
    )
    if not runs:
        return Section(lines + _no_figures(tests), [(target, "-", None)])
    cells = [
        [
            r["setting"],
            r["patch"],
            f"{r['layers']} layers, {r['buckets']} buckets",
            r["steps"],
            r["busy"],
            r["equal"],
            f"{r['max_diff']:.3g}",
            "yes" if r["premise"] else "**no**",
        ]
        for r in runs
    ]
    header = ["Streams", "Run", "Model", "Steps", "Busy", "Equal to DDP", "Max abs difference"]
    header.append("Local gradients are autograd's")
    return Section([*lines, table.markdown(header, cells), ""], [(target, found, met)])


def _kernels(outcome: Outcome | None) -> Section:
    result = _result(outcome, dict) or {}
    rows = result.get("rows", [])
    # The targets are the shipped settings'; the other variants are trials beside them.
    good = [r for r in rows if "error" not in r and r.get("variant", SHIPPED) == SHIPPED]
    mean = f"`1/{result['mean_of']}`" if "mean_of" in result else "factor"
    calls = f" over {result['calls']} calls" if "calls" in result else ""
    cap = f"{result['bucket_mb']:g} MiB" if "bucket_mb" in result else "DDP's cap"
    lines = table.heading(
        "4. The compiled sync's kernels",
        "Gradient trees shaped like each workload's parameters, in DDP's bucket layout with "
        f"buckets of {cap} from the first (DDP's first is 1 MiB; the targets concern buckets of "
        f"{FROM_MIB} MiB and more). Pack + scale is `fsync.pack` and a mean's {mean} under "
        "`fsync.compile`, which folds the product into the pack: what the compiled sync does "
        "before its collective. Unpack is `fsync.unpack` of the buckets: what it does after. "
        f"Kernels and GPU time per call are `torch.profiler`'s{calls}; bandwidth counts "
        "the bytes read and written once; the copy is a device-to-device copy of the same bytes "
        "in the buckets' sizes. Unpack gives views of the buckets where the layouts allow: no "
        "kernel, no bytes.",
    )
    targets: list[Target] = [
        (f"Compiled sync: at most {MOST_KERNELS} kernels per bucket each way", "-", None),
        (
            f"Pack and unpack at >= {LEAST_OF_COPY:.0%} of a device-to-device copy's bandwidth, "
            f"trees whose buckets are all >= {FROM_MIB} MiB",
            "-",
            None,
        ),
    ]
    if good:
        most = max(max(r["pack"]["kernels"], r["unpack"]["kernels"]) / r["buckets"] for r in good)
        targets[0] = (targets[0][0], f"at most {most:.2f}", most <= MOST_KERNELS)
        large = [r for r in good if r["bucket_mib"][0] >= FROM_MIB]
        measured = [_of_copy(r, half) for r in large for half in ("pack", "unpack")]
        ratios = [ratio for ratio in measured if ratio is not None]
        if ratios:
            words = f"lowest {min(ratios):.0%}, {len(large)} trees"
            targets[1] = (targets[1][0], words, min(ratios) >= LEAST_OF_COPY)
        else:
            targets[1] = (targets[1][0], f"no tree has only buckets >= {FROM_MIB} MiB", None)
    if not rows:
        return Section(lines + _not_run(outcome), targets)
    cells = [_kernel_row(r) for r in rows]
    header = ["Tree", "Dtype", "Inductor options", "Buckets"]
    header += ["Pack kernels / bucket", "Unpack kernels / bucket"]
    header += ["Pack GB/s (of copy)", "Unpack GB/s (of copy)", "Copy GB/s", "Compile s"]
    header += ["Same bits as eager"]
    lines += [table.markdown(header, cells), ""]
    if outcome is not None and outcome.status != "ok":
        lines += _not_run(outcome, "The part")
    return Section(lines, targets)


def _kernel_row(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        failed = [r["tree"], r["dtype"], r.get("variant", SHIPPED), "**failed**"]
        return [*failed, _shortened(r["error"].strip().splitlines()[-1])] + [""] * 6
    moved = 2 * r["bytes"]
    buckets = f"{r['buckets']} ({r['bucket_mib'][0]:.1f} to {r['bucket_mib'][1]:.1f} MiB)"

    def speed(half: str) -> str:
        ratio = _of_copy(r, half)
        return "views" if ratio is None else f"{_gbs(moved, r[half]['us'])} ({ratio:.0%})"

    return [
        r["tree"],
        r["dtype"],
        r.get("variant", SHIPPED),
        buckets,
        f"{r['pack']['kernels'] / r['buckets']:.2f}",
        f"{r['unpack']['kernels'] / r['buckets']:.2f}",
        speed("pack"),
        speed("unpack"),
        _gbs(moved, r["copy"]["us"]),
        f"{r['compile_s']:.1f}",
        "yes" if r["same_as_eager"] else "**no**",
    ]


def _gpt(outcome: Outcome | None) -> Section:
    figures = _result(outcome, dict)
    clean = "Compiled GPT step: no graph break, no recompile after step 2"
    fast = "Compiled GPT step at world 1 no slower than DDP compiled"
    eager = "Eager GPT step at world 1 (`fsync.grad_and_value`) <= 1.05x DDP eager"
    lines = table.heading(
        "5. The compiled GPT step on one GPU",
        "`benchmarks/models.py`'s GPT, NCCL with one rank (fsync issues no collective there, "
        "DDP its all-reduces), SGD. The fsync step is `fsync.grad_and_value` then "
        "`fsync.optim.sgd`'s update, all under `fsync.compile`; DDP compiled is `torch.compile` "
        "of the DDP module, its optimizer eager. The eager fsync step updates with "
        "`fsync.optim.sgd(lr, in_place=True)`, the kernels of DDP eager's `torch.optim.SGD`. "
        "Milliseconds per step, the settings timed in "
        "turns: the median over 10 rounds of 5 steps each; a ratio is taken round by round and "
        "given as `median [lowest, highest]` over the rounds; the target is judged on the "
        "median.",
    )
    if figures is None:
        untimed: list[Target] = [(clean, "-", None), (fast, "-", None), (eager, "-", None)]
        return Section(lines + _not_run(outcome), untimed)
    breaks, recompiles = figures["graph_breaks"], figures["recompiles_after_step_2"]
    row: Any = {"rounds": figures["rounds"]}
    ratio = table.ratio(row, "fsync.compile, whole step", "DDP compiled")
    cells = [
        [
            name,
            f"{table.median(row, name):.2f}",
            table.spread(table.ratio(row, name, "DDP compiled")),
        ]
        for name in row["rounds"]
    ]
    lines += [
        table.markdown(["Setting", "ms per step", "vs DDP compiled"], cells),
        "",
        f"{figures['params']:,} parameters, {figures['tokens']:,} tokens a step. The fsync step "
        f"compiled in {figures['compile_s']:.0f} s; graph breaks: {breaks}; graphs compiled "
        f"after each of its first steps: {figures['graphs_after_step']}.",
        "",
    ]
    targets: list[Target] = [
        (clean, f"{breaks} graph breaks, {recompiles} recompiles", breaks == 0 and not recompiles),
        (fast, table.spread(ratio), ratio.median <= 1.0),
    ]
    # ``ran``: a run from before the row existed has no such setting ("not run").
    targets.append(table.check(eager, table.ran(row, EAGER, "DDP eager"), 1.05))
    return Section(lines, targets)


# --- pieces --------------------------------------------------------------------------------------


def _result(outcome: Outcome | None, kind: type) -> Any:
    """The part's result if it is a ``kind`` (a part that died may have left none)."""
    return outcome.result if outcome is not None and isinstance(outcome.result, kind) else None


def _not_run(outcome: Outcome | None, what: str = "This part") -> list[str]:
    """Why a part gave no figures (or not all): skipped, failed or ran over its limit."""
    if outcome is None:
        return ["Not run: not asked for (`--only`).", ""]
    if outcome.status == "skipped":
        return [f"skipped: {outcome.note}", ""]
    lines = [
        f"{what} {outcome.status} after {outcome.seconds:.0f} s (limit {outcome.limit_s:.0f} s)."
    ]
    if outcome.note:
        lines += ["", "```text", outcome.note, "```"]
    return [*lines, ""]


def _no_figures(tests: Outcome | None) -> list[str]:
    if tests is None or tests.status != "ok":
        return _not_run(tests, "pytest")
    return ["No figures: the tests that make them did not report (see section 1).", ""]


def _of_copy(row: dict[str, Any], half: str) -> float | None:
    """A half's bandwidth as a share of the copy's (the copy's GPU time over the half's);
    ``None`` where the half launched nothing (views)."""
    us = row[half]["us"]
    return row["copy"]["us"] / us if row[half]["kernels"] and us > 0 else None


def _shortened(message: str, most: int = 200) -> str:
    """``message`` cut to ``most`` characters (inductor lists every option it knows)."""
    return message if len(message) <= most else message[: most - 3] + "..."


def _gbs(nbytes: float, us: float) -> str:
    return f"{nbytes / us / 1e3:.0f}" if us > 0 else "-"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "**not met**")
