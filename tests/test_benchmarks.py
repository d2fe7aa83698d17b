"""The benchmark suite runs end to end at tiny sizes; its targets read the right figures;
its harness takes turns between settings in processes of their own.

The real numbers come from ``python benchmarks/run.py`` on a quiet machine (see
``docs/benchmarks.md``); here only that every page runs and that its report is complete
(the pages of one smoke run for the whole session: the ``smoke_pages`` fixture).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import sys
import time
from collections.abc import Callable

import pytest
import torch
import torch._inductor.cpu_vec_isa
import torch._inductor.fx_passes.joint_graph
import torch._inductor.fx_passes.post_grad
import torch.distributed as dist
import torch.hub

from benchmarks import ft, harness, link, page, run, steps, table, twonodes, zero
from benchmarks.harness import Built, UnavailableError
from tests._launch import PAGES_TIMEOUT_S, bounded

PNG = b"\x89PNG\r\n\x1a\n"


# --- settings whose time is known, built in the harness's processes ----------------------------


def sleeper(ms: float) -> Callable[[], None]:
    """A step that all-reduces one float, then sleeps ``ms``."""
    x = torch.ones(1)

    def step() -> None:
        dist.all_reduce(x)
        time.sleep(ms / 1000)

    return step


def refused() -> Callable[[], None]:
    """A setting that cannot run here, on every rank."""
    raise UnavailableError("not on this machine")


def broken() -> Callable[[], None]:
    """A setting whose rank 1 fails as it builds, while rank 0 goes on and waits for it."""
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 cannot build this setting")
    return sleeper(1)


def forked_knowing() -> Built:
    """A step that does nothing; its info says what this process started knowing (worked out
    in its server, not by itself): the vector instruction sets inductor may use, and the
    graph passes' patterns (the joint graph's for no device and for the CPU, the post-grad
    ones); and whether tqdm's monitor thread was stopped in the server before it forked (a
    child thinks one runs, and starts none, where the server's was running)."""
    known = {
        "vector ISAs known": torch._inductor.cpu_vec_isa.valid_vec_isa_list,
        "joint-graph patterns known": torch._inductor.fx_passes.joint_graph.lazy_init,
        "post-grad patterns known": torch._inductor.fx_passes.post_grad.lazy_init,
    }
    info = {what: fn.cache_info().currsize for what, fn in known.items()}
    monitor = getattr(torch.hub.tqdm, "monitor", None)
    info["no tqdm monitor thought to run"] = monitor is None or not monitor.report()
    return Built(lambda: None, lambda: info)


# --- the harness --------------------------------------------------------------------------------


def _row(**rounds: list[float]) -> harness.Row:
    """A row of turns with these ms per round, nothing else."""
    return {"rounds": rounds, "memory": {}, "info": {}, "unavailable": {}, "turns": []}


def _one(**ms: float) -> harness.Row:
    """A row of one round."""
    return _row(**{name: [x] for name, x in ms.items()})


@pytest.mark.timeout(120)
def test_settings_take_turns_each_in_processes_of_its_own():
    settings = [
        harness.Setting("A", functools.partial(sleeper, ms=20)),
        harness.Setting("B", functools.partial(sleeper, ms=40)),
        harness.Setting("C", refused),
    ]
    row = harness.turns(settings, rounds=4, steps=2, warmup=1)
    assert row is not None
    # A B A B ...: every round, each live setting once, in order; C never ran, saying why.
    assert [t["setting"] for t in row["turns"]] == ["A", "B"] * 4
    assert [t["round"] for t in row["turns"]] == [r for r in range(4) for _ in "AB"]
    assert row["unavailable"] == {"C": "not on this machine"}
    # Each setting in processes of its own: one pid per setting, not this one, not shared.
    pids = {name: {t["pid"] for t in row["turns"] if t["setting"] == name} for name in "AB"}
    assert all(len(p) == 1 for p in pids.values()) and pids["A"] != pids["B"], pids
    assert os.getpid() not in pids["A"] | pids["B"]
    # One turn at a time: each starts after the one before it ended.
    turns = row["turns"]
    assert all(b["start"] >= a["end"] for a, b in itertools.pairwise(turns)), turns
    # The ratio is reported as its spread over the four rounds. B sleeps twice as long as
    # A; the collectives and the timer add a little to both (the bounds leave room for a
    # loaded machine).
    spread = table.ratio(row, "B", "A")
    assert len(row["rounds"]["B"]) == 4
    assert spread.low <= spread.median <= spread.high
    assert 1.4 < spread.median < 2.4, spread
    assert table.spread(spread).startswith(f"{spread.median:.2f}x [{spread.low:.2f}, ")
    assert set(row["memory"]["A"]) == {"built", "warm", "peak", "since start"}


