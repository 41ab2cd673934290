"""Supervised fine-tuning data: prompts and chats, the loss on the answers only, packed.

A fine-tuning set is a JSON lines file in one of two shapes (one shape a file):

* ``{"prompt": "...", "completion": "..."}``: the example is the prompt's tokens, the
  completion's tokens and one end-of-text token (when the tokenizer has one); the
  completion and that eot are targets, so the model learns to answer and to stop;
* ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``:
  a chat, rendered by the tokenizer's chat template (``chat_template`` in the
  ``tokenizer_config.json``, or ``chat_template.jinja``, beside its ``tokenizer.json``),
  or without one by the built-in rendering ``"role: content\\n"`` per message, where an
  assistant message is ``"assistant: "`` then its content then eot (``"\\n"`` when the
  tokenizer has no eot). What every assistant message renders to is a target; system,
  user and other roles' messages never are.

Which characters of a templated chat an assistant wrote is found by rendering prefixes:
assistant message ``i`` is what ``messages[:i + 1]`` renders to beyond ``messages[:i]``
with the generation prompt (the header that asks the model to answer). The whole chat is
tokenized at once (so its tokens are the ones ``transformers``' ``apply_chat_template``
gives) and a token is a target when its characters overlap an assistant's. A template
whose renderings of shorter chats are not prefixes of the longer ones is refused.
``{% generation %}`` blocks (transformers' assistant masks) are accepted and ignored.

The first token of an example is never a target: nothing of the example precedes it,
so predicting it would be predicting across examples.

:class:`SFTDataset` packs the examples in file order, greedily and without splitting
one, into samples of ``seq_len + 1`` tokens (inputs ``[:-1]``, next tokens ``[1:]``, as
the pretraining windows); an example longer than that keeps its first ``seq_len + 1``
tokens (counted in ``truncated``). Each item also has ``documents``: which example of
the sample each input token belongs to (0, 1, ...; the padding after the last example is
one more), for ``--document-mask``. Labels are IGNORE_INDEX except where the next token
is a target.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from gridtrain.data.errors import DataError
from gridtrain.data.tokenizers import ByteTokenizer, Tokenizer, token_dtype

JSONL_SUFFIX = ".jsonl"
PROMPT = "prompt/completion"
MESSAGES = "messages"
SHAPES = {
    PROMPT: '{"prompt": "...", "completion": "..."}',
    MESSAGES: '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}',
}
ASSISTANT = "assistant"
IGNORE_INDEX = -100  # a label without loss: torch's default, and the model's (data sits below models)

Piece = tuple["str | int", bool]  # text (or one token id) and whether it is a target


def record_kind(record: Any) -> str | None:
    """:data:`PROMPT` or :data:`MESSAGES` by the record's keys, else None."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return MESSAGES
    if "prompt" in record and "completion" in record:
        return PROMPT
    return None


def is_sft_jsonl(path: str | os.PathLike) -> bool:
    """A ``.jsonl`` file whose first non-blank line is an object with ``prompt`` and
    ``completion``, or ``messages``. A ``text`` file is pretraining data, and a folder is
    never fine-tuning data (several fine-tuning files are combined as a mixture)."""
    path = Path(path)
    if path.suffix != JSONL_SUFFIX or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    return record_kind(json.loads(line)) is not None
    except (OSError, ValueError):  # unreadable, not JSON or not UTF-8: not ours to explain
        return False
    return False


def read_examples(path: str | os.PathLike) -> list[dict]:
    """The records of a fine-tuning file, checked: every non-blank line is a record of the
    first one's shape, or :class:`DataError` names the file, the line and the shape."""
    return _read_records(path)[0]


def _read_records(path: str | os.PathLike) -> tuple[list[dict], list[int]]:
    """The records of a fine-tuning file and their line numbers, checked."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"--data {path}: a folder; fine-tuning data is one .jsonl file (combine several "
                        "as a mixture)")
    if not path.is_file():
        raise DataError(f"--data {path}: no such file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"--data {path}: cannot read it ({e.strerror or e}); fix its permissions") from None
    records, numbers = [], []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as e:  # UnicodeDecodeError too
            kind = record_kind(records[0]) if records else None
            raise DataError(f"--data {path}: line {number} is not JSON ({getattr(e, 'msg', None) or e}); "
                            f"{_expected(kind)}") from None
        numbers.append(number)
    if not records:
        raise DataError(f"--data {path}: no examples in this file; {_expected(None)}")
    check_examples(records, path, numbers)
    return records, numbers


def check_examples(records: Sequence[Any], path: str | os.PathLike | None = None,
                   numbers: Sequence[int] | None = None) -> str:
    """Check every record is of the first one's shape; returns that shape's kind.
    ``numbers`` are the records' line numbers in ``path`` (default 1, 2, ...)."""
    numbers = list(numbers) if numbers is not None else list(range(1, len(records) + 1))
    if not records:
        raise DataError(f"{_where(path, None)}no examples; {_expected(None)}")
    kind = record_kind(records[0])
    for record, number in zip(records, numbers):
        problem = _problem(record, kind)
        if problem:
            raise DataError(f"{_where(path, number)}{problem}; {_expected(kind)}")
    return kind


