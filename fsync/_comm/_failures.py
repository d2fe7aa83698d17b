"""What fsync raises when a collective fails or times out, and the words it names ranks in.

``_comm`` raises ``CollectiveError`` from a failed wait and names it (which sync, which
stage, which ranks did not arrive) through the group's store.

Owns: the failure's type and words. May import: nothing of fsync's (layer 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CAUSES = (
    "A rank may have died, stopped calling the sync (uneven data: pass active=False on ranks "
    "that ran out), or called a different collective; a hung peer is reported after the "
    "process group's timeout (init_process_group(timeout=...))."
)
COLLECTIVE_FAILED = f"an fsync collective failed. {CAUSES}"

# How long a rank that saw a collective fail waits for the other ranks' reports in the
# group's store: they see the failure within about a step of each other (a dead peer at
# once, a hung one after each rank's own timeout, counted from its own wait).
REPORT_PATIENCE_S = 5.0


class CollectiveError(RuntimeError):
    """A collective of fsync's failed or timed out; ``named`` says where and who was missing.

    Attributes:
        stage: Which part of the sync waited (``"the ranks' agreement"``, ``"bucket 3 of
            8"`` ...), ``""`` where the wait did not say.
        backend: The backend's own message.
        reports: Once named, each reporting rank's record (``None``: the store was out of
            reach), else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str = "",
        backend: str = "",
        reports: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(f"{message} Backend error: {backend}" if backend else message)
        self.stage, self.backend, self.reports = stage, backend, reports


def ranks_in_words(ranks: Sequence[int]) -> str:
    """``"rank 1"``, ``"ranks 0, 2"``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
