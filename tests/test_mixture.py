"""Data mixtures: sources and weights as flags and YAML, the weighted sampler as data
(shares, layouts, resume, wraps, changed weights), and one real run that continues on
another layout with exactly the samples an uninterrupted run reads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gridtrain.config import ConfigError, load_config
from gridtrain.data import DataError, GlobalBatchSampler
from gridtrain.data.mixture import MixtureDataset, Source, parse_sources, source_names
from tests.training import relative_difference, tiny_config, train_in_process, train_layouts

# ---- naming sources ------------------------------------------------------------------------------


def test_sources_are_parsed_from_one_text():
    assert parse_sources(None) == [Source(None)]
    assert parse_sources("web.bin") == [Source("web.bin")]
    assert parse_sources("a,b.txt") == [Source("a,b.txt")]  # no weights: one path with a comma
    assert parse_sources("0.7:web.bin,0.2:code.bin, 1e-1:math.jsonl") == [
        Source("web.bin", 0.7), Source("code.bin", 0.2), Source("math.jsonl", 0.1)]
    assert source_names(parse_sources("3:a/web.bin,1:b/web.bin,1:code")) == ["web.0", "web.1", "code"]
    for bad, words in [("0.7:web.bin,code.bin", "has no weight"), ("0:web.bin,1:code.bin", "must be positive"),
                       ("1:a.txt,2:a.txt", "named twice"), ("0.7:a,-0.3:b", "source b has a negative weight"),
                       ("1e999:a", "--data 1e999:a: source a has a weight that is not finite")]:
        with pytest.raises(DataError, match=words):
            parse_sources(bad)


def test_a_yaml_list_of_sources_is_the_same_mixture(tmp_path):
    for spelled in ('["0.7:web.bin", "0.3:code.bin"]', "[{path: web.bin, weight: 0.7}, {path: code.bin, weight: 0.3}]"):
        (tmp_path / "c.yaml").write_text(f"data:\n  path: {spelled}\n  valid_data: [held.txt]\n")
        cfg = load_config(str(tmp_path / "c.yaml"))
        assert cfg.data.path == "0.7:web.bin,0.3:code.bin"
        assert parse_sources(cfg.data.valid_data) == [Source("held.txt")]
    (tmp_path / "c.yaml").write_text("data:\n  path: [3]\n")
    with pytest.raises(ConfigError, match="data.path: source 3 is neither"):
        load_config(str(tmp_path / "c.yaml"))


# ---- the weighted sampler, as data ----------------------------------------------------------------

SIZES, WEIGHTS = [1000, 300, 37], [0.7, 0.2, 0.1]


def _sampler(dp=1, rank=0, micro=2, sizes=SIZES, weights=WEIGHTS, batch=32, seed=7):
    return GlobalBatchSampler(sizes, batch, micro, dp, rank, seed=seed, weights=weights)


def test_each_source_gets_its_share_at_every_step_and_within_one_percent_over_1000_batches():
    s = _sampler()
    sources = np.concatenate([s.source_of(s.global_batch(k)) for k in range(1000)])
    shares = np.bincount(sources, minlength=3) / len(sources)  # every sample holds seq_len tokens: token shares
    assert np.all(np.abs(shares - WEIGHTS) <= 0.01 * np.asarray(WEIGHTS))
    for k in (1, 7, 100, 999):  # never a whole sample off its share, however small the source
        assert np.all(np.abs(s.drawn(k) - np.asarray(WEIGHTS) * k * 32) < 1)


def test_the_global_batch_is_the_same_on_every_data_parallel_size():
    reference = [_sampler(micro=8).global_batch(k) for k in range(40)]
    for dp in (1, 2, 4):
        ranks = [_sampler(dp, r, micro=8 // dp) for r in range(dp)]
        for k in range(40):
            parts = [r.micro_batches(k) for r in ranks]
            whole = np.concatenate([np.concatenate([p[j] for p in parts]) for j in range(len(parts[0]))])
            assert np.array_equal(whole, reference[k]), (dp, k)


def test_a_source_is_read_once_per_epoch_and_wraps_with_a_new_shuffle_that_is_reported():
    s = _sampler()
    ids = np.concatenate([s.global_batch(k) for k in range(60)])  # source 2 (37 samples) wraps several times
    small = ids[s.source_of(ids) == 2] - s.offsets[2]
    stream = s.streams[2].take(0, int(s.drawn(60)[2]))
    assert sorted(small) == sorted(stream)  # what was read is the source's stream so far (batches shuffle it)
    epochs = [stream[i:i + 37] for i in range(0, 37 * (len(stream) // 37), 37)]
    assert len(epochs) >= 4
    assert all(sorted(e) == list(range(37)) for e in epochs)  # each epoch reads every sample once
    assert len({tuple(e) for e in epochs}) == len(epochs)  # each with its own shuffle
    wraps = [(k, w) for k in range(60) for w in s.wrapped(k)]
    last_epoch = (int(s.drawn(60)[2]) - 1) // 37
    assert [w for _, w in wraps if w[0] == 2] == [(2, e) for e in range(1, last_epoch + 1)]
    for k, (source, epoch) in wraps:  # reported in the step where the count crosses the epoch's size
        assert s.drawn(k)[source] <= epoch * SIZES[source] < s.drawn(k + 1)[source]
    assert [w for _, w in wraps if w[0] == 0] == [(0, 1)]  # 1,344 of 1,000 samples read: one wrap


def test_a_resumed_sampler_continues_exactly_on_another_layout():
    uninterrupted = _sampler(micro=8)
    state = json.loads(json.dumps(_sampler(2, 1, micro=2).state(25)))  # as a checkpoint's meta.json holds it
    for dp in (1, 4):
        ranks = [_sampler(dp, r, micro=8 // dp) for r in range(dp)]
        assert all(r.restore(state, 25) is None for r in ranks)
        for k in range(25, 45):
            parts = [r.micro_batches(k) for r in ranks]
            whole = np.concatenate([np.concatenate([p[j] for p in parts]) for j in range(len(parts[0]))])
            assert np.array_equal(whole, uninterrupted.global_batch(k))


def test_new_weights_on_resume_apply_from_there_without_repaying_the_old_counts():
    state = _sampler().state(50)
    s = _sampler(weights=[0.2, 0.2, 0.6])
    note = s.restore(state, 50)
    assert "weights changed at step 50" in note
    before = s.drawn(50)
    assert np.array_equal(before, state["drawn"])
    since = s.drawn(150) - before
    assert np.all(np.abs(since - np.array([0.2, 0.2, 0.6]) * 100 * 32) < 1)
    with pytest.raises(DataError, match="has 3 sources but --data names 2"):
        _sampler(sizes=[10, 10], weights=[1, 1]).restore(state, 50)
    with pytest.raises(DataError, match="no per-source data position"):
        _sampler().restore({"next_step": 50}, 50)


def test_one_source_keeps_the_order_of_a_plain_sampler_and_the_first_source_of_a_mixture_its_own():
    alone = GlobalBatchSampler(100, 8, 2, seed=3)
    assert np.array_equal(alone.streams[0].take(0, 250), np.concatenate(
        [np.random.default_rng([3, e]).permutation(100) for e in range(3)])[:250])
    mixed = GlobalBatchSampler([100, 50], 8, 2, seed=3, weights=[1, 1])
    assert np.array_equal(mixed.streams[0].take(0, 100), alone.streams[0].take(0, 100))
    assert not np.array_equal(mixed.streams[1].take(0, 50), alone.streams[0].take(0, 50)[:50])
    with pytest.raises(DataError, match="2 sources need weights"):
        GlobalBatchSampler([100, 50], 8, 2)


def test_the_mixture_dataset_reads_each_source_by_flat_id():
    data = MixtureDataset([list("abc"), list("de")], ["x", "y"], [1, 1])
    assert len(data) == 5 and [data[i] for i in range(5)] == list("abcde")


# ---- one real run: a mixture resumed on another layout --------------------------------------------


def _corpora(root) -> str:
    """Three small sources of different kinds (a text file, a folder, JSON lines) and sizes."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    (root / "web.txt").write_text(" ".join(rng.choice(words, 3000)))
    (root / "code").mkdir()
    for i in range(3):
        (root / "code" / f"f{i}.py").write_text("\n".join(f"def f{i}_{j}(x):\n    return x * {j}" for j in range(60)))
    (root / "math.jsonl").write_text("\n".join(json.dumps({"text": f"{a} + {b} = {a + b}"})
                                               for a in range(40) for b in range(9)))
    return f"0.5:{root / 'web.txt'},0.3:{root / 'code'},0.2:{root / 'math.jsonl'}"