@pytest.mark.timeout(120)
def test_a_failed_setting_stops_every_process_and_names_itself():
    fine = harness.Setting("fine", functools.partial(sleeper, ms=1))
    failing = harness.Setting("broken", broken)
    # Rank 0 of "broken" waits in its warm-up's collective for a rank that is gone (and may
    # fail and exit too once rank 1's sockets close); the turns end at once all the same,
    # naming the setting, the rank and the error that came first.
    cause = re.escape("setting 'broken', rank 1: RuntimeError('rank 1 cannot build this setting')")
    with pytest.raises(RuntimeError, match=f"^{cause}$"):
        harness.turns([fine, failing], rounds=2, steps=1, warmup=1)


@pytest.mark.timeout(120)
def test_processes_start_knowing_what_inductor_asks_each_process_once():
    # The server's preload probed the vector instruction sets (a kernel loaded in a fresh
    # interpreter per candidate, 1.2-2.5 s of every process's first compile) and traced the
    # graph passes' patterns (~0.6 s of CPU of a process's first compile with a cold cache):
    # each process forked from it has them before it compiles anything. Tracing the patterns
    # started tqdm's monitor thread in the server, stopped before it forked.
    row = harness.turns([harness.Setting("forked", forked_knowing)], rounds=1, steps=1, warmup=0)
    assert row is not None
    expected = {
        "vector ISAs known": 1,
        "joint-graph patterns known": 2,
        "post-grad patterns known": 1,
        "no tqdm monitor thought to run": True,
    }
    assert row["info"]["forked"] == [expected, expected]


@pytest.mark.parametrize("module", [run, link, twonodes, ft], ids=lambda m: m.__name__)
def test_every_page_takes_the_same_flags(module, capsys):
    made = module.PAGE
    full, smoke = page.parse(made, [], ""), page.parse(made, ["--smoke"], "")
    assert (full.rounds, full.steps, full.warmup) == made.timing
    assert (smoke.rounds, smoke.steps, smoke.warmup) == page.SMOKE
    assert page.parse(made, ["--smoke", "--rounds", "3"], "").rounds == 3
    if made.rates:  # every rate by default, the local one with --smoke; no rate it lacks
        assert (full.rates, smoke.rates) == (list(made.rates), list(made.smoke_rates))
        assert full.tool.name == made.tool
        with pytest.raises(SystemExit):
            page.parse(made, ["--rates", "3gbit"], "")
        assert "--rates: ['3gbit']; choose from" in capsys.readouterr().err


def test_a_ratio_is_taken_round_by_round():
    # Round 1: 90 / 100, round 2: 121 / 110; the medians' ratio (105.5 / 105) says neither.
    spread = table.ratio(_row(a=[100.0, 110.0], b=[90.0, 121.0]), "b", "a")
    assert spread == pytest.approx(table.Spread(0.9, 1.0, 1.1))
    assert table.spread(spread) == "1.00x [0.90, 1.10]"


