"""Pure functional optimizers: ``init(params) -> state``, ``update(params, grads, state)``.

They match ``torch.optim`` operation by operation and run on any pytree of
tensors, the flat shards of [fsync.ops.zero][] included. Made with
``in_place=True``, an optimizer writes its update into the tensors it is given, as
``torch.optim`` does.
"""

from fsync.optim._adam import AdamState, adam, adamw
from fsync.optim._base import Optimizer
from fsync.optim._sgd import SGDState, sgd

__all__ = ["AdamState", "Optimizer", "SGDState", "adam", "adamw", "sgd"]
