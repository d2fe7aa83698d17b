"""ZeRO: gradient sync and a sharded optimizer update as one step, a module per concept.

``_layout``, which elements of which buckets a rank updates (``ZeroLayout``) and its
state (``ZeroState``); ``_stages``, a bucket's reduce, update and gather in order;
``_step``, ``ZeroStep`` (its calls, eager and overlapped with backward) and
``zero_state_dict``; ``_factories``, [fsync.ops.zero][] and [fsync.ops.replicated][].
The package re-exports what ``fsync.ops`` and ``fsync.checkpoint`` take.

Owns: nothing of its own (re-exports only). May import: its modules.
"""

from fsync._zero._factories import replicated, zero
from fsync._zero._layout import ZeroLayout, ZeroState
from fsync._zero._step import ZeroStep, zero_state_dict

__all__ = ["ZeroLayout", "ZeroState", "ZeroStep", "replicated", "zero", "zero_state_dict"]
