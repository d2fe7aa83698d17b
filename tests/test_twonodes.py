"""Two machines for real: torchrun --nnodes 2 through ``twonodes``, 2 nodes x 2 ranks.

``../shared/tools/twonodes`` starts a command once in each of two network
namespaces joined by a shaped cable, with ``NODE_RANK`` and ``MASTER_ADDR`` set,
so that the torchrun line of ``docs/torchrun.md`` is a real two-host launch: the
rendezvous, gloo and the cross-node hop go over the cable, traffic within a node
stays on its own loopback. It needs root (network namespaces, tc); where it
cannot make them (exit status 3), these tests skip with its reason. CI runs as
root.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile

import pytest

from tests._launch import environment

ROOT = pathlib.Path(__file__).parents[1]
TWONODES = ROOT.parent / "shared" / "tools" / "twonodes"
RUN_TIMEOUT = 150  # seconds for one two-node launch (about 15 s eager on 2 loaded cores)
RATE = "1gbit"
# torchrun's options on every node (bash expands the variables twonodes sets), and the main
# job's: the launch docs/torchrun.md shows, "Two machines".
LAUNCH = (
    "--nnodes 2 --node-rank $NODE_RANK --nproc-per-node 2 --master-addr $MASTER_ADDR "
    "--master-port 29500"
)
MAIN_JOB = ("examples/train.py", "--mesh", "2x2", "--steps", "20", "--no-compile")


def twonodes(script: str, *args: str, rate: str = RATE) -> tuple[int, str]:
    """Runs ``script`` on 2 nodes x 2 ranks; returns (exit status, stdout + stderr).

    Skips the test where ``twonodes`` is missing or cannot make its namespaces.
    """
    if not TWONODES.exists():
        pytest.skip(f"no twonodes tool at {TWONODES}")
    if os.geteuid() != 0:
        pytest.skip("twonodes needs root (network namespaces and tc)")
    with tempfile.TemporaryDirectory(prefix="fsync-torchrun-") as logs:
        return _on_two_nodes(script, args, rate, logs)


def _on_two_nodes(script: str, args: tuple[str, ...], rate: str, logs: str) -> tuple[int, str]:
    # torchrun's logs' folder: by default each node leaves a /tmp/torchelastic_* behind.
    torchrun = f"{shlex.quote(sys.executable)} -m torch.distributed.run {LAUNCH}"
    torchrun += f" --log-dir {shlex.quote(logs)}"
    command = " ".join([torchrun, *(shlex.quote(a) for a in (script, *args))])
    # A session of its own, so that a timeout reaches torchrun on both nodes; they stop
    # their workers (each in a session of its own) on SIGTERM, and twonodes its namespaces.
    proc = subprocess.Popen(
        [str(TWONODES), "--rate", rate, "--", command],
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{command} ran over {RUN_TIMEOUT} s on two nodes:\n{out[-4000:]}")
    if proc.returncode == 3:
        pytest.skip(f"twonodes could not make two nodes: {out.strip()[-400:]}")
    return proc.returncode, out


def report(out: str, tail: int = 2500) -> str:
    """What a failed launch said, node by node: each node's lines that name an error or a
    signal, then its last ``tail`` characters. A plain tail of the interleaved output can be
    all one node's exit-barrier traceback, hiding the other node's failure (a CI run)."""
    said = []
    for node in ("node0", "node1"):
        mine = [
            line
            for line in out.splitlines()
            if line.startswith("[node1] ") == (node == "node1") and "frame #" not in line
        ]
        errors = [line for line in mine if re.search(r"Error|error|Signal|signal|exitcode", line)]
        text = "\n".join(mine)
        said.append(f"--- {node}: {len(errors)} error lines ---\n" + "\n".join(errors[:40]))
        said.append(f"--- {node}: the last {tail} characters ---\n{text[-tail:]}")
    return "\n".join(said)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_main_job_on_two_nodes_ends_with_identical_parameters():
    code, out = twonodes(*MAIN_JOB)
    assert code == 0, report(out)
    assert "4 ranks on gloo as a 2 x 2 mesh (node, local)" in out, report(out)
    loss = re.search(r"^loss ([\d.]+) -> ([\d.]+) in 20 steps", out, flags=re.M)
    assert loss, report(out)
    # fsync.verify(params, values=True) over all 4 ranks, both nodes, printed by rank 0.
    assert "OK: parameters identical on all 4 ranks" in out


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_tree_that_differs_on_node_1_is_the_same_error_on_all_four_ranks(tmp_path):
    code, out = twonodes("tests/_twonodes_mismatch.py", str(tmp_path))
    assert code == 0, report(out)
    # One file per rank (ranks 2 and 3 on node 1): printed lines of four processes can
    # interleave mid-line in the one pipe twonodes writes to.
    said = {p.name.removeprefix("rank"): p.read_text() for p in tmp_path.glob("rank*")}
    assert sorted(said) == ["0", "1", "2", "3"], out[-4000:]
    assert len(set(said.values())) == 1, said
    message = said["0"]
    assert message.startswith("ValueError: "), message
    assert "leaf 'layer.weight'" in message, message  # the first differing leaf,
    assert "on rank 3" in message, message  # and the rank of node 1 that differs
    assert (said["2"], said["3"]) == (message, message)  # node 1 too, the odd rank included


def test_the_docs_show_the_launch_tested_here():
    line = f"twonodes --rate {RATE} -- 'torchrun {LAUNCH} {' '.join(MAIN_JOB)}'"
    assert line in (ROOT / "docs" / "torchrun.md").read_text()
