"""What a replica that joins receives: fsync's state pytree, checked against its own.

torchft heals a replica that joins (or fell behind) by sending it a peer's
``state_dict`` over its checkpoint transport; here that is the whole state
pytree of the step (parameters, optimizer state, [fsync.SyncState][] with the
hook's state, [fsync.DiLoCoState][], step counts), as the transaction last
committed it. The receiving replica checks it against the state it was started
with before using it: the same tree structure, leaf by leaf the same kind,
shape and dtype, and for fsync's sync states the same plan fingerprint (the
same bucket options and tree). A replica started with another tree or other
sync options therefore stops with a ``ValueError`` there, before it takes part
in any collective, and its peers are not touched.

Owns: the heal's payload, its check, and the exchange torchft calls back into. May
import: ``_tree``, ``_sync``, ``_accumulate`` (the state types).
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fsync import _tree
from fsync._accumulate import DeferredState
from fsync._sync import SyncState

FORMAT = 1
_NONE: Any = object()  # nothing received
_FIX = (
    "Start every replica with the same model, optimizer and fsync options as the running "
    "job (a replica that joins receives the live state from a peer and must fit it)."
)


class Exchange:
    """What this replica serves to a peer that heals, and what it received from one.

    torchft calls ``save`` (on a peer that heals from this replica) and ``load`` (on
    this replica, as it heals) through the state callbacks it is given: ``save`` sends
    the state the transaction last committed, ``load`` checks a peer's against it and
    keeps it for the step, which takes it in ``begin``.

    Attributes:
        committed: The state a step started from or committed, the last one.
    """

    def __init__(self) -> None:
        self.committed: Any = None
        self._received: Any = _NONE

    def save(self) -> dict[str, Any]:
        """What a peer that heals receives (torchft's ``state_dict`` callback)."""
        return payload(self.committed)

    def load(self, sent: Any) -> None:
        """A peer's state, checked and kept for the step (torchft's ``load_state_dict``)."""
        self._received = received(self.committed, sent)

    def begin(self, state: Any) -> tuple[Any, bool]:
        """The state a step starts from (the one received, if this replica healed) and
        whether it healed; it is the committed one until the step commits another."""
        healed = self._received is not _NONE
        if healed:
            state, self._received = self._received, _NONE
        self.committed = state
        return state, healed


def payload(state: Any) -> dict[str, Any]:
    """What this replica sends a peer that heals: the committed state, as it is."""
    return {"format": FORMAT, "state": state}


def received(local: Any, sent: Any) -> Any:
    """The state a peer sent (``payload``), checked against ``local`` and moved to its devices.

    Raises:
        ValueError: The peer's state does not fit ``local`` (another tree, another
            leaf shape or dtype, a sync state made for another plan).
    """
    if not isinstance(sent, dict) or sent.get("format") != FORMAT:
        raise ValueError(
            f"the state received from a peer replica is not an fsync.ft state (format "
            f"{FORMAT}); got {type(sent).__name__}. Every replica must run fsync.ft of the same "
            "version."
        )
    theirs, their_spec = _tree.flatten(sent["state"])
    mine, my_spec = _tree.flatten(local)
    if their_spec != my_spec:
        raise ValueError(
            f"the state received from a peer replica has another structure: this replica "
            f"was started with {my_spec} but the job's state is {their_spec}. {_FIX}"
        )
    paths = optree.tree_paths(local, none_is_leaf=True, namespace=_tree.NAMESPACE)
    for path, a, b in zip(paths, mine, theirs, strict=True):
        _check_leaf(path, a, b)
    _check_plans(local, sent["state"])
    return _tree.unflatten(my_spec, [_placed(a, b) for a, b in zip(mine, theirs, strict=True)])


def _words(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _check_leaf(path: tuple[Any, ...], mine: Any, theirs: Any) -> None:
    same = type(mine) is type(theirs) or (
        isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
    )
    if isinstance(mine, torch.Tensor) and same:
        same = mine.shape == theirs.shape and mine.dtype == theirs.dtype
    if not same:
        raise ValueError(
            f"the state received from a peer replica differs at leaf {path}: this replica has "
            f"{_words(mine)} but the job has {_words(theirs)}. {_FIX}"
        )


def _sync_states(state: Any) -> list[Any]:
    leaves, _ = _tree.flatten(state, is_leaf=lambda x: isinstance(x, SyncState | DeferredState))
    return [x for x in leaves if isinstance(x, SyncState | DeferredState)]


def _check_plans(local: Any, sent: Any) -> None:
    for k, (mine, theirs) in enumerate(zip(_sync_states(local), _sync_states(sent), strict=True)):
        if int(mine.fingerprint) != int(theirs.fingerprint):
            raise ValueError(
                f"the sync state {k} received from a peer replica was made for another bucket "
                f"plan (fingerprint {int(theirs.fingerprint)}, this replica's is "
                f"{int(mine.fingerprint)}): the replicas' sync options (bucket sizes, "
                f"reduce_dtype, order) or trees differ. {_FIX}"
            )


def _placed(mine: Any, theirs: Any) -> Any:
    """The peer's leaf where this replica keeps its own (its device; a meta leaf stays)."""
    if not isinstance(mine, torch.Tensor):
        return theirs
    if mine.is_meta:
        return mine
    return theirs.to(device=mine.device)
