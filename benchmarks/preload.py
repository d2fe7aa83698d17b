"""What the processes' server works out once, as it starts, so that no process it forks has to.

Imported by the forkserver that the benchmark settings' processes and the test suite's gloo
ranks are forked from (``harness.PRELOAD``). Two answers inductor caches per process, which
every process's first compile otherwise computes again, with a warm cache too:

* which vector instruction sets this CPU and compiler can run
  (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``): a small kernel per candidate, each
  loaded in a fresh interpreter: 1.2-2.5 s (the more, the busier the machine) before a
  process's first graph;
* the hash of torch's own code that every cache key holds (``codecache.torch_key``): 0.2-0.4 s.

Measured on a 2-core AMD EPYC (2026-11-28, nothing else running, three runs each), a
one-line function's first compile in a process that had imported ``PRELOAD``'s other
modules: 1.6-1.9 s; with both answers worked out before: 0.26-0.30 s. Neither depends on
the environment a child sets after the fork (its inductor cache directory: the probe's
kernel is built once, where the server looks). Working them out runs subprocesses to
completion and starts no thread, so the forks catch no lock held.
"""

from __future__ import annotations

import torch._inductor.codecache
import torch._inductor.cpu_vec_isa

torch._inductor.cpu_vec_isa.valid_vec_isa_list()
torch._inductor.codecache.torch_key()
