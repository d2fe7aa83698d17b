"""Pure functional optimizers: ``init(params) -> state``, ``update(params, grads, state)``.

They match ``torch.optim`` operation by operation and run on any pytree of
tensors, the flat shards of [fsync.ops.zero][] included.
"""

from fsync.optim._adam import AdamState, adam, adamw
from fsync.optim._base import Optimizer
from fsync.optim._sgd import SGDState, sgd

__all__ = ["AdamState", "Optimizer", "SGDState", "adam", "adamw", "sgd"]