def _where(path, number: int | None) -> str:
    if path is None:
        return "" if number is None else f"example {number} "
    return f"--data {path}: " if number is None else f"--data {path}: line {number} "


def _expected(kind: str | None) -> str:
    if kind is None:
        return f"every line must be an object like {SHAPES[PROMPT]} or {SHAPES[MESSAGES]}"
    return f"every line must be an object like {SHAPES[kind]} (one shape a file)"


def _problem(record: Any, kind: str | None) -> str | None:
    """What is wrong with one record, expected to be of ``kind``; None when nothing is."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not an object"
    own = record_kind(record)
    if own is None or kind is None:
        return "has neither \"prompt\" and \"completion\" nor \"messages\""
    if own != kind:
        return f"is a {own} record in a file of {kind} records"
    if kind == PROMPT:
        if "messages" in record:
            return "has both \"messages\" and \"prompt\"/\"completion\""
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                return f"has a \"{key}\" that is not a string"
        return None
    if "prompt" in record or "completion" in record:
        return "has both \"messages\" and \"prompt\"/\"completion\""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return "has \"messages\" that is not a non-empty list"
    for k, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return f"has message {k} that is not {{\"role\": string, \"content\": string}}"
    if not any(m["role"] == ASSISTANT for m in messages):
        return "has no \"assistant\" message (nothing to learn from)"
    return None


# ---- chat templates --------------------------------------------------------------------------

class ChatTemplate:
    """A Jinja chat template as Hugging Face tokenizers ship them, rendered as
    ``transformers`` renders it (sandboxed; ``trim_blocks``, ``lstrip_blocks``, loop
    controls, ``tojson``, ``raise_exception``, ``strftime_now``) with the tokenizer's
    special tokens (``bos_token``, ``eos_token``, ...) as variables."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "chat template"):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin
        self._template = _compile(source, origin)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)


def _compile(source: str, origin: str):
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError(f"{origin}: the jinja2 package is needed for chat templates: pip install jinja2") from None

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks
        assistant text with it; the prefix renderings find it here)."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"{origin}: not a Jinja template ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The chat template beside a ``tokenizer.json``: ``chat_template.jinja``, else
    ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates
    of which ``default`` is used). None for the byte tokenizer or a tokenizer without one."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return None
    folder = Path(path).parent
    config_file = folder / "tokenizer_config.json"
    config: dict = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"{config_file}: not a JSON file ({_first_line(e)})") from None
        if not isinstance(config, dict):
            raise DataError(f"{config_file}: not a JSON object")
    jinja_file = folder / "chat_template.jinja"
    source, origin = config.get("chat_template"), f"{config_file}: chat_template"
    if jinja_file.is_file():
        source, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    elif isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise DataError(f"{origin}: not a template string")
    return ChatTemplate(source, _special_tokens(config), origin)


def _special_tokens(config: dict) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings (a token may be saved as {"content": ...})."""
    out = {}
    for key, value in config.items():
        if key.endswith("_token"):
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out


def _assistant_spans(messages: list[dict], template: ChatTemplate, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its assistant messages."""
    import jinja2

    try:
        text = template.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            before = template.render(messages[:i], add_generation_prompt=True) if i else ""
            through = template.render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(f"{where}: {template.origin} does not render this chat turn by turn (the rendering "
                                f"of its first {i} messages is not where the whole one begins), so which tokens "
                                f"message {i} wrote is unknown; use a template that renders prefixes as prefixes")
            spans.append((len(before), len(through)))
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"{where}: {template.origin} failed on it ({_first_line(e)})") from None
    return text, spans


# ---- tokenizing ------------------------------------------------------------------------------

def _pieces(record: dict, kind: str, eot_id: int | None) -> list[Piece]:
    """An example as texts (and the eot id) with target flags, without a chat template."""
    stop = [] if eot_id is None else [(eot_id, True)]
    if kind == PROMPT:
        return [(record["prompt"], False), (record["completion"], True), *stop]
    pieces: list[Piece] = []
    for message in record["messages"]:
        if message["role"] == ASSISTANT:
            pieces += [("assistant: ", False), (message["content"], True), *(stop or [("\n", True)])]
        else:
            pieces.append((f"{message['role']}: {message['content']}\n", False))
    return pieces


