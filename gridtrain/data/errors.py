"""The one error type of the data concern.

A bad corpus, tokenizer, token file or batch size is something the user fixes, not a
bug: every module here raises :class:`DataError` with one line naming the input and the
fix, and the CLI and pre-start validation print it as it is.
"""

from __future__ import annotations


class DataError(ValueError):
    """A data or tokenizer problem the user can fix; the message is one line naming both."""


class TokenIdError(DataError):
    """A batch holds a token id (or label) outside the model's vocabulary: a corrupt token
    file, or data made for another model. Raised on the host, where the batch is
    assembled (:func:`~gridtrain.data.datasets.collate`), before the ids reach the
    embedding or the loss; the message names the source, the position, the id and the
    vocabulary."""
