"""The one error type of checkpoints, and how its messages are made.

Every problem with a checkpoint (missing, damaged, written by another model, unreadable)
is a :class:`CheckpointError` of one line naming the path, what is wrong and the fix;
:func:`first_line` makes an underlying exception fit in that line, :data:`REDO` is the
fix for a checkpoint that cannot be trusted.
"""

from __future__ import annotations

REDO = "use an earlier checkpoint or re-save"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the path and the fix."""


def first_line(exc: BaseException, limit: int = 160) -> str:
    """An exception's message as one line of at most ``limit`` characters (for errors)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."
