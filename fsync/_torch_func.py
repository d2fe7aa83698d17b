"""``torch.func.grad_and_value``'s conventions for fsync's gradient calls: which arguments
are differentiated, what ``fn`` must return, and what comes back.

[fsync.grad_and_value][], ``GradSync.grad_and_value`` and ``ZeroStep.value_and_step``
take ``fn``, ``argnums`` and ``has_aux`` as ``torch.func`` does (``TorchFunc.of`` checks
them in fsync's words); eagerly ``_backward`` differentiates ``forward`` itself, and under
``torch.compile`` ``compiled`` is ``torch.func``'s own call.

Owns: those conventions. May import: ``_checks``, ``_tree`` (layers 1 to 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fsync import _checks, _tree


class TorchFunc(NamedTuple):
    """``torch.func.grad_and_value``'s conventions: which arguments, which output, what back.

    Attributes:
        fn: The function differentiated.
        argnums: The positional argument (an int) or arguments (a tuple of ints)
            differentiated; negative numbers count from the end.
        has_aux: Whether ``fn`` returns ``(value, aux)`` rather than ``value``.
    """

    fn: Callable[..., Any]
    argnums: int | tuple[int, ...]
    has_aux: bool

    @classmethod
    def of(cls, fn: Any, argnums: Any, has_aux: Any) -> TorchFunc:
        """The settings, checked as ``torch.func`` checks them, in fsync's words."""
        if not callable(fn):
            raise TypeError(f"fn is a {type(fn).__name__}; expected a function to differentiate.")
        numbers = argnums if isinstance(argnums, tuple) else (argnums,)
        if not numbers or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            raise TypeError(
                f"argnums must be an int or a non-empty tuple of ints; got {argnums!r}."
            )
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"argnums must not repeat an argument; got {argnums!r}.")
        _checks.check_flag("has_aux", has_aux)
        return cls(fn, argnums, has_aux)

    def _positions(self, args: Sequence[Any]) -> tuple[int, ...]:
        numbers = self.argnums if isinstance(self.argnums, tuple) else (self.argnums,)
        for n in numbers:
            if not -len(args) <= n < len(args):
                raise ValueError(
                    f"argnums names argument {n}, but fn was called with {len(args)} positional "
                    "arguments; pass the arguments to differentiate positionally."
                )
        return tuple(n % len(args) for n in numbers)

    def differentiated(self, args: Sequence[Any]) -> Any:
        """The tree the gradients are taken for: one argument, or a tuple of them."""
        positions = self._positions(args)
        if isinstance(self.argnums, tuple):
            return tuple(args[n] for n in positions)
        return args[positions[0]]

    def forward(
        self, args: Sequence[Any], kwargs: dict[str, Any], rebuild: Callable[[Sequence[Any]], Any]
    ) -> Callable[[Sequence[torch.Tensor | None]], Any]:
        """``fn`` as a function of the differentiated leaves (``rebuild`` makes their tree)."""
        positions = self._positions(args)

        def call(leaves: Sequence[torch.Tensor | None]) -> Any:
            tree = rebuild(leaves)
            trees = tree if isinstance(self.argnums, tuple) else (tree,)
            new = list(args)
            for n, t in zip(positions, trees, strict=True):
                new[n] = t
            return self.fn(*new, **kwargs)

        return call

    def value(self, output: Any) -> torch.Tensor:
        """The value differentiated: ``output`` or its first half, a scalar tensor."""
        if self.has_aux:
            if not isinstance(output, tuple) or len(output) != 2:
                raise ValueError(
                    f"fn returned a {type(output).__name__}; with has_aux=True it must return a "
                    "pair (value, aux)."
                )
            output = output[0]
        if not isinstance(output, torch.Tensor) or output.dim() != 0:
            got = (
                f"a tensor of shape {tuple(output.shape)}"
                if isinstance(output, torch.Tensor)
                else f"a {type(output).__name__}"
            )
            raise ValueError(
                f"fn returned {got}; expected a scalar tensor (a 0-d loss) to differentiate. "
                "Reduce it first (loss.mean() or loss.sum()); for other outputs use "
                "torch.func.vjp."
            )
        return output

    def result(self, grads: Any, output: Any) -> tuple[Any, Any]:
        """``(grads, value)`` or ``(grads, (value, aux))``, as ``torch.func.grad_and_value``."""
        detached = optree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, output
        )
        return grads, detached

    def grad(self, result: tuple[Any, Any]) -> Any:
        """``grads`` or ``(grads, aux)`` from ``result``: what ``torch.func.grad`` returns."""
        grads, output = result
        return (grads, output[1]) if self.has_aux else grads

    def compiled(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``torch.func.grad_and_value(fn)(*args, **kwargs)``: what a compiled step traces.

        ``None`` leaves of the differentiated arguments, which ``torch.func``
        refuses, stay ``None``, and so do their gradients (as eagerly).
        """
        leaves, rebuild_tree = _tree.leaves_and_rebuild(self.differentiated(args))
        if all(leaf is not None for leaf in leaves):
            call = torch.func.grad_and_value(self.fn, self.argnums, self.has_aux)
            grads, output = call(*args, **kwargs)
            return grads, output

        def rebuild(tensors: Sequence[Any]) -> Any:
            given = iter(tensors)
            return rebuild_tree([None if x is None else next(given) for x in leaves])

        forward = self.forward(args, kwargs, rebuild)
        tensors = [leaf for leaf in leaves if leaf is not None]
        grads, output = torch.func.grad_and_value(forward, has_aux=self.has_aux)(tensors)
        return rebuild(grads), output