@pytest.mark.page("main")
@pytest.mark.timeout(PAGES_TIMEOUT_S + 60)
def test_smoke_run_writes_every_section(smoke_pages):
    md = (smoke_pages / "benchmarks.md").read_text()
    for section in ("Targets", "1. Step time, MLP", "1b. Overlap", "2. Sync", "3. Leaf scaling"):
        assert f"## {section}" in md
    for section in ("4. Hooks", "5. Host cost", "6. The compiled sync", "7. GPU"):
        assert f"## {section}" in md
    # Each eager call beside its DDP counterpart, on one rank and two.
    host = md.split("## 5. Host cost")[1].split("\n## ")[0]
    assert "world 1: ms" in host and "world 2: ms" in host
    calls = (steps.FSYNC_CALL, steps.FSYNC_AFTER_BACKWARD, steps.FSYNC_POWERSGD)
    for name in (*calls, zero.VALUE_AND_STEP):
        assert f"| {name} | " in host and "x [" in host.split(f"| {name} | ")[1]
    assert "fsync.grad_and_value <= 1.00 x DDP" in md
    assert f"{steps.FSYNC_AFTER_BACKWARD} <= 1.10 x DDP" in md
    for row in (
        run.OVERLAP,
        run.GRAD_AND_VALUE,
        "local functional eager (no sync)",
        run.AGREEMENT,
        run.PURE_MEAN,
        "pack + unpack, compiled",
    ):
        assert f"| {row} |" in md
    # Every ratio is a spread over the rounds: median (lowest-highest).
    assert f"| {run.OVERLAP} | " in md and "x [" in md.split(f"| {run.OVERLAP} | ")[1]
    assert "pack + unpack kernels per bucket <= 2 (cpu)" in md
    for png in ("step", "leaves", "hooks"):
        assert (smoke_pages / f"benchmarks-{png}.png").read_bytes()[:8] == PNG


@pytest.mark.timeout(180)
def test_timeline_tells_when_each_setting_issued_its_buckets():
    args = ["--smoke", "--workload", "GPT"]
    command = [sys.executable, "-m", "benchmarks.timeline", *args]
    out = bounded(command, 160, " ".join(command))
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    times = {(r[0].strip(), r[1].strip()): [float(x) for x in r[2:]] for r in rows[1:]}
    assert set(times) == {(s, r) for s in ("DDP eager", "fsync.grad_and_value") for r in "01"}
    # Each call's events in the order they happen: forward, first and last bucket, return.
    assert all(row == sorted(row) and row[0] > 0 for row in times.values()), times


@pytest.mark.page("link")
@pytest.mark.timeout(PAGES_TIMEOUT_S + 60)
def test_smoke_run_writes_the_slow_link_page(smoke_pages):
    # Smoke: the unshaped loopback only, so no root is needed; one row of steps (the MLP
    # the rate table reads; the other workloads take the same path).
    md = (smoke_pages / "benchmarks-link.md").read_text()
    for section in (
        "Targets",
        "Step time against link rate",
        "Every workload: step time relative to DDP eager",
        "Memory: peak RSS of the eager step",
        "the sync alone",
        "ZeRO, AdamW: deep MLP, batch 256, unshaped",
        "ZeRO memory: peak RSS of the eager steps",
    ):
        assert section in md, section
    for setting in link.SETTINGS:
        assert f"| {setting}: share of the all-reduce hidden |" in md
    assert "| MLP, batch 256, unshaped |" in md  # the smoke run's one row of steps
    for row in ("deep MLP: DDP eager", "deep MLP: fsync eager, grad_and_value"):
        assert f"| {row} |" in md
    assert "| GPT, batch 64: grad_and_value eager <= 1.05x DDP eager, unshaped | not run |" in md
    memory = "deep MLP, batch 256: grad_and_value eager's peak RSS <= DDP eager's + one bucket"
    assert memory in md
    # ZeRO: every setting has a row; torch's overlapped ZeRO refuses gloo, and says so.
    for setting in (zero.REFERENCE, zero.EAGER, zero.WHOLE, zero.COMPILED, zero.RSAG):
        assert f"| {setting} | " in md, setting
    for setting in zero.TORCH_OVERLAP:
        assert f"| {setting} | not run: torch raises `RuntimeError: Gloo backend" in md
    for setting in (zero.VALUE_AND_STEP, zero.VALUE_AND_STEP_COMPILED):
        assert f"| {setting} | " in md, setting
    for png in ("step", "hidden", "workloads", "workloads-hidden", "memory"):
        assert (smoke_pages / f"benchmarks-link-{png}.png").read_bytes()[:8] == PNG


