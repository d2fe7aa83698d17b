"""The entries of a [fsync.SyncState][] and of a [fsync.DiLoCoState][].

A ``SyncState`` (of [fsync.GradSync][]) is stored as ``sync.step``, its step count (the
same on every rank), and ``sync.hook.rank<r>.<i>``, process ``r``'s hook state
(PowerSGD's error feedback and Q): each rank's own. Its ``fingerprint`` and ``like``
are not stored: ``load`` makes them from the caller's tree and ``GradSync``.

A ``DiLoCoState`` is stored as ``diloco.anchor.<path>`` (the parameters of the last
sync, the same on every rank), ``diloco.outer`` (the outer optimizer's state over the
anchor, named as ``optim`` is), ``diloco.step`` and ``diloco.sync`` (its pseudo-gradient
sync's state, as above). Between syncs DiLoCo's ranks train apart, so the parameters
and the inner optimizer's state are each rank's own: ``_state_dict`` stores them under
``local.rank<r>`` where a DiLoCo state is in the checkpoint.

The hook keys (``(plan fingerprint, world size)``) and the world of the local entries
go to the description, so that ``load`` restores what is each rank's own only at the
same world size and plan, and makes it afresh otherwise.

Owns: those entries. May import: ``_entries``, ``_sync``, ``_diloco``.
"""

from __future__ import annotations

from typing import Any

from fsync import _tree
from fsync._diloco import DiLoCoState
from fsync._sync import GradSync, SyncState
from fsync.checkpoint._entries import (
    Named,
    check_like,
    hook_entry,
    optim_entries,
    params_entry,
    process,
)


def _sync_entry(state: SyncState) -> dict[str, Any]:
    rank, _ = process()
    return {"step": state.step, "hook": {f"rank{rank}": hook_entry(state.hook)}}


def sync_part(
    tree: Named, state: SyncState, sync: GradSync
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GradSync's state over ``tree``: its entries and its description's fields."""
    check_like(tree, state.like, "the SyncState")
    fingerprint = sync.plan(state).fingerprint
    if fingerprint != int(state.fingerprint):
        raise ValueError(
            f"the SyncState belongs to another plan (fingerprint {int(state.fingerprint)}) "
            f"than this GradSync's ({fingerprint}); pass the GradSync whose init made it."
        )
    return {"sync": _sync_entry(state)}, {"sync": (fingerprint, process()[1])}


def diloco_part(tree: Named, state: DiLoCoState, _: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DiLoCo state over ``tree``: its entries and its description's fields."""
    check_like(tree, state.anchor, "the DiLoCoState's anchor")
    anchor = tree._replace(leaves=_tree.flatten(state.anchor)[0])
    outer, described = optim_entries(anchor, state.outer)
    world = process()[1]
    entries = {
        "anchor": params_entry(anchor),
        "outer": outer,
        "step": state.step,
        "sync": _sync_entry(state.sync),
    }
    fields = {
        "outer": described,
        "diloco": (int(state.sync.fingerprint), world),
        "local": world,
    }
    return {"diloco": entries}, fields
