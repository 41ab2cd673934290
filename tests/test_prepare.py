"""``gridtrain prepare`` (gridtrain/data/prepare.py): streaming, bounded memory, several
processes, the document index and the version-2 header; the output is always the token
array of the in-memory path (``load_tokens``), byte for byte."""

from __future__ import annotations

import json
import random
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from gridtrain.cli import parser as cli
from gridtrain.data import (ByteTokenizer, DataError, HFTokenizer, load_tokens, prepare, read_document_index,
                            read_token_file, unigram_entropy)
from gridtrain.data.token_files import open_token_file

WORDS = ["the", "quick", "brown", "fox", "jumps", "über", "日本語", "lazy", "dog", "x", "42", ".", ",", "é"]


def _text(rng: random.Random, n_words: int) -> str:
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS))
        out.append(rng.choice([" ", " ", " ", "\n", "  ", "\n\n", " \n", "\t"]))
    return "".join(out)


def _tokenizer_json(path: Path, texts: list[str], eot: bool = True) -> Path:
    """A small byte-level BPE (GPT-2's pre-tokenizer), trained here: no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|endoftext|>"] if eot else ["<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Text files, JSON lines (blank lines, an empty text), an empty file, a binary."""
    rng = random.Random(7)
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(_text(rng, 300), "utf-8")
    lines = [json.dumps({"text": _text(rng, rng.randrange(1, 40))}) for _ in range(60)]
    lines[3], lines[10] = "", json.dumps({"text": ""})
    (root / "b.jsonl").write_text("\n".join(lines) + "\n", "utf-8")
    (root / "c_empty.txt").write_bytes(b"")
    (root / "d.bin").write_bytes(b"\xff\xfe\x00binary")
    (root / "sub" / "e.md").write_text(_text(rng, 2000), "utf-8")
    return root


@pytest.fixture
def hf_path(tmp_path: Path, corpus: Path) -> Path:
    return _tokenizer_json(tmp_path / "tokenizer.json", [(corpus / "sub" / "e.md").read_text("utf-8")])


def _tokens(bin_path: Path) -> np.ndarray:
    return np.asarray(read_token_file(bin_path)[0])


def _check_index(bin_path: Path, eot_id: int | None) -> np.ndarray:
    tokens, header = read_token_file(bin_path)
    index = read_document_index(bin_path)
    assert isinstance(index, np.memmap) and index.dtype == np.dtype("<i8")
    assert header["num_documents"] == len(index) and header["index"] == bin_path.with_suffix(".idx").name
    assert index[0] == 0 and np.all(np.diff(index) > 0) and index[-1] < len(tokens)
    if eot_id is not None:  # a document after the first begins at its eot, and only there
        eots = np.flatnonzero(np.asarray(tokens) == eot_id)
        np.testing.assert_array_equal(index[1:], eots)
    assert header["unigram_entropy"] == pytest.approx(unigram_entropy(tokens, header["vocab_size"]), rel=1e-12)
    assert header["max_id"] == int(np.asarray(tokens).max())  # checked against the run's vocabulary before start
    return np.asarray(index)


# ------------------------------------------------------------------------------ one process


def test_folder_equals_the_in_memory_path_with_the_index(corpus: Path, tmp_path: Path):
    tok = ByteTokenizer()
    expected = load_tokens(corpus, tok)
    for piece_bytes in (4 << 20, 97):  # whole files; and pieces cut inside files and JSON lines
        bin_path = prepare(corpus, tmp_path / f"out{piece_bytes}", piece_bytes=piece_bytes)
        np.testing.assert_array_equal(_tokens(bin_path), expected)
        index = _check_index(bin_path, tok.eot_id)
        documents = 1 + 58 + 1  # a.txt, the non-empty JSON lines, sub/e.md (empty and binary files add none)
        assert len(index) == documents
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_hugging_face_tokenizer_equals_the_in_memory_path(corpus: Path, hf_path: Path, tmp_path: Path):
    tok = HFTokenizer(hf_path)
    bin_path = prepare(corpus, tmp_path / "hf", hf_path, piece_bytes=97)
    np.testing.assert_array_equal(_tokens(bin_path), load_tokens(corpus, tok))
    _check_index(bin_path, tok.eot_id)
    assert read_token_file(bin_path)[1]["tokenizer"] == tok.name


def test_a_large_text_file_cut_into_pieces_tokenizes_as_a_whole(tmp_path: Path, hf_path: Path):
    """Cuts fall after a line break between printable characters: a pre-tokenizer
    boundary of byte-level BPE, so the tokens equal the whole file's."""
    big = tmp_path / "big.txt"
    big.write_text(_text(random.Random(3), 6000), "utf-8")
    for tokenizer_path, tok in ((None, ByteTokenizer()), (hf_path, HFTokenizer(hf_path))):
        bin_path = prepare(big, tmp_path / "big", tokenizer_path, piece_bytes=1000)
        np.testing.assert_array_equal(_tokens(bin_path), load_tokens(big, tok))
        np.testing.assert_array_equal(read_document_index(bin_path), [0])  # one file, one document


def test_without_eot_documents_begin_at_their_first_token(corpus: Path, tmp_path: Path):
    path = _tokenizer_json(tmp_path / "no_eot.json", [(corpus / "a.txt").read_text("utf-8")], eot=False)
    tok = HFTokenizer(path)
    assert tok.eot_id is None
    files = tmp_path / "three"
    files.mkdir()
    texts = ["first doc", "second one", "third"]
    for k, text in enumerate(texts):
        (files / f"{k}.txt").write_text(text)
    bin_path = prepare(files, tmp_path / "noeot", path)
    np.testing.assert_array_equal(_tokens(bin_path), load_tokens(files, tok))
    lengths = [len(tok.encode(t)) for t in texts]
    np.testing.assert_array_equal(_check_index(bin_path, None), np.cumsum([0] + lengths[:-1]))


