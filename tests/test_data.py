"""Tests for gridtrain.data: tokenizers, corpora, token files, datasets and the sampler."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gridtrain.data import (
    ByteTokenizer,
    DataError,
    GlobalBatchSampler,
    HFTokenizer,
    TokenIdError,
    TokenWindows,
    WindowSubset,
    build_datasets,
    builtin_corpus_files,
    builtin_corpus_root,
    collate,
    find_token_header,
    load_tokenizer,
    load_tokens,
    prepare,
    read_token_file,
    split_windows,
    unigram_entropy,
    write_token_file,
)
from gridtrain.data.datasets import HeldOut
from gridtrain.data.mixture import MixtureDataset

TEXTS = {
    "b.txt": "second document, with ünïcödé ✓\n",
    "a.txt": "first document\nline two\n",
    "sub/c.md": "third: 日本語\n",
}


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """A folder with three text documents, plus files that must be skipped."""
    root = tmp_path / "corpus"
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden.txt").write_text("hidden", encoding="utf-8")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("hidden dir", encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    return root


def expected_byte_tokens(texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for k, text in enumerate(texts):
        if k:
            ids.append(256)
        ids.extend(text.encode("utf-8"))
    return np.array(ids, dtype=np.uint16)


# ---------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "hello, wörld — 日本語 🎉"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eot_id, tok.name) == (257, 256, "byte")


def test_byte_tokenizer_eot_renders_as_newline():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("ab") + [tok.eot_id] + tok.encode("cd")) == "ab\ncd"
    assert tok.decode([0xFF]) == "\ufffd"  # a lone invalid byte is replaced, not an error


def test_load_tokenizer_default_is_byte():
    assert isinstance(load_tokenizer(None), ByteTokenizer)


# ----------------------------------------------------------------------- built-in corpus


def test_builtin_corpus_files_sorted_and_stdlib_only():
    files = builtin_corpus_files()
    root = builtin_corpus_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    for r in rel:
        parts = set(r.split("/"))
        assert not parts & {"site-packages", "dist-packages", "__pycache__"}, r


def test_builtin_corpus_loads_quickly_with_plausible_entropy():
    tok = ByteTokenizer()
    start = time.perf_counter()
    tokens = load_tokens(None, tok)
    seconds = time.perf_counter() - start
    entropy = unigram_entropy(tokens, tok.vocab_size)
    info = f"{len(tokens)} tokens in {seconds:.2f}s, unigram entropy {entropy:.3f} nats/byte"
    print(info)
    assert tokens.dtype == np.uint16 and tokens.ndim == 1
    assert len(tokens) > 1_000_000, info
    assert seconds < 5.0, info
    assert 2.0 < entropy < 6.0, info
    assert int(tokens.max()) <= 256


def test_unigram_entropy_known_values():
    assert unigram_entropy(np.array([3, 3, 3], dtype=np.uint16), 8) == 0.0
    uniform = np.arange(16, dtype=np.uint16).repeat(5)
    assert unigram_entropy(uniform, 16) == pytest.approx(np.log(16))


# ------------------------------------------------------------------------------ sources


def test_text_folder_and_token_file_give_identical_tokens(corpus_dir: Path, tmp_path: Path):
    tok = ByteTokenizer()
    order = ["a.txt", "b.txt", "sub/c.md"]  # sorted relative paths; hidden/binary skipped
    expected = expected_byte_tokens([TEXTS[n] for n in order])

    from_folder = load_tokens(corpus_dir, tok)
    np.testing.assert_array_equal(from_folder, expected)

    # A single file is one document (eot only separates files): same as a one-file folder.
    one_file_dir = tmp_path / "one"
    one_file_dir.mkdir()
    (one_file_dir / "b.txt").write_bytes((corpus_dir / "b.txt").read_bytes())
    from_file = load_tokens(corpus_dir / "b.txt", tok)
    np.testing.assert_array_equal(from_file, expected_byte_tokens([TEXTS["b.txt"]]))
    np.testing.assert_array_equal(load_tokens(one_file_dir, tok), from_file)

    bin_path = prepare(corpus_dir, tmp_path / "out" / "tokens")
    assert bin_path == tmp_path / "out" / "tokens.bin"
    for ref in (bin_path, bin_path.with_suffix(".json"), tmp_path / "out" / "tokens"):
        from_file = load_tokens(ref, tok)
        assert isinstance(from_file, np.memmap), ref
        np.testing.assert_array_equal(from_file, expected)


def test_token_file_is_memory_mapped_with_header(corpus_dir: Path, tmp_path: Path):
    bin_path = prepare(corpus_dir, tmp_path / "tok.bin")
    tokens, header = read_token_file(bin_path)
    assert isinstance(tokens, np.memmap) and tokens.mode == "r"
    assert header == {
        "format": "gridtrain-tokens",
        "version": 2,
        "dtype": "uint16",
        "num_tokens": len(tokens),
        "vocab_size": 257,
        "tokenizer": "byte",
        "num_documents": 3,
        "index": "tok.idx",
        "unigram_entropy": pytest.approx(unigram_entropy(tokens, 257), rel=1e-12),
        "max_id": int(tokens.max()),  # 256: the eot between documents
    }
    assert bin_path.stat().st_size == 2 * len(tokens)
    assert find_token_header(bin_path) == bin_path.with_suffix(".json")
    assert not [p for p in bin_path.parent.iterdir() if p.name.endswith(".tmp")]


def test_missing_path_is_a_data_error(tmp_path: Path):
    missing = tmp_path / "nonexistent"
    with pytest.raises(DataError, match=re.escape(f"--data {missing}: no such file or directory")):
        load_tokens(missing, ByteTokenizer())


def test_empty_folder_is_a_data_error(tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(b"\xff\xfe\xfd")
    with pytest.raises(DataError, match=re.escape(str(empty))):
        load_tokens(empty, ByteTokenizer())


def test_empty_file_is_a_data_error(tmp_path: Path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=re.escape(str(empty)) + ".*empty"):
        load_tokens(empty, ByteTokenizer())


def test_binary_file_named_directly_is_a_data_error(tmp_path: Path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\xff\xfe\xfd")
    with pytest.raises(DataError, match="not UTF-8"):
        load_tokens(blob, ByteTokenizer())


def test_truncated_token_file_is_a_data_error(corpus_dir: Path, tmp_path: Path):
    bin_path = prepare(corpus_dir, tmp_path / "tok")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DataError, match="re-run `gridtrain prepare`"):
        load_tokens(bin_path, ByteTokenizer())


class _FakeTokenizer:
    name = "/some/tokenizer.json"
    vocab_size = 1000
    eot_id = None


def test_token_file_vocab_mismatch_is_a_data_error(corpus_dir: Path, tmp_path: Path):
    bin_path = prepare(corpus_dir, tmp_path / "tok")
    with pytest.raises(DataError, match=re.escape(str(bin_path)) + ".*vocab 257.*vocab 1000"):
        load_tokens(bin_path, _FakeTokenizer())


# ------------------------------------------------------------------------------ datasets


def test_token_windows_labels_are_shifted_tokens():
    tokens = np.arange(23, dtype=np.uint16)
    ds = TokenWindows(tokens, seq_len=5)
    assert len(ds) == (23 - 1) // 5 == 4
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["tokens"].dtype == torch.long and sample["tokens"].shape == (5,)
        assert torch.equal(sample["tokens"], torch.arange(i * 5, i * 5 + 5))
        assert torch.equal(sample["labels"], torch.arange(i * 5 + 1, i * 5 + 6))
    with pytest.raises(IndexError):
        ds[4]


def test_windows_use_the_extra_token_exactly():
    assert len(TokenWindows(np.zeros(21, np.uint16), 5)) == 4  # 4*5 + 1 tokens suffice
    assert len(TokenWindows(np.zeros(20, np.uint16), 5)) == 3


def test_split_is_disjoint_and_covers_all():
    train, valid = split_windows(1000, valid_every=100)
    assert len(valid) == 10 and set(valid) == {99 + 100 * k for k in range(10)}
    assert not set(train) & set(valid)
    np.testing.assert_array_equal(np.sort(np.concatenate([train, valid])), np.arange(1000))


def test_build_datasets_and_collate(tmp_path: Path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 100)  # 1000 tokens
    train, valid, tokens = build_datasets(text, ByteTokenizer(), seq_len=4, valid_every=10)
    assert len(tokens) == 1000
    assert len(train) + len(valid) == (1000 - 1) // 4
    assert isinstance(train, WindowSubset)
    assert torch.equal(valid[0]["tokens"], TokenWindows(tokens, 4)[9]["tokens"])
    batch = collate(train, [0, 2, 5])
    assert batch["tokens"].shape == batch["labels"].shape == (3, 4)
    assert torch.equal(batch["tokens"][1], train[2]["tokens"])


def _token_file_with_bad_ids(tmp_path: Path, offsets, bad_id: int = 300, num_tokens: int = 8000) -> Path:
    """A byte-tokenizer token file written by gridtrain (its header's max_id valid), then
    ids beyond the vocabulary (257) written into its .bin at ``offsets``, the header
    left alone: a corrupt file that the pre-start check cannot see."""
    tokens = np.random.default_rng(0).integers(0, 256, num_tokens)
    bin_path = write_token_file(tokens, tmp_path / "corpus", ByteTokenizer())
    array = np.memmap(bin_path, dtype="<u2", mode="r+")
    array[offsets] = bad_id
    array.flush()
    del array
    return bin_path


def test_collate_refuses_a_token_id_outside_the_vocabulary(tmp_path: Path):
    """The id is found on the host, in the batch, and named with the .bin, its offset in
    it, the id and the vocabulary; a bad id at a window's last token (a label only) too,
    through the held-out split and a mixture."""
    seq_len = 8
    bin_path = _token_file_with_bad_ids(tmp_path, [3 * seq_len + 5, 10 * seq_len])
    assert read_token_file(bin_path)[1]["max_id"] < 257  # the header still says the file is fine
    train, _, _ = build_datasets(bin_path, ByteTokenizer(), seq_len=seq_len)  # windows 0..98 train in order
    assert torch.equal(collate(train, [0, 1])["tokens"], collate(train, [0, 1], vocab_size=257)["tokens"])
    assert collate(train, [3]) is not None  # without a vocabulary, no check (as before)
    with pytest.raises(TokenIdError) as e:
        collate(train, [0, 3, 4], vocab_size=257)
    message = str(e.value)
    assert isinstance(e.value, DataError) and "\n" not in message
    assert message.startswith(f"{bin_path.resolve()}: token {3 * seq_len + 5} (counting from 0) is id 300, ")
    assert "--vocab-size 257" in message and "gridtrain prepare" in message
    # offset 80 is window 10's first input and window 9's last label: window 9 alone holds it as a label
    with pytest.raises(TokenIdError, match=rf": token {10 * seq_len} \(counting from 0\) is id 300,.*-100 for no loss"):
        collate(train, [9], vocab_size=257)
    # the same place through a held-out split (every 4th window: its item 0 is window 3) in a mixture
    windows = TokenWindows(read_token_file(bin_path)[0], seq_len)
    mixture = MixtureDataset([HeldOut(windows, 4, held=True), TokenWindows(np.zeros(100, np.int64), seq_len)],
                             ["corpus", "zeros"], [1.0, 1.0])
    with pytest.raises(TokenIdError, match=rf"corpus.bin: token {3 * seq_len + 5} \("):
        collate(mixture, [len(mixture) - 1, 0], vocab_size=257)


def test_collate_checks_labels_except_the_ignore_index():
    """Labels may be -100 (no loss) and nothing else outside the vocabulary; a dataset
    that cannot say where a sample comes from is named by sample and position."""
    tokens = torch.arange(6)

    class Samples(torch.utils.data.Dataset):
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    good = Samples([{"tokens": tokens, "labels": torch.tensor([-100, -100, 3, 4, 5, -100])}] * 3)
    assert collate(good, [0, 1, 2], vocab_size=6)["labels"].shape == (3, 6)
    bad_label = Samples(good.items + [{"tokens": tokens, "labels": torch.tensor([-100, -5, 3, 4, 5, -100])}])
    with pytest.raises(TokenIdError, match=r"^sample 3 of the data, labels position 1 is id -5, outside the "
                                           r"vocabulary \(--vocab-size 6: ids 0..5, and -100 for no loss\)"):
        collate(bad_label, [0, 3], vocab_size=6)
    negative = Samples([{"tokens": torch.tensor([0, 1, -100, 3, 4, 5]), "labels": tokens}])
    with pytest.raises(TokenIdError, match=r"^sample 0 of the data, tokens position 2 is id -100, .*ids 0..5\)"):
        collate(negative, [0], vocab_size=6)  # -100 is no token id
    with pytest.raises(TokenIdError, match=r"tokens position 5 is id 5, .*--vocab-size 5: ids 0..4\)"):
        collate(good, [2], vocab_size=5)


def _first_token_of_rank(argv: list[str], dp_rank: int) -> int:
    """The token offset where the first sample of step 1 of ``gridtrain train ARGV`` on
    data-parallel rank ``dp_rank`` begins (one source's training windows, as
    :func:`split_windows` lists them)."""
    from gridtrain.cli.parser import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["train", *argv]))
    t, seq_len = cfg.training, cfg.model.seq_len
    path = cfg.data.path
    train_ids, _ = split_windows((read_token_file(path)[1]["num_tokens"] - 1) // seq_len, cfg.data.valid_every)
    sampler = GlobalBatchSampler(len(train_ids), t.global_batch_size, t.micro_batch_size, cfg.parallel.dp, dp_rank,
                                 t.seed)
    return int(train_ids[sampler.micro_batches(0)[0][0]]) * seq_len


@pytest.mark.spawn
@pytest.mark.parametrize("layout", [[], ["--nproc", "2", "--dp", "2"]], ids=["one-process", "nproc2-dp2"])
def test_train_on_a_token_file_with_ids_beyond_the_vocabulary_stops_in_one_line(tmp_path: Path, layout):
    """A token file whose header passes the pre-start check but whose .bin holds ids the
    model cannot embed stops the run when a batch holds one, before the embedding: one
    line naming the file, the token's offset, the id and the vocabulary, exit status 2,
    no traceback. In one process every 100th token is bad; on dp 2 one token, read by
    rank 1 alone (rank 0 goes on to wait for it in the gradient all-reduce): the worker's
    stop reaches the launcher as the same line."""
    bin_path = _token_file_with_bad_ids(tmp_path, [])
    argv = ["--model", "tiny", "--data", str(bin_path), "--steps", "2", "--no-progress", "--sample-tokens", "0",
            *layout]
    if layout:
        offsets = np.array([_first_token_of_rank(argv, dp_rank=1) + 7])
    else:
        offsets = np.arange(50, 8000, 100)
    _token_file_with_bad_ids(tmp_path, offsets)
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    found = re.fullmatch(rf"gridtrain: error: {re.escape(str(bin_path.resolve()))}: token (\d+) \(counting from 0\) "
                         r"is id 300, outside the vocabulary \(--vocab-size 257: ids 0\.\.256.*\); .*gridtrain prepare`",
                         last)
    assert found, last
    assert int(found.group(1)) in offsets  # the offset named is one of the bad tokens
    assert sum("gridtrain: error" in line for line in proc.stderr.splitlines()) == 1


def test_build_datasets_too_small_names_sizes(tmp_path: Path):
    text = tmp_path / "t.txt"
    text.write_text("x" * 50)
    with pytest.raises(DataError, match=r"50 tokens give 12 windows.*--seq-len 4"):
        build_datasets(text, ByteTokenizer(), seq_len=4, valid_every=100)


# ------------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_dp_micro_batches_cut_the_global_batch_micro_batch_major(dp: int):
    samplers = [GlobalBatchSampler(1000, 32, 2, dp, r, seed=7) for r in range(dp)]
    for step in range(5):
        glob = samplers[0].global_batch(step)
        # global micro-batch j = the j-th micro-batch of every rank, in rank order
        together = [np.concatenate([s.micro_batches(step)[j] for s in samplers])
                    for j in range(samplers[0].num_micro_batches)]
        np.testing.assert_array_equal(np.concatenate(together), glob)
        for s in samplers:
            micro = s.micro_batches(step)
            assert len(micro) == s.num_micro_batches == 32 // (dp * 2)
            assert all(len(m) == 2 for m in micro)
            np.testing.assert_array_equal(np.concatenate(micro), s.local_batch(step))


def test_global_micro_batches_are_the_same_for_every_dp():
    """With the same number of micro-batches per step, the j-th global micro-batch (what MoE
    routing statistics are taken over) holds the same samples whatever dp is."""
    for m in (1, 2, 4):
        reference = GlobalBatchSampler(500, 16, 16 // m, 1, 0, seed=3)
        for dp in (2, 4):
            ranks = [GlobalBatchSampler(500, 16, 16 // (m * dp), dp, r, seed=3) for r in range(dp)]
            for step in range(5):
                for j in range(m):
                    np.testing.assert_array_equal(np.concatenate([s.micro_batches(step)[j] for s in ranks]),
                                                  reference.micro_batches(step)[j])


def test_global_batch_is_layout_independent():
    layouts = [(1, 1), (1, 16), (2, 4), (4, 2), (8, 1), (8, 2), (2, 8)]
    reference = GlobalBatchSampler(500, 16, 16, 1, 0, seed=3)
    for dp, micro in layouts:
        for rank in range(dp):
            s = GlobalBatchSampler(500, 16, micro, dp, rank, seed=3)
            for step in range(20):
                np.testing.assert_array_equal(s.global_batch(step), reference.global_batch(step))


def test_sampler_is_stateless_and_seeded():
    a = GlobalBatchSampler(100, 8, 2, 2, 1, seed=0)
    b = GlobalBatchSampler(100, 8, 2, 2, 1, seed=0)
    later = [a.local_batch(k) for k in range(30)]
    np.testing.assert_array_equal(b.local_batch(29), later[29])  # resume straight at step 29
    c = GlobalBatchSampler(100, 8, 2, 2, 1, seed=1)
    assert not np.array_equal(c.global_batch(0), a.global_batch(0))


def test_epoch_boundary_straddle_and_permutations():
    n, g = 10, 4  # steps 0,1 in epoch 0; step 2 straddles epochs 0 and 1
    s = GlobalBatchSampler(n, g, 1, 1, 0, seed=5)
    stream = np.concatenate([s.global_batch(k) for k in range(15)])  # 60 samples = 6 epochs
    for e in range(6):
        epoch = stream[e * n : (e + 1) * n]
        np.testing.assert_array_equal(np.sort(epoch), np.arange(n))
        np.testing.assert_array_equal(epoch, np.random.default_rng([5, e]).permutation(n))
    straddle = s.global_batch(2)
    np.testing.assert_array_equal(straddle[:2], s.epoch_permutation(0)[8:])
    np.testing.assert_array_equal(straddle[2:], s.epoch_permutation(1)[:2])


def test_global_batch_larger_than_dataset():
    s = GlobalBatchSampler(3, 8, 8, 1, 0, seed=0)
    stream = np.concatenate([s.global_batch(k) for k in range(3)])  # 24 = 8 epochs of 3
    for e in range(8):
        np.testing.assert_array_equal(np.sort(stream[3 * e : 3 * e + 3]), np.arange(3))


def test_bad_divisibility_is_a_data_error():
    with pytest.raises(DataError, match="global batch 10 is not divisible by micro-batch 4 x dp 2"):
        GlobalBatchSampler(100, 10, 4, 2, 0, seed=0)
    with pytest.raises(DataError, match="dp rank 2"):
        GlobalBatchSampler(100, 8, 2, 2, 2, seed=0)


# --------------------------------------------------------------------------- HF tokenizer


@pytest.fixture
def hf_tokenizer_path(tmp_path: Path, corpus_dir: Path) -> Path:
    import tokenizers  # in the test extra: the HF path is part of the contract

    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(TEXTS.values()) * 20, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_encode_decode(hf_tokenizer_path: Path):
    tok = load_tokenizer(hf_tokenizer_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eot_id == 1 and tok.vocab_size > 256
    text = "first document\nline two, ünïcödé"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == text
    assert tok.name == str(hf_tokenizer_path.resolve())


def test_hf_prepare_and_load(hf_tokenizer_path: Path, corpus_dir: Path, tmp_path: Path):
    tok = HFTokenizer(hf_tokenizer_path)
    expected: list[int] = []
    for k, name in enumerate(["a.txt", "b.txt", "sub/c.md"]):
        if k:
            expected.append(tok.eot_id)
        expected.extend(tok.encode(TEXTS[name]))
    np.testing.assert_array_equal(load_tokens(corpus_dir, tok), expected)

    bin_path = prepare(corpus_dir, tmp_path / "hf", tokenizer_path=hf_tokenizer_path)
    tokens, header = read_token_file(bin_path)
    np.testing.assert_array_equal(tokens, expected)
    assert header["tokenizer"] == tok.name and header["vocab_size"] == tok.vocab_size
    np.testing.assert_array_equal(load_tokens(bin_path, tok), expected)
    with pytest.raises(DataError, match="vocab"):
        load_tokens(bin_path, ByteTokenizer())


def test_hf_tokenizer_errors(tmp_path: Path):
    with pytest.raises(DataError, match="no such file"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(DataError, match=re.escape(str(bad))):
        HFTokenizer(bad)


def test_missing_tokenizers_package_is_a_data_error(monkeypatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes the import fail
    path = tmp_path / "tokenizer.json"
    with pytest.raises(DataError, match=re.escape(f"needed for {path}: pip install tokenizers")):
        HFTokenizer(path)