@pytest.mark.page("twonodes")
@pytest.mark.timeout(PAGES_TIMEOUT_S + 60)
def test_smoke_run_writes_the_two_node_page(smoke_pages):
    # Smoke: worlds of 4 ranks on this machine's loopback, without twonodes or root; the
    # sync alone on one tree (the GPT's gradients take the same path).
    md = (smoke_pages / "benchmarks-twonodes.md").read_text()
    for section in (
        "## Targets",
        f"## The sync alone: {twonodes.TREE}",  # the smoke run's one tree
        "## The GPT's training step on 2 nodes x 2 ranks",
    ):
        assert section in md, section
    for setting in (*twonodes.SYNC_SETTINGS, *twonodes.STEP_SETTINGS):
        assert f"| {setting} |" in md, setting
    # The rates of the real run were not run: their targets say so.
    target = f"GPT step: {twonodes.STEP_HIER_COMPILED} <= 0.80x DDP eager, 1 Gbit/s"
    assert f"| {target} | not run | - |" in md
    # What crosses nodes does not depend on the rate: the floors of the ring model.
    cells = [line.split(" | ") for line in md.splitlines() if line.startswith("| ")]
    rows = {row[0][2:]: row[2] for row in cells if len(row) > 3}  # the settings' tables
    assert rows[twonodes.HIER] == rows[twonodes.HIER_COMPILED] == "0.67x"
    assert rows[twonodes.HIER_BF16] == "0.33x"
    for png in ("sync", "step", "bytes"):
        assert (smoke_pages / f"benchmarks-twonodes-{png}.png").read_bytes()[:8] == PNG


def _link_row(**settings: float) -> harness.Row:
    """A slow-link row of one round: 100 ms of compute for every floor, a 50 ms all-reduce,
    ``settings``."""
    return _one(
        **dict.fromkeys(link.FLOORS, 100.0), **{link.FLAT: 50.0, link.CEILING: 120.0}, **settings
    )


def test_link_targets_read_the_right_rows():
    gpt = _link_row(**{"DDP eager": 130.0, link.GAV: 126.0, "fsync compiled": 120.0})
    deep = _link_row(**{"DDP eager": 120.0, link.GAV: 125.0, "fsync compiled": 117.0})
    peaks = {"DDP eager": 600.0, link.GAV: 603.0}
    memory = _one()
    memory["memory"] = {s: {"built": 500.0, "peak": v} for s, v in peaks.items()}
    results = {
        "8gbit": {"GPT, batch 256": gpt, "deep MLP, batch 64": deep},
        "unshaped": {"GPT, batch 256": gpt, "memory": {"GPT": memory}},
    }
    got = {name: (measured, met) for name, measured, met in link.targets(results)}
    # DDP hides (100 + 50 - 130) / 50 = 40%, grad_and_value (100 + 50 - 126) / 50 = 48%.
    assert got["GPT, batch 256: grad_and_value eager <= 1.00x DDP eager, 8 Gbit/s"] == (
        "0.97x [0.97, 0.97]",
        True,
    )
    assert got["GPT, batch 256: grad_and_value eager hides >= DDP eager's share, 8 Gbit/s"] == (
        "48% vs 40%",
        True,
    )
    assert got["GPT, batch 256: fsync compiled <= 0.90x DDP eager, 8 Gbit/s"] == (
        "0.92x [0.92, 0.92]",
        False,
    )
    assert got["deep MLP, batch 64: grad_and_value eager hides >= DDP eager's share, 8 Gbit/s"] == (
        "50% vs 60%",
        False,
    )
    assert got["deep MLP, batch 64: fsync compiled <= 1.00x DDP eager, 8 Gbit/s"] == (
        "0.97x [0.97, 0.97]",
        True,
    )
    assert got["GPT, batch 256: grad_and_value eager <= 1.05x DDP eager, unshaped"] == (
        "0.97x [0.97, 0.97]",
        True,
    )
    assert got["GPT, batch 64: grad_and_value eager <= 1.00x DDP eager, 8 Gbit/s"] == (
        "not run",
        None,
    )
    memory_target = (
        "GPT, batch 256: grad_and_value eager's peak RSS <= DDP eager's + one bucket (4 MiB)"
    )
    assert got[memory_target] == ("+3.0 MiB (+0.75 buckets)", True)


