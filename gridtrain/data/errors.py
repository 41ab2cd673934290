"""The one error type of the data concern.

A bad corpus, tokenizer, token file or batch size is something the user fixes, not a
bug: every module here raises :class:`DataError` with one line naming the input and the
fix, and the CLI and pre-start validation print it as it is.
"""

from __future__ import annotations


class DataError(ValueError):
    """A data or tokenizer problem the user can fix; the message is one line naming both."""