def _mixture_config(data: str, **fields):
    cfg = tiny_config(**{**dict(steps=6, global_batch_size=8, micro_batch_size=2, eval_interval=3, eval_iters=1),
                         **fields})
    cfg.data.path, cfg.data.valid_every = data, 10
    return cfg


@pytest.mark.spawn
def test_a_mixture_resumed_on_another_layout_reads_what_an_uninterrupted_run_reads(tmp_path):
    """One process (6 steps) against dp 2 (saving after step 3) and its checkpoint
    resumed on tp 2: the same losses, grad norms and per-source validation losses
    (1e-9), so the same samples in the same order; the checkpoints' per-source counts
    agree."""
    data = _corpora(tmp_path)
    reference = train_in_process(_mixture_config(data, save=str(tmp_path / "one"), save_interval=3))
    assert set(reference["valid_by_source"]) == {"web", "code", "math"}
    saved, resumed = train_layouts([
        _mixture_config(data, dp=2, save=str(tmp_path / "dp2"), save_interval=3),
        _mixture_config(data, tp=2, load=str(tmp_path / "dp2" / "step_0000003")),
    ], 2)
    for run in saved:
        assert relative_difference(run["losses"], reference["losses"]) <= 1e-9
    for run in resumed:
        assert relative_difference(run["losses"], reference["losses"][3:]) <= 1e-9
        assert relative_difference(run["grad_norms"], reference["grad_norms"][3:]) <= 1e-9
        for name, loss in reference["valid_by_source"].items():
            assert abs(run["valid_by_source"][name] - loss) <= 1e-9 * loss, name
    meta = [json.loads((tmp_path / d / "step_0000003" / "meta.json").read_text())["data"] for d in ("one", "dp2")]
    assert meta[0]["drawn"] == meta[1]["drawn"] and sum(meta[0]["drawn"]) == 3 * 8
    assert meta[0]["sources"] == ["web", "code", "math"]