def test_zero_targets_and_shares_read_the_right_rows():
    floors = {zero.MODULE_FLOOR: 100.0, zero.FUNCTIONAL_FLOOR: 110.0, zero.COMPILED_FLOOR: 90.0}
    row = _one(**floors, **{zero.RSAG: 50.0, zero.REFERENCE: 140.0, zero.EAGER: 150.0})
    # The reference hides (100 + 50 - 140) / 50 = 20% of RS/AG; fsync eager (110 + 50 - 150) / 50.
    assert zero.hidden(row, zero.REFERENCE).median == pytest.approx(0.2)
    assert zero.hidden(row, zero.EAGER).median == pytest.approx(0.2)
    steps = {zero.VALUE_AND_STEP: 130.0, zero.VALUE_AND_STEP_COMPILED: 145.0}
    row["rounds"] |= {name: [ms] for name, ms in steps.items()}
    memory = _one()
    peaks = {zero.EAGER: 700.0, zero.VALUE_AND_STEP: 705.0}
    memory["memory"] = {name: {"built": 600.0, "peak": peak} for name, peak in peaks.items()}
    got = {
        n: (m, ok) for n, m, ok in zero.targets({"8gbit": {"GPT, batch 256": row}}, {"GPT": memory})
    }
    vs = f"{zero.REFERENCE}, 8 Gbit/s"
    eager = f"ZeRO, GPT, batch 256: {zero.VALUE_AND_STEP} <= 0.95x {vs}"
    assert got[eager] == ("0.93x [0.93, 0.93]", True)
    compiled = f"ZeRO, GPT, batch 256: {zero.VALUE_AND_STEP_COMPILED} <= 0.85x {vs}"
    assert got[compiled] == ("1.04x [1.04, 1.04]", False)
    other = f"ZeRO, deep MLP, batch 64: {zero.VALUE_AND_STEP} <= 0.95x {vs}"
    assert got[other] == ("not run", None)
    unshaped = f"ZeRO, GPT, batch 256: {zero.VALUE_AND_STEP} <= 0.95x {zero.REFERENCE}, unshaped"
    assert got[unshaped] == ("not run", None)
    # Shares hidden, each against its own compute: eager (110 + 50 - 130) / 50 = 60 %,
    # compiled (90 + 50 - 145) / 50 = -10 %.
    hides = "ZeRO, GPT, batch 256: {} hides >= 40% of its RS/AG, 8 Gbit/s"
    assert got[hides.format(zero.VALUE_AND_STEP)] == ("60% [60%, 60%]", True)
    assert got[hides.format(zero.VALUE_AND_STEP_COMPILED)] == ("-10% [-10%, -10%]", False)
    # The overlapped call may hold one bucket more than the step after backward, no more.
    peak = "ZeRO, GPT: value_and_step eager's peak RSS <= fsync zero eager's + one bucket"
    assert got[peak] == ("+5.0 MiB (+1.25 buckets)", False)