def _split(text: str, spans: list[tuple[int, int]]) -> list[Piece]:
    """A rendered chat as pieces, cut at the assistant spans."""
    pieces, pos = [], 0
    for start, end in spans:
        pieces += [(text[pos:start], False), (text[start:end], True)]
        pos = end
    return pieces + [(text[pos:], False)]


def _encode_texts(texts: list[str], tokenizer: Tokenizer) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    if hasattr(tokenizer, "encode_batch"):
        return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
    return [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in texts]


def encode_examples(records: Sequence[dict], tokenizer: Tokenizer, chat_template: ChatTemplate | None = None,
                    path: str | os.PathLike | None = None, numbers: Sequence[int] | None = None,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checked records as ``(tokens, loss_mask, offsets)``: every example's tokens one after
    another, whether each is a target, and where each example starts (``len + 1`` entries).
    Texts are tokenized in batches (one call for all of them)."""
    kind = check_examples(records, path, numbers)
    numbers = list(numbers) if numbers is not None else list(range(1, len(records) + 1))
    templated = chat_template is not None and kind == MESSAGES
    with_offsets = templated and hasattr(tokenizer, "encode_with_offsets")
    examples: list[list[Piece]] = []
    chats: list[tuple[str, list[tuple[int, int]]]] = []
    for record, number in zip(records, numbers):
        if templated:
            text, spans = _assistant_spans(record["messages"], chat_template, _where(path, number).rstrip())
            if with_offsets:
                chats.append((text, spans))
                continue
            examples.append(_split(text, spans))
        else:
            examples.append(_pieces(record, kind, tokenizer.eot_id))

    if with_offsets:
        ids_list, targets = [], []
        for (text, spans), (ids, offsets) in zip(chats, tokenizer.encode_with_offsets([t for t, _ in chats])):
            offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            target = np.zeros(len(ids), dtype=bool)
            first, last = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)  # empty: one character
            for start, end in spans:  # a token overlapping an assistant's characters is a target
                if end > start:
                    target |= (first < end) & (last > start)
            ids_list.append(np.asarray(ids, dtype=np.int64))
            targets.append(target)
        lengths = np.array([len(ids) for ids in ids_list], dtype=np.int64)
        loss_mask = np.concatenate(targets) if targets else np.zeros(0, bool)
    else:  # every piece of every example in one list: one concatenation, flags repeated
        texts = [p for pieces in examples for p, _ in pieces if isinstance(p, str)]
        encoded = iter(_encode_texts(texts, tokenizer))
        ids_list = [next(encoded) if isinstance(p, str) else np.array([p]) for pieces in examples for p, _ in pieces]
        piece_lengths = np.array([len(ids) for ids in ids_list], dtype=np.int64)
        flags = np.array([flag for pieces in examples for _, flag in pieces], dtype=bool)
        owner = np.repeat(np.arange(len(examples)), [len(pieces) for pieces in examples])
        lengths = np.bincount(owner, weights=piece_lengths, minlength=len(examples)).astype(np.int64)
        loss_mask = np.repeat(flags, piece_lengths)
    tokens = np.concatenate(ids_list) if ids_list else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    loss_mask[offsets[:-1][lengths > 0]] = False  # an example's first token follows nothing of it
    return tokens.astype(token_dtype(tokenizer.vocab_size)), loss_mask, offsets


def encode_example(record: dict, tokenizer: Tokenizer,
                   chat_template: ChatTemplate | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One example as ``(tokens, loss_mask)``: ``loss_mask[i]`` is True when token ``i`` is
    a completion (assistant) token the model must predict (never the first token)."""
    tokens, loss_mask, _ = encode_examples([record], tokenizer, chat_template)
    return tokens.astype(np.int64), loss_mask


# ---- packing ---------------------------------------------------------------------------------

class SFTDataset(torch.utils.data.Dataset):
    """Fine-tuning examples packed into samples of ``seq_len`` inputs.

    ``source`` is a fine-tuning ``.jsonl`` file or the records themselves (dicts of one
    shape). ``chat_template``: default, the tokenizer's own (:func:`load_chat_template`).
    Items are dicts of int64 tensors of length ``seq_len``: ``tokens``, ``labels`` (the next
    token where it is a target, else IGNORE_INDEX) and ``documents`` (the example of the
    sample each token belongs to, from 0; the padding after the last one is one more).

    The examples sit in memory as one token array, one target mask and their offsets; a
    sample is a contiguous run of whole examples (``sample_examples[k]`` to
    ``sample_examples[k + 1]``), padded with eot (0 without one). Counts for the run's
    report: ``num_examples``, ``truncated`` (examples longer than ``seq_len + 1`` tokens,
    cut to their first ``seq_len + 1``) and ``loss_tokens`` (labels that carry a loss, in
    all samples together).
    """

    def __init__(self, source: str | os.PathLike | Iterable[dict], tokenizer: Tokenizer, seq_len: int,
                 chat_template: ChatTemplate | None = None) -> None:
        if seq_len < 1:
            raise DataError(f"--seq-len {seq_len}: must be at least 1")
        if isinstance(source, (str, os.PathLike)):
            path, (records, numbers) = source, _read_records(source)
        else:
            path, records, numbers = None, list(source), None
        if chat_template is None:
            chat_template = load_chat_template(tokenizer)
        tokens, loss_mask, offsets = encode_examples(records, tokenizer, chat_template, path, numbers)

        window = seq_len + 1
        lengths = np.diff(offsets)
        kept = np.minimum(lengths, window)
        keep = np.arange(len(tokens)) - np.repeat(offsets[:-1], lengths) < np.repeat(kept, lengths)
        self.tokens, self.loss_mask = tokens[keep], loss_mask[keep]
        self.offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
        self.seq_len = seq_len
        self.pad_id = tokenizer.eot_id if tokenizer.eot_id is not None else 0
        self.chat_template = chat_template
        self.num_examples = len(records)
        self.truncated = int((lengths > window).sum())
        self.loss_tokens = int(self.loss_mask.sum())
        # examples whose completion the truncation cut away whole
        before = np.concatenate([[0], np.cumsum(loss_mask, dtype=np.int64)])[offsets]
        after = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])[self.offsets]
        self.lost = int(((np.diff(before) > 0) & (np.diff(after) == 0)).sum())

        starts, fill = [], window + 1  # greedy, in order: a new sample when the example does not fit
        for k, n in enumerate(kept.tolist()):
            if fill + n > window:
                starts.append(k)
                fill = 0
            fill += n
        self.sample_examples = np.array(starts + [self.num_examples], dtype=np.int64)
        # each sample's loss-bearing labels: the targets after its first token (labels are
        # the inputs shifted by one), known on the host for every sample (count_loss_tokens)
        ends = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        first = self.offsets[self.sample_examples]
        self.sample_loss_tokens = ends[first[1:]] - ends[np.minimum(first[:-1] + 1, first[1:])]

    def __len__(self) -> int:
        return len(self.sample_examples) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        first, end = self.sample_examples[i], self.sample_examples[i + 1]
        lo, hi = self.offsets[first], self.offsets[end]
        n, window = hi - lo, self.seq_len + 1
        tokens = np.full(window, self.pad_id, dtype=np.int64)
        tokens[:n] = self.tokens[lo:hi]
        target = np.zeros(window, dtype=bool)
        target[:n] = self.loss_mask[lo:hi]
        documents = np.full(window, end - first, dtype=np.int64)
        documents[:n] = np.repeat(np.arange(end - first), np.diff(self.offsets[first : end + 1]))
        labels = np.where(target[1:], tokens[1:], IGNORE_INDEX)
        return {"tokens": torch.from_numpy(tokens[:-1]), "labels": torch.from_numpy(labels),
                "documents": torch.from_numpy(documents[:-1])}

    def count_loss_tokens(self, ids: np.ndarray) -> int:
        """The labels that carry a loss in samples ``ids``, from the host's counts (no
        sample is read): what the trainer divides the step's loss by."""
        return int(self.sample_loss_tokens[np.asarray(ids, dtype=np.int64)].sum())

    def summary(self) -> str:
        """One line for the run's report."""
        cut = f", {self.truncated} truncated to {self.seq_len + 1} tokens" if self.truncated else ""
        lost = (f" ({self.lost} examples lost every completion token to the truncation: a longer --seq-len "
                "keeps them)") if self.lost else ""
        return (f"{self.num_examples} fine-tuning examples in {len(self)} samples of {self.seq_len} tokens{cut}; "
                f"{self.loss_tokens} tokens carry the loss{lost}")

    def check_loss_tokens(self, flag: str, path) -> None:
        """Refuse a source none of whose labels carries a loss (0/0 would be its loss)."""
        if self.loss_tokens == 0:
            why = (f"{self.truncated} of its {self.num_examples} examples are longer than --seq-len {self.seq_len} "
                   f"+ 1 tokens and keep only prompt" if self.truncated else "its examples have no completion tokens")
            raise DataError(f"{flag} {path}: no token of it counts in the loss at --seq-len {self.seq_len} ({why}); "
                            "pass a longer --seq-len or shorten the prompts")
