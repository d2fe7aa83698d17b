"""A checkpoint's optimizer state as ``torch.optim`` keeps it, for a plain-file export.

``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, file)`` turns a
DCP checkpoint into one ``torch.save`` file of nested dicts; for a checkpoint of
``fsync.checkpoint.state_dict`` its ``"optim"`` entry holds, per parameter path, the
optimizer's entries in the parameter's shape (a ZeRO state's pieces put together
by DCP), and the step count beside them. ``torch_optimizer_state_dict`` renames and
renumbers them as ``torch.optim.Optimizer.load_state_dict`` takes them.

Owns: the names torch.optim gives fsync.optim's entries. May import: torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

# fsync.optim's per-parameter entries under torch.optim's names (the rest keep theirs).
_TORCH_NAMES = {"momentum": "momentum_buffer"}


def torch_optimizer_state_dict(
    checkpoint: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: Sequence[str]
) -> dict[str, Any]:
    """The optimizer state of an exported checkpoint, for ``optimizer.load_state_dict``.

    Adam's and AdamW's moments keep their names and SGD's momentum becomes
    ``momentum_buffer``; the shared step count becomes each parameter's ``step``
    (a 0-d float32 tensor, as torch's Adam keeps it; SGD keeps none). The
    hyper-parameters are ``optimizer``'s own: only the state is the checkpoint's.
    ``torch.optim.AdamW`` loaded so continues [fsync.optim.adamw][] bit for bit.

    Args:
        checkpoint: What ``torch.load`` returns for the file
            ``dcp_to_torch_save`` wrote from a checkpoint of
            [fsync.checkpoint.state_dict][].
        optimizer: The ``torch.optim`` optimizer to load it into, built over the
            model's parameters.
        names: The parameter path of each of ``optimizer``'s parameters, in the
            order its param groups list them (``[n for n, _ in
            model.named_parameters()]`` for ``optimizer(model.parameters())``).

    Returns:
        ``{"state": {index: {...}}, "param_groups": ...}``, as
        ``optimizer.state_dict()`` returns it.

    Raises:
        ValueError: ``names`` does not name every parameter of ``optimizer``, or
            names one the checkpoint holds no state for.

    Example:
        >>> import torch, fsync
        >>> checkpoint = {"optim": {"step": torch.tensor(2),
        ...     "state": {"w": {"exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}}}}
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = torch.optim.AdamW([w])
        >>> opt.load_state_dict(fsync.checkpoint.torch_optimizer_state_dict(checkpoint, opt, ["w"]))
        >>> opt.state[w]["step"], opt.state[w]["exp_avg"]
        (tensor(2.), tensor([1., 1.]))
    """
    groups = optimizer.state_dict()["param_groups"]
    ids = [i for group in groups for i in group["params"]]
    if len(ids) != len(names):
        raise ValueError(
            f"names has {len(names)} paths but the optimizer holds {len(ids)} parameters; "
            "pass one path per parameter, in the order of its param groups."
        )
    optim = checkpoint["optim"]
    step = optim.get("step")
    state: dict[int, dict[str, Any]] = {}
    for i, name in zip(ids, names, strict=True):
        if name not in optim["state"]:
            raise ValueError(
                f"the checkpoint holds no optimizer state for {name!r} (it holds "
                f"{sorted(optim['state'])[:3]}...); pass the model's parameter paths."
            )
        entries = {_TORCH_NAMES.get(k, k): v for k, v in optim["state"][name].items()}
        if step is not None and "exp_avg" in entries:
            entries["step"] = torch.tensor(float(step), dtype=torch.float32)
        state[i] = entries
    return {"state": state, "param_groups": groups}
