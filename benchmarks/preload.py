"""What the processes' server works out once, as it starts, so that no process it forks has to.

Imported by the forkserver that the benchmark settings' processes and the test suite's gloo
ranks are forked from (``harness.PRELOAD``). Two answers inductor caches per process, which
every process's first compile otherwise computes again, with a warm cache too:

* which vector instruction sets this CPU and compiler can run
  (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``): a small kernel per candidate, each
  loaded in a fresh interpreter: 1.3-2.5 s before a process's first graph;
* the hash of torch's own code that every cache key holds (``codecache.torch_key``): 0.4 s.

Measured on a 2-core AMD EPYC (2026-11-28), a one-line function's first compile in a
process forked from a server that had imported ``PRELOAD`` only: 3.7 s, and 0.6 s with
both answers inherited. Neither depends on the environment a child sets after the fork
(its inductor cache directory: the probe's kernel is built once, where the server looks).
Working them out runs subprocesses to completion and starts no thread, so the forks catch
no lock held.
"""

from __future__ import annotations

import torch._inductor.codecache
import torch._inductor.cpu_vec_isa

torch._inductor.cpu_vec_isa.valid_vec_isa_list()
torch._inductor.codecache.torch_key()
