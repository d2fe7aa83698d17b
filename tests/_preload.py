"""What the processes' server imports and works out once, as it starts, so that no process
it forks has to.

The test suite's gloo ranks (``tests/_world.py``) and the benchmark settings' processes
(``benchmarks/harness.py``) are forked from a server that imports this module: torch,
dynamo's and inductor's own modules, which halve what a process's first compile costs
(3.6 -> 1.7 s for a one-line function here), and fsync; importing them starts no thread that
a fork could catch holding a lock. Then two answers inductor caches per process, which every
process's first compile otherwise computes again, with a warm cache too:

* which vector instruction sets this CPU and compiler can run
  (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``): a small kernel per candidate, each
  loaded in a fresh interpreter: 1.2-2.5 s (the more, the busier the machine) before a
  process's first graph;
* the hash of torch's own code that every cache key holds (``codecache.torch_key``): 0.2-0.4 s.

And two things a process's first compile that misses inductor's caches does once, whichever
graph it compiles:

* the graph passes' patterns (attention fusion, padded matmuls, ...), traced into pattern
  graphs the first time a joint or post-grad pass runs (``lazy_init`` of ``joint_graph`` and
  ``post_grad``, once per input device);
* ``sympy.physics.units``, which sympy's ``simplify`` imports on first use.

Measured on a 2-core AMD EPYC (2026-11-28, nothing else running, three runs each),
a one-line function's first compile in a process that had imported the modules above:
1.6-1.9 s; with both answers worked out before: 0.26-0.30 s. With an empty cache a small
graph's first compile in a child took 0.93-1.24 s of CPU (the second 0.16-0.22 s); with the
patterns and sympy's units loaded here as well 0.38-0.47 s (2026-11-29, six runs each):
~0.7 s of CPU saved by every process that compiles, of which a cold test suite forks dozens
(its worlds' ranks, the benchmark pages' settings, 2 or 4 ranks each). None of this depends
on the environment a child sets after the fork (its inductor cache directory: the probe's
kernel is built once, where the server looks). Working them out runs subprocesses to
completion; tracing the patterns starts tqdm's monitor thread (torch.fx's interpreter opens
a progress bar), which is stopped before the server forks, so that no fork catches a lock
held.
"""

from __future__ import annotations

import importlib

import torch
import torch._dynamo
import torch._functorch.aot_autograd
import torch._inductor.codecache
import torch._inductor.compile_fx
import torch._inductor.cpu_vec_isa
import torch._inductor.fx_passes.joint_graph
import torch._inductor.fx_passes.post_grad
import torch.distributed
import torch.nn.parallel

import fsync  # noqa: F401  # imported once, for every process forked

torch._inductor.cpu_vec_isa.valid_vec_isa_list()
torch._inductor.codecache.torch_key()
# Inductor asks for the joint-graph patterns with its inputs' device, or with none (the
# functools cache of each is keyed on it).
for _device in (None, torch.device("cpu")):
    torch._inductor.fx_passes.joint_graph.lazy_init(_device)
torch._inductor.fx_passes.post_grad.lazy_init()
importlib.import_module("sympy.physics.units")  # what sympy's simplify imports on first use
# torch.fx's progress bars are tqdm's where it is installed (torch.hub's stand-in otherwise);
# its monitor is joined: it takes tqdm's lock while it looks at the bars.
_monitor = getattr(importlib.import_module("torch.hub").tqdm, "monitor", None)
if _monitor is not None:
    _monitor.exit()