@pytest.mark.parametrize("name", ["mixture", "finetune-llama"])
def test_the_example_configs_load_and_pass_the_checks_that_need_no_files(name):
    """configs/examples/ hold placeholders for the user's files: everything but the
    files is checked (the layout, the schedule, the sources and their weights)."""
    from gridtrain.training.validate import validate
    cfg = load_config(f"configs/examples/{name}.yaml")
    cfg.checkpoint.init_from = None  # a model directory the user downloads
    world, cfg.parallel.nproc = cfg.parallel.nproc, None  # GPUs of the user's machine, not this host's cores
    validate(cfg, world_size=world, data=False)
    if name == "mixture":
        assert [s.weight for s in parse_sources(cfg.data.path)] == [0.6, 0.2, 0.1, 0.1]


# ---- documents in windows (what --document-mask reads) -------------------------------------------


def test_windows_say_which_document_each_token_is_in_from_the_eot_or_the_index():
    """The end-of-text token opens the next document (a BOS): the token before it ends its
    document with the end of text as its label. Found in the window (eot) or from the
    token offsets of an index; both give the same ids."""
    from gridtrain.data import TokenWindows
    eot = 9
    tokens = np.array([1, 2, eot, 3, 4, 5, eot, 6, eot, 7, 8, 1, 2, 3, 4, 5, 6], dtype=np.uint16)
    starts = np.array([0, 2, 6, 8])
    for windows in (TokenWindows(tokens, 4, documents=True, eot=eot),
                    TokenWindows(tokens, 4, documents=True, starts=starts)):
        got = [windows[i]["documents"].tolist() for i in range(len(windows))]
        assert got == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]  # window 2 opens with an eot
        assert windows[0]["labels"].tolist() == [2, eot, 3, 4]
    assert "documents" not in TokenWindows(tokens, 4, eot=eot)[0]
    with pytest.raises(DataError, match="--document-mask needs document boundaries"):
        TokenWindows(tokens, 4, documents=True)


