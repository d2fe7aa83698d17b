"""The examples, run as a user runs them: torchrun, two gloo ranks, few steps.

Each test launches ``python -m torch.distributed.run --standalone`` (a free port
per run) with this repository first on ``PYTHONPATH`` and checks what the
example prints: its own end-of-run checks ("parameters identical on all 2
ranks", DDP parity, checkpoint round trips) and numbers that must hold (finite
losses that went down, compression ratios). The main job runs compiled; the
others eagerly, to keep the file under a few minutes on two cores.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests._launch import ROOT, RUN_TIMEOUT, environment, torchrun


def number(pattern: str, text: str) -> float:
    """The number captured by ``pattern`` in ``text`` (commas allowed), which must match."""
    match = re.search(pattern, text, flags=re.M)
    assert match, f"no line matches {pattern!r} in:\n{text}"
    return float(match.group(1).replace(",", ""))


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_train_compiled_ends_with_identical_parameters():
    out = torchrun("examples/train.py", "--steps", "40")
    assert "fsync.compile" in out
    first = number(r"^loss ([\d.]+) ->", out)
    last = number(r"-> ([\d.]+) in 40 steps", out)
    held_out = number(r"held-out loss ([\d.]+)", out)
    assert math.isfinite(held_out) and last < 0.5 * first, out
    assert "OK: parameters identical on all 2 ranks" in out


@pytest.mark.timeout(3 * RUN_TIMEOUT + 30)
def test_gpt_resumed_run_matches_an_uninterrupted_one_bit_for_bit(tmp_path):
    common = ["--eval-every", "6", "--eval-batches", "2"]
    straight = torchrun(
        "examples/gpt.py", *common, "--steps", "12", "--checkpoint", str(tmp_path / "a")
    )
    half = tmp_path / "b"
    # The schedule must be the full run's: --decay-steps 12 while stopping at 6.
    torchrun(
        "examples/gpt.py", *common, "--steps", "6", "--decay-steps", "12", "--checkpoint", str(half)
    )
    resumed = torchrun(
        "examples/gpt.py", *common, "--steps", "12", "--checkpoint", str(half), "--resume"
    )

    assert f"resumed from {half} at step 6" in resumed
    final = re.compile(r"^final: step 12, train loss .*$", flags=re.M)
    assert final.search(straight) and final.search(straight)[0] == final.search(resumed)[0]
    assert number(r"^step 12: train loss ([\d.]+)", straight) < 0.9 * math.log(59)  # learned
    assert "OK: parameters identical on all 2 ranks" in straight
    assert "sample:\nThe " in straight

    # Both DCP checkpoints as plain files: the same step, parameters and AdamW state.
    a, b = (_exported(tmp_path / name, tmp_path / f"{name}.pt") for name in ("a", "b"))
    assert a["example"]["step"] == b["example"]["step"] == 12
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert int(b["optim"]["step"]) == 12
    assert a["optim"]["state"].keys() == a["params"].keys() == b["optim"]["state"].keys()
    for k, entries in a["optim"]["state"].items():
        assert sorted(entries) == ["exp_avg", "exp_avg_sq"]
        assert all(torch.equal(entries[e], b["optim"]["state"][k][e]) for e in entries)


def _exported(checkpoint, file):
    """A DCP checkpoint as one torch.save file, loaded (weights-only)."""
    dcp_to_torch_save(checkpoint, file)
    return torch.load(file)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_zero_halves_the_state_and_reloads_in_the_other_layout():
    out = torchrun("examples/zero.py", "--steps", "15")
    unsharded = number(r"against ([\d,]+) bytes unsharded", out)
    ranks = [number(rf"^  rank {r}: ([\d,]+) bytes", out) for r in (0, 1)]
    # Each rank holds half of AdamW's two moments (and a step count of its own):
    # together a little more than one full copy, the second step count and padding.
    assert ranks[0] == ranks[1] < 0.51 * unsharded, out
    assert unsharded <= sum(ranks) <= unsharded + 64, out
    first = number(r"^loss ([\d.]+) ->", out)
    last = number(r"-> ([\d.]+) in 15 steps", out)
    assert last < first and math.isfinite(number(r"held-out loss ([\d.]+)", out))
    # Gathered with zero_state_dict, saved, loaded as whole buckets, one more step each.
    assert "OK: the checkpoint reloaded as whole buckets takes a bit-identical next step" in out
    assert "OK: parameters identical on all 2 ranks" in out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_compression_trains_with_every_hook_and_sends_less():
    out = torchrun("examples/compression.py", "--steps", "12", "--start-step", "2")
    rows = {}
    for name in ("allreduce", "fp16", "bf16", "powersgd", "bf16-powersgd", "quantize"):
        match = re.search(rf"^{name} +([\d.]+) +([\d.]+) +([\d,]+) +([\d.]+) +(\d+)", out, re.M)
        assert match, f"no row for {name} in:\n{out}"
        train_loss, held_out, nbytes, ratio, _ = (float(g.replace(",", "")) for g in match.groups())
        assert math.isfinite(train_loss) and held_out < math.log(59), (name, out)  # learned
        rows[name] = nbytes, ratio
    assert rows["allreduce"][1] == 1.0
    assert rows["fp16"][1] == rows["bf16"][1] == 0.5  # half-width floats, same buckets
    assert 0.24 < rows["quantize"][1] < 0.26  # 8 of 32 bits, plus a scale per bucket
    assert rows["powersgd"][1] < 0.2  # rank-4 factors of 64-wide matrices
    assert rows["bf16-powersgd"][0] == rows["powersgd"][0] / 2  # the same factors in bf16
    assert "OK: every hook trained, parameters identical on all 2 ranks" in out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_module_backward_matches_ddp_bit_for_bit():
    out = torchrun("examples/module_backward.py", "--steps", "20")
    assert "OK: parameters and buffers equal to DDP's, bit for bit, at all 20 steps" in out
    assert number(r"held-out accuracy ([\d.]+)%", out) > 50  # chance is 25%
    assert "OK: parameters identical on all 2 ranks" in out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_diloco_sends_a_sixteenth_and_draws_the_plot(tmp_path):
    plot = tmp_path / "diloco.png"
    out = torchrun("examples/diloco.py", "--steps", "16", "--inner-steps", "8", "--plot", str(plot))
    rows = {}
    for name in ("ddp", "diloco"):
        match = re.search(rf"^{name} +([\d.]+) +([\d.]+) +(\d+) +([\d.]+)$", out, re.M)
        assert match, f"no row for {name} in:\n{out}"
        train_loss, held_out, syncs, mib = (float(g) for g in match.groups())
        assert math.isfinite(train_loss) and held_out < math.log(59), (name, out)  # learned
        rows[name] = syncs, mib
    assert rows["ddp"][0] == 16 and rows["diloco"][0] == 2
    # 16 fp32 syncs against 2 bf16 ones: 16 times fewer bytes (the agreement's 104 B a
    # sync changes the printed ratio only past its first decimal).
    assert "diloco sent 16.0x fewer bytes than ddp" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "OK: parameters identical on all 2 ranks after each run" in out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_fault_tolerance_survives_a_replica_killed_in_backward():
    pytest.importorskip("torchft", reason="fsync.ft needs torchft: pip install -e '.[test]'")
    command = [sys.executable, "examples/fault_tolerance.py", "--replicas", "3", "--steps", "16"]
    done = subprocess.run(
        [*command, "--kill", "1:6", "--timeout", "5"],
        cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-4000:]
    assert "replica 1 was killed; restarting it" in out
    assert number(r"^replica 1: \d+ steps committed, \d+ discarded, healed (\d+) times", out) >= 1
    for k in (0, 2):  # the survivors lost the step replica 1 died in, and went on
        assert number(rf"^replica {k}: \d+ steps committed, (\d+) discarded", out) >= 1
    assert "OK: parameters and optimizer states identical on all 3 replicas" in out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_fault_tolerance_replica_groups_of_two_ranks_restarted_by_torchrun():
    pytest.importorskip("torchft", reason="fsync.ft needs torchft: pip install -e '.[test]'")
    command = [sys.executable, "examples/fault_tolerance.py", "--replicas", "2", "--steps", "12"]
    done = subprocess.run(
        [*command, "--ranks-per-replica", "2", "--kill", "1:5", "--timeout", "5"],
        cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-4000:]
    for r in (0, 1):  # torchrun restarted replica 1's two ranks; each healed from its peer rank
        line = rf"^replica 1 rank {r}: \d+ steps committed, \d+ discarded, healed (\d+) times"
        assert number(line, out) >= 1
        assert re.search(rf"^replica 1 rank {r}: .*\(restarted by torchrun\)$", out, re.M), out
        # replica 0's ranks lost the step replica 1 died in, and went on
        assert number(rf"^replica 0 rank {r}: \d+ steps committed, (\d+) discarded", out) >= 1
    assert "OK: parameters and optimizer states identical on all 2 replicas x 2 ranks" in out