def test_version_1_files_are_still_read(corpus: Path, tmp_path: Path):
    tokens = load_tokens(corpus, ByteTokenizer())
    bin_path = tmp_path / "old.bin"
    bin_path.write_bytes(tokens.astype("<u2").tobytes())
    bin_path.with_suffix(".json").write_text(json.dumps({
        "format": "gridtrain-tokens", "version": 1, "dtype": "uint16", "num_tokens": len(tokens),
        "vocab_size": 257, "tokenizer": "byte"}))
    np.testing.assert_array_equal(load_tokens(bin_path, ByteTokenizer()), tokens)
    assert read_document_index(bin_path) is None
    # a token file as prepare's source is copied, with the index its eot tokens imply
    again = prepare(bin_path, tmp_path / "new")
    np.testing.assert_array_equal(_tokens(again), tokens)
    _check_index(again, 256)


def test_bad_inputs_are_one_line(corpus: Path, tmp_path: Path):
    def refused(match: str, *args, **kwargs):
        with pytest.raises(DataError, match=match) as info:
            prepare(*args, **kwargs)
        assert "\n" not in str(info.value)

    refused("no such file or directory", tmp_path / "missing", tmp_path / "o")
    refused(r"not UTF-8 text", corpus / "d.bin", tmp_path / "o")
    refused(r"empty", corpus / "c_empty.txt", tmp_path / "o")
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    (empty_dir / "x.bin").write_bytes(b"\xff")
    refused(r"no UTF-8 text files", empty_dir, tmp_path / "o")
    refused(r"--workers 0", corpus, tmp_path / "o", workers=0)
    bad = tmp_path / "bad.jsonl"  # the bad line sits in a later piece: numbered from the file's start
    bad.write_text("".join(json.dumps({"text": f"line {k}"}) + "\n" for k in range(40)) + '{"txt": 1}\n')
    with pytest.raises(DataError) as in_memory:
        load_tokens(bad, ByteTokenizer())
    refused(re.escape(str(in_memory.value)), bad, tmp_path / "o", piece_bytes=64)
    assert "line 41 " in str(in_memory.value)

    bin_path = prepare(corpus, tmp_path / "tok")
    index_path = bin_path.with_suffix(".idx")
    index_path.write_bytes(index_path.read_bytes()[:-8])
    with pytest.raises(DataError, match=r"document index .* re-run `gridtrain prepare`$"):
        read_document_index(bin_path)
    assert open_token_file(bin_path, ByteTokenizer()) is not None  # the tokens themselves still read


@pytest.mark.slow
def test_memory_stays_bounded_for_a_corpus_many_times_larger(tmp_path: Path):
    """48 MB of text (one 32 MB file, 16 MB of JSON lines) prepared under a 10 MB peak of
    traced allocations (numpy's arrays included)."""
    root = tmp_path / "big"
    root.mkdir()
    rng = np.random.default_rng(0)
    alphabet = np.frombuffer(b"abcdefghij klmnopqrstuvwxyz\n .,;", dtype=np.uint8)
    block = alphabet[rng.integers(0, len(alphabet), 1 << 20, dtype=np.int32)].tobytes()
    (root / "a.txt").write_bytes(block * 32 + "ünïcödé".encode())
    line = json.dumps({"text": "x" * 1000}) + "\n"
    (root / "b.jsonl").write_text(line * ((16 << 20) // len(line)))
    bound = 10 << 20

    tracemalloc.start()
    try:
        bin_path = prepare(root, tmp_path / "tok")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < bound, f"peak {peak / 2**20:.1f} MiB"
    tokens = np.asarray(read_token_file(bin_path)[0])
    assert np.array_equal(tokens, load_tokens(root, ByteTokenizer()))
    assert len(tokens) > 4.5 * bound
    assert len(read_document_index(bin_path)) == 1 + (16 << 20) // len(line)


# ------------------------------------------------------------------------------ several processes


@pytest.mark.spawn
def test_two_workers_write_what_one_writes(corpus: Path, hf_path: Path, tmp_path: Path):
    for tokenizer_path in (None, hf_path):
        for piece_bytes in (4 << 20, 97):  # shares by file; and inside a text file and a JSON-lines file
            one = prepare(corpus, tmp_path / "one", tokenizer_path, piece_bytes=piece_bytes)
            expected = (one.read_bytes(), one.with_suffix(".idx").read_bytes(),
                        read_token_file(one)[1]["unigram_entropy"])
            for workers in (2, 3):
                many = prepare(corpus, tmp_path / f"w{workers}", tokenizer_path, workers=workers,
                               piece_bytes=piece_bytes)
                got = (many.read_bytes(), many.with_suffix(".idx").read_bytes(),
                       read_token_file(many)[1]["unigram_entropy"])
                assert got == expected, (tokenizer_path, piece_bytes, workers)


@pytest.mark.spawn
def test_cli_workers(corpus: Path, tmp_path: Path, capsys):
    assert cli.main(["prepare", "--data", str(corpus), "--out", str(tmp_path / "tok"), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'tok.bin'))} \([\d,]+ tokens, 60 documents\)\n", out)
    np.testing.assert_array_equal(_tokens(tmp_path / "tok.bin"), load_tokens(corpus, ByteTokenizer()))
    assert cli.main(["prepare", "--data", str(corpus), "--out", str(tmp_path / "t"), "--workers", "0"]) == 2