def test_targets_are_ratios_of_the_right_figures():
    step = _one(
        **{
            "DDP eager": 100.0,
            "DDP compiled": 80.0,
            "fsync eager": 110.0,
            run.OVERLAP: 84.0,
            run.AGREEMENT: 0.5,
        }
    )
    anatomy = _one(**{run.COPY: 4.0, "pack + unpack, compiled": 4.8})
    anatomy["info"] = {
        run.COMPILED_SYNC: [{"device": "cuda:0", "buckets": 4, "kernels": 6, "recompiles": 0}]
    }
    results = {
        "step": {"MLP": step},
        "sync": _one(**{run.FLAT: 10.0, "sync_grads eager": 12.0, "sync_grads compiled": 10.5}),
        "leaves": _one(**{"compiled 1": 2.0, "compiled 100": 2.2, "compiled 10000": 2.8}),
        "anatomy": anatomy,
        "gpu": "No CUDA device in this run.",
    }
    got = {name: (measured, met) for name, measured, met in run.targets(results)}
    assert got["MLP: fsync compiled <= 0.85 x DDP eager"] == ("0.84x [0.84, 0.84]", True)
    assert got["MLP: fsync compiled <= DDP compiled"] == ("1.05x [1.05, 1.05]", False)
    assert got["MLP: the ranks' agreement < 1% of the fsync eager step"][1] is True
    assert got["sync only (compiled) <= 1.10 x flat all-reduce"] == ("1.05x [1.05, 1.05]", True)
    assert got["sync only (eager) <= 1.10 x flat all-reduce"] == ("1.20x [1.20, 1.20]", False)
    assert got["compiled sync of 10,000 leaves <= 1.3 x 1 leaf"] == ("1.40x [1.40, 1.40]", False)
    assert got["pack + unpack kernels per bucket <= 2 (cuda:0)"] == ("1.5", True)
    assert got["pack + unpack >= 80% of copy bandwidth (cuda:0)"] == ("83% [83%, 83%]", True)
    assert got["no recompile after the first step (cuda:0)"] == ("0", True)
    assert got["compute/communication overlap on GPUs, above DDP's"] == ("not measured", None)


def test_two_node_targets_read_the_right_rows():
    sync = _one(
        **{
            twonodes.FLAT: 100.0,
            twonodes.SYNC_FLAT: 104.0,
            twonodes.HIER: 74.0,
            twonodes.HIER_COMPILED: 80.0,
            twonodes.HIER_BF16: 40.0,
        }
    )
    step = _one(
        **{
            twonodes.DDP_EAGER: 1000.0,
            twonodes.STEP_FLAT: 900.0,
            twonodes.STEP_HIER: 950.0,
            twonodes.STEP_HIER_COMPILED: 790.0,
            twonodes.DILOCO: 300.0,
        }
    )
    results = {
        "10gbit": {"sync": {twonodes.TREE: sync, twonodes.GPT: sync}, "step": step},
        "1gbit": {"sync": {twonodes.TREE: sync, twonodes.GPT: sync}, "step": step},
    }
    got = {name: (measured[:5], met) for name, measured, met in twonodes.targets(results)}
    assert len(got) == 11  # every target, each once
    tree = f"sync alone, {twonodes.TREE}"
    assert got[f"{tree}: {twonodes.HIER} <= 0.75x the flat all-reduce, 1 Gbit/s"] == ("0.74x", True)
    assert got[
        f"sync alone, the GPT: {twonodes.HIER_COMPILED} <= 0.75x the flat all-reduce, 1 Gbit/s"
    ] == ("0.80x", False)
    assert got[f"{tree}: {twonodes.HIER_BF16} <= 0.45x the flat all-reduce, 1 Gbit/s"] == (
        "0.40x",
        True,
    )
    assert got[f"GPT step: {twonodes.STEP_HIER_COMPILED} <= 0.80x DDP eager, 1 Gbit/s"] == (
        "0.79x",
        True,
    )
    assert got["GPT step: fsync.diloco (H = 8) <= 0.25x DDP eager, 1 Gbit/s"] == ("0.30x", False)
    # At 10 Gbit/s the hierarchical path against fsync's own flat one, not the floor.
    assert got[f"{tree}: hierarchical eager <= 1.05x sync_grads flat, 10 Gbit/s"] == ("0.71x", True)
    flat_step = "GPT step: grad_and_value hierarchical eager <= 1.05x flat eager, 10 Gbit/s"
    assert got[flat_step] == ("1.06x", False)
    del results["10gbit"]
    got = {n: (m, ok) for n, m, ok in twonodes.targets(results)}
    assert got[flat_step] == ("not run", None)


def test_the_ring_model_puts_the_floors_of_the_docs_on_the_cable():
    s = 6.0  # a gradient of S bytes; the hierarchical hop hands each rank S / 2, bf16 S / 4
    assert twonodes.cable_bytes(s, flat=True) == 1.5 * s
    assert twonodes.cable_bytes(s / 2, flat=False) == s  # 0.67x the flat ring
    assert twonodes.cable_bytes(s / 4, flat=False) == s / 2  # 0.33x