@pytest.mark.slow
def test_a_large_token_file_costs_a_rank_its_shuffle_index_and_batches_not_the_file(tmp_path):
    """Training data over a 96 MB token file (48M tokens): building the datasets and the
    sampler and reading batches allocates the shuffle index of the epoch (8 bytes per
    window) and the batches, never the tokens (memory-mapped) nor a list of windows."""
    import tracemalloc

    from gridtrain.data import ByteTokenizer, write_token_file
    from gridtrain.training.providers import text_datasets_provider
    from gridtrain.training.trainer import train_sampler
    n = 48 << 20
    tokens = np.lib.format.open_memmap(tmp_path / "scratch.npy", mode="w+", dtype=np.uint16, shape=(n,))
    tokens[:] = np.arange(n, dtype=np.int64) % 251
    write_token_file(tokens, tmp_path / "big", ByteTokenizer())
    cfg = tiny_config(global_batch_size=32, micro_batch_size=4)
    cfg.data.path = str(tmp_path / "big.bin")
    tracemalloc.start()
    data = text_datasets_provider(cfg)
    ctx = type("Ctx", (), {"grid": type("G", (), {"dp": 1})(), "coords": type("C", (), {"dp": 0})()})()
    sampler = train_sampler(data, cfg, ctx)
    for step in range(3):
        [data.train[int(i)] for ids in sampler.micro_batches(step) for i in ids]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    windows = (n - 1) // cfg.model.seq_len
    assert len(data.train) + len(data.valid) == windows
    assert peak < 2 * 8 * windows + (4 << 20), peak  # the shuffle index (and its making), plus change


def test_a_bad_source_of_a_mixture_is_one_line_before_any_process_starts(tmp_path):
    from gridtrain.training.validate import validate
    (tmp_path / "web.txt").write_text("x" * 20000)
    (tmp_path / "chat.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": 3}\n')
    cases = [(f"0.5:{tmp_path / 'web.txt'},0.5:{tmp_path / 'missing.bin'}", None, "missing.bin: no such file"),
             (f"0.5:{tmp_path / 'web.txt'},0.5:{tmp_path / 'chat.jsonl'}", None, "chat.jsonl: line 2"),
             (f"0.5:{tmp_path / 'web.txt'},{tmp_path / 'chat.jsonl'}", None, "has no weight"),
             (str(tmp_path / "web.txt"), str(tmp_path / "nowhere.txt"), "nowhere.txt: no such file")]
    for data, valid, words in cases:
        cfg = tiny_config()
        cfg.data.path, cfg.data.valid_data = data, valid
        with pytest.raises(ConfigError, match=words) as info:
            validate(cfg, world_size=1)
        assert "\n" not in str(info.value)
    cfg = tiny_config()
    cfg.data.path, cfg.data.valid_data = str(tmp_path / "web.txt"), str(tmp_path / "web.txt")
    assert validate(cfg, world_size=1) is cfg  # nothing held out: 312 windows train, all of them validate
