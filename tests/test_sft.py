"""Supervised fine-tuning data (gridtrain.data.sft): shapes, rendering, targets, packing.

Everything runs in one process; the comparison with transformers' apply_chat_template is
marked slow (importing transformers takes seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gridtrain.config import preset_config
from gridtrain.data import ByteTokenizer, DataError, HFTokenizer
from gridtrain.data import sft
from gridtrain.data.sft import (ChatTemplate, SFTDataset, encode_example, is_sft_jsonl, load_chat_template,
                                read_examples)
from gridtrain.models.decoder import IGNORE_INDEX, Decoder, init_parameters
from gridtrain.parallel.tensor_parallel import vocab_parallel_cross_entropy

BYTE = ByteTokenizer()
EOT = BYTE.eot_id
CHATML = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
          "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
          "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "the answer is four"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine"}]


def write_jsonl(path: Path, records, blank_first: bool = False) -> Path:
    lines = [json.dumps(r) if not isinstance(r, str) else r for r in records]
    path.write_text(("\n" if blank_first else "") + "\n".join(lines) + "\n")
    return path


def b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer.json with ChatML's special tokens, and its
    tokenizer_config.json with the ChatML template (assistant text in generation blocks)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello there how are you", "the answer is four, be brief", "system user assistant"] * 10,
                            trainer)
    folder = tmp_path_factory.mktemp("chat")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
         "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False, "special": True}}))
    return folder


# ---- which files are fine-tuning data ----------------------------------------------------------

def test_is_sft_jsonl(tmp_path: Path):
    assert is_sft_jsonl(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}]))
    assert is_sft_jsonl(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}], blank_first=True))
    assert not is_sft_jsonl(write_jsonl(tmp_path / "text.jsonl", [{"text": "pretraining"}]))
    assert not is_sft_jsonl(write_jsonl(tmp_path / "pc.txt", [{"prompt": "a", "completion": "b"}]))
    assert not is_sft_jsonl(write_jsonl(tmp_path / "half.jsonl", [{"prompt": "a"}]))
    assert not is_sft_jsonl(write_jsonl(tmp_path / "bad.jsonl", ["not json"]))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert not is_sft_jsonl(tmp_path / "empty.jsonl")
    assert not is_sft_jsonl(tmp_path)  # a folder never is
    assert not is_sft_jsonl(tmp_path / "missing.jsonl")


# ---- encoding one example ----------------------------------------------------------------------

def test_prompt_completion_tokens_and_targets():
    tokens, mask = encode_example({"prompt": "Q: 2+2?", "completion": " 4"}, BYTE)
    assert tokens.tolist() == b("Q: 2+2?") + b(" 4") + [EOT]
    assert mask.tolist() == [False] * 7 + [True] * 3  # the eot that ends the completion is a target


def test_an_example_first_token_is_never_a_target():
    tokens, mask = encode_example({"prompt": "", "completion": "ok"}, BYTE)
    assert tokens.tolist() == b("ok") + [EOT] and mask.tolist() == [False, True, True]


def test_messages_built_in_rendering_multi_turn_with_system():
    tokens, mask = encode_example({"messages": CHAT}, BYTE)
    expected = (b("system: be brief\nuser: hello there\nassistant: ") + b("the answer is four") + [EOT]
                + b("user: how are you\nassistant: ") + b("fine") + [EOT])
    assert tokens.tolist() == expected
    targets = [t for t, m in zip(tokens.tolist(), mask) if m]
    assert targets == b("the answer is four") + [EOT] + b("fine") + [EOT]  # every assistant turn, nothing else
    assert BYTE.decode(tokens).startswith("system: be brief\nuser: hello there\nassistant: the answer is four\n")


def test_messages_without_eot_end_assistant_turns_with_a_newline(chat_folder: Path, tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, ":": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    assert hf.eot_id is None and load_chat_template(hf) is None
    tokens, mask = encode_example({"prompt": "a a", "completion": "b"}, hf)
    assert tokens.tolist() == [0, 0, 1] and mask.tolist() == [False, False, True]  # no eot to append
    dataset = SFTDataset([{"prompt": "a a", "completion": "b"}], hf, 5)
    assert dataset[0]["tokens"].tolist() == [0, 0, 1, 0, 0]  # padded with 0


def test_chat_template_tokens_and_assistant_targets(chat_folder: Path):
    hf = HFTokenizer(chat_folder / "tokenizer.json")
    template = load_chat_template(hf)
    assert template.special_tokens == {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    tokens, mask = encode_example({"messages": CHAT}, hf, template)
    text = ("<|endoftext|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
            "<|im_start|>assistant\nthe answer is four<|im_end|>\n<|im_start|>user\nhow are you<|im_end|>\n"
            "<|im_start|>assistant\nfine<|im_end|>\n")
    assert tokens.tolist() == hf.encode(text)  # the whole chat tokenized at once
    runs, run = [], []
    for token, target in zip(tokens.tolist(), mask):
        if target:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    assert [hf.decode(r) for r in runs] == ["the answer is four<|im_end|>\n", "fine<|im_end|>\n"]


def test_the_dataset_reads_the_tokenizers_template(chat_folder: Path, tmp_path: Path):
    hf = HFTokenizer(chat_folder / "tokenizer.json")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    tokens, mask = encode_example({"messages": CHAT}, hf, load_chat_template(hf))
    sample = SFTDataset(path, hf, len(tokens) - 1)[0]
    assert sample["tokens"].tolist() == tokens[:-1].tolist()
    assert sample["labels"].tolist() == np.where(mask[1:], tokens[1:], IGNORE_INDEX).tolist()


def test_chat_template_files(tmp_path: Path, chat_folder: Path):
    assert load_chat_template(BYTE) is None
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((chat_folder / name).read_bytes())
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    assert load_chat_template(hf) is None  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}))
    assert load_chat_template(hf).source == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(hf).render(CHAT) == "be brief"  # the .jinja file wins
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(DataError, match="chat_template.jinja: not a Jinja template"):
        load_chat_template(hf)


def test_a_template_that_does_not_render_turn_by_turn_is_refused():
    template = ChatTemplate("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match="does not render this chat turn by turn"):
        encode_example({"messages": CHAT}, BYTE, template)
    failing = ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(DataError, match="example 1: chat template failed on it \\(only user and assistant roles\\)"):
        encode_example({"messages": CHAT}, BYTE, failing)


def test_a_template_without_offsets_tokenizes_piece_by_piece():
    template = ChatTemplate(CHATML, {"bos_token": "<s>"})  # the byte tokenizer has no offsets: pieces
    tokens, mask = encode_example({"messages": CHAT[1:3]}, BYTE, template)  # cut at the assistant spans
    head = "<s><|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert tokens.tolist() == b(head + "the answer is four<|im_end|>\n")
    assert mask.tolist() == [False] * len(b(head)) + [True] * len(b("the answer is four<|im_end|>\n"))


@pytest.mark.slow
def test_chat_template_matches_transformers(chat_folder: Path):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(chat_folder))
    hf = HFTokenizer(chat_folder / "tokenizer.json")
    for messages in (CHAT, CHAT[1:3], CHAT[1:] + [{"role": "user", "content": "bye"}]):
        out = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        tokens, mask = encode_example({"messages": messages}, hf, load_chat_template(hf))
        assert tokens.tolist() == list(out["input_ids"])
        assert mask.astype(int).tolist() == list(out["assistant_masks"])


# ---- refusals ----------------------------------------------------------------------------------

PC_SHAPE = '{"prompt": "...", "completion": "..."}'
MSG_SHAPE = '{"messages": [{"role": "user", "content": "..."}'
BAD = {
    "not JSON": ([{"prompt": "a", "completion": "b"}, "{oops"], 2, "is not JSON", PC_SHAPE),
    "a list": ([{"prompt": "a", "completion": "b"}, [1, 2]], 2, "is a JSON list, not an object", PC_SHAPE),
    "a text record": ([{"prompt": "a", "completion": "b"}, {"text": "x"}], 2, "has neither", PC_SHAPE),
    "no completion": ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], 2, "has neither", PC_SHAPE),
    "completion not a string": ([{"prompt": "a", "completion": 3}], 1, '"completion" that is not a string',
                                PC_SHAPE),
    "mixed shapes": ([{"prompt": "a", "completion": "b"}, {"messages": CHAT}], 2,
                     "is a messages record in a file of prompt/completion records", PC_SHAPE),
    "both shapes": ([{"messages": CHAT, "prompt": "a", "completion": "b"}], 1, "has both", MSG_SHAPE),
    "empty messages": ([{"messages": CHAT}, {"messages": []}], 2, "not a non-empty list", MSG_SHAPE),
    "message without content": ([{"messages": [{"role": "user"}]}], 1, "message 0 that is not", MSG_SHAPE),
    "no assistant": ([{"messages": CHAT[:2]}], 1, 'has no "assistant" message', MSG_SHAPE),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_lines_are_refused_in_one_line(tmp_path: Path, case: str):
    records, line, problem, shape = BAD[case]
    path = write_jsonl(tmp_path / "ft.jsonl", records, blank_first=True)
    with pytest.raises(DataError) as info:
        SFTDataset(path, BYTE, 8)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"--data {path}: line {line + 1} ")  # the blank first line counts
    assert problem in message and shape in message


def test_refusals_without_a_file(tmp_path: Path):
    with pytest.raises(DataError, match="example 2 has neither"):
        SFTDataset([{"prompt": "a", "completion": "b"}, {"text": "x"}], BYTE, 8)
    with pytest.raises(DataError, match="no such file"):
        read_examples(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="a folder; fine-tuning data is one .jsonl file"):
        read_examples(tmp_path)
    (tmp_path / "blank.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no examples in this file"):
        read_examples(tmp_path / "blank.jsonl")
    with pytest.raises(DataError, match="--seq-len 0"):
        SFTDataset([{"prompt": "a", "completion": "b"}], BYTE, 0)


# ---- packing -----------------------------------------------------------------------------------

def test_packing_as_data():
    examples = [{"prompt": "abc", "completion": "de"},    # 6 tokens: a b c | d e eot
                {"prompt": "f", "completion": "g"},       # 3 tokens: f | g eot
                {"prompt": "hij", "completion": "klm"},   # 7 tokens: does not fit beside the first two
                {"prompt": "", "completion": "n"}]        # 2 tokens: fits beside the third
    dataset = SFTDataset(examples, BYTE, 9)  # samples of 10 tokens
    assert (len(dataset), dataset.num_examples, dataset.truncated) == (2, 4, 0)
    assert dataset.sample_examples.tolist() == [0, 2, 4]
    first, second = dataset[0], dataset[1]
    assert all(v.dtype == torch.int64 and v.shape == (9,) for s in (first, second) for v in s.values())
    assert first["tokens"].tolist() == b("abcde") + [EOT] + b("fg") + [EOT]  # + one pad (the 10th token)
    assert first["documents"].tolist() == [0] * 6 + [1] * 3
    assert first["labels"].tolist() == [-100, -100, ord("d"), ord("e"), EOT, -100, ord("g"), EOT, -100]
    assert second["tokens"].tolist() == b("hijklm") + [EOT] + b("n") + [EOT]
    assert second["documents"].tolist() == [0] * 7 + [1] * 2
    assert second["labels"].tolist() == [-100, -100, ord("k"), ord("l"), ord("m"), EOT, -100, EOT, -100]
    assert dataset.loss_tokens == 3 + 2 + 4 + 1 == sum(int((s["labels"] != -100).sum()) for s in (first, second))


def test_padding_is_its_own_document_and_never_a_label():
    sample = SFTDataset([{"prompt": "ab", "completion": "c"}], BYTE, 8)[0]
    assert sample["tokens"].tolist() == b("abc") + [EOT] * 5
    assert sample["documents"].tolist() == [0] * 4 + [1] * 4
    assert sample["labels"].tolist() == [-100, ord("c"), EOT] + [-100] * 5


def test_long_examples_are_truncated_and_counted():
    examples = [{"prompt": "p" * 3, "completion": "c" * 20}, {"prompt": "x", "completion": "y"},
                {"prompt": "q" * 30, "completion": "r"}]
    dataset = SFTDataset(examples, BYTE, 7)
    assert (len(dataset), dataset.truncated, dataset.num_examples) == (3, 2, 3)
    first = dataset[0]
    assert first["tokens"].tolist() == b("pppccccc") [:7]
    assert first["labels"].tolist() == [-100, -100] + [ord("c")] * 5  # the 8th token is the last label
    assert first["documents"].tolist() == [0] * 7
    assert dataset[2]["labels"].tolist() == [-100] * 7  # nothing of the completion is left
    assert "2 truncated" in dataset.summary()


def test_packing_never_splits_an_example_and_is_deterministic(tmp_path: Path):
    rng = np.random.default_rng(0)
    examples = [{"prompt": "p" * int(rng.integers(0, 9)), "completion": chr(97 + k % 26) * int(rng.integers(0, 9))}
                for k in range(200)]
    path = write_jsonl(tmp_path / "ft.jsonl", examples)
    dataset, again = SFTDataset(path, BYTE, 16), SFTDataset(path, BYTE, 16)
    assert dataset.truncated == 0 and dataset.num_examples == 200
    expected = [encode_example(e, BYTE) for e in examples]
    bounds = dataset.sample_examples.tolist()
    assert bounds[0] == 0 and bounds[-1] == 200 and len(bounds) == len(dataset) + 1
    loss_tokens = 0
    for i in range(len(dataset)):
        sample, other = dataset[i], again[i]
        assert all(torch.equal(sample[k], other[k]) for k in sample)  # the same samples every time
        mine = expected[bounds[i]:bounds[i + 1]]
        lengths = [len(t) for t, _ in mine]
        assert sum(lengths) <= 17  # whole examples only ...
        if i + 1 < len(dataset):  # ... and greedily: the next one did not fit
            assert sum(lengths) + len(expected[bounds[i + 1]][0]) > 17
        window = np.concatenate([t for t, _ in mine] + [np.full(17 - sum(lengths), EOT)])
        target = np.concatenate([m for _, m in mine] + [np.zeros(17 - sum(lengths), bool)])
        documents = np.repeat(np.arange(len(mine) + 1), lengths + [17 - sum(lengths)])
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["documents"].tolist() == documents[:-1].tolist()
        assert sample["labels"].tolist() == np.where(target[1:], window[1:], IGNORE_INDEX).tolist()
        loss_tokens += int((sample["labels"] != IGNORE_INDEX).sum())
    assert loss_tokens == dataset.loss_tokens == sum(int(m.sum()) for _, m in expected)


# ---- the loss: prompt tokens never count -------------------------------------------------------

def test_prompt_tokens_never_contribute_to_the_loss_or_its_gradient():
    assert sft.IGNORE_INDEX == IGNORE_INDEX  # the data's masked label is the one the model ignores
    cfg = preset_config("tiny").model
    model = Decoder(cfg).double()
    init_parameters(model, seed=0)
    examples = [{"prompt": "What is two plus two?", "completion": " Four."},
                {"messages": CHAT[1:3]}, {"prompt": "Name a colour:", "completion": " blue"}]
    samples = [SFTDataset([e], BYTE, 60)[0] for e in examples]
    inputs = torch.stack([s["tokens"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    ignored = labels == IGNORE_INDEX
    assert ignored.any(dim=1).all() and (~ignored).any(dim=1).all()

    logits = model(inputs).detach().requires_grad_(True)
    losses = vocab_parallel_cross_entropy(logits, labels, cfg.vocab_size, model.tp)
    assert torch.equal(losses, model(inputs, labels))  # the model's own loss
    assert (losses[ignored] == 0).all() and (losses[~ignored] > 0).all()
    losses.sum().backward()
    assert (logits.grad[ignored] == 0).all()  # exactly: prompt and padding positions get no gradient
    assert (logits.grad[~ignored].abs().sum(-1) > 0).all()

    # whatever the prompt positions' targets are, they are masked, and the loss is the same
    changed = torch.where(ignored, torch.randint_like(labels, cfg.vocab_size), labels)
    relabelled = torch.where(ignored, IGNORE_INDEX, changed)
    assert torch.equal(model(inputs, relabelled).sum(), losses.sum())
    # and so is the loss when the logits at prompt positions change
    noisy = torch.where(ignored.unsqueeze(-1), logits.detach() + torch.randn_like(logits), logits.detach())
    assert torch.equal(vocab_parallel_cross_entropy(noisy, labels, cfg.vocab_size, model.tp).sum(),
                       losses.detach().sum())


def test_loss_tokens_are_counted_on_the_host_through_every_wrapper(tmp_path: Path):
    """What the trainer divides the loss by, without reading a sample: each sample's
    loss-bearing labels (truncated examples too), through the views the data builder
    puts around a dataset; None where a dataset cannot say."""
    from gridtrain.data import TokenWindows, WindowSubset, count_loss_tokens
    from gridtrain.data.datasets import HeldOut
    from gridtrain.data.mixture import MixtureDataset, WithoutDocuments

    rng = np.random.default_rng(1)
    examples = [{"prompt": "p" * int(rng.integers(0, 12)), "completion": "c" * int(rng.integers(0, 12))}
                for _ in range(60)]
    dataset = SFTDataset(examples, BYTE, 10)
    assert dataset.truncated > 0

    def labels(d, ids):
        return sum(int((d[int(i)]["labels"] != IGNORE_INDEX).sum()) for i in ids)

    everything = np.arange(len(dataset))
    assert count_loss_tokens(dataset, everything) == labels(dataset, everything) == dataset.loss_tokens
    windows = TokenWindows(np.arange(100) % 7, 9)
    views = [WindowSubset(dataset, np.array([3, 1, 4, 1, 5])), HeldOut(dataset, 4, True), HeldOut(dataset, 4, False),
             WithoutDocuments(dataset), MixtureDataset([dataset, windows], ["ft", "text"], [0.5, 0.5])]
    for view in views:
        ids = rng.integers(0, len(view), 12)
        assert count_loss_tokens(view, ids) == labels(view, ids), type(view).__name__
    assert count_loss_tokens(torch.utils.data.TensorDataset(torch.zeros(3)), [0, 1]) is None
    assert count_loss_tokens(MixtureDataset([dataset, torch.utils.data.TensorDataset(torch.zeros(3))], ["a", "b"],
                                            [0.5, 0.5]), np.array([0, len(dataset)])) is None


def test_examples_that_lose_their_whole_completion_are_counted_and_a_source_with_none_left_refused():
    long = {"prompt": "p" * 40, "completion": "c"}  # 40 + 1 + eot tokens: past a window of 17
    short = {"prompt": "p", "completion": "cc"}
    dataset = SFTDataset([long, short, long], BYTE, 16)
    assert (dataset.truncated, dataset.lost) == (2, 2)
    assert "(2 examples lost every completion token to the truncation: a longer --seq-len keeps them)" \
        in dataset.summary()
    dataset.check_loss_tokens("--data", "mixed.jsonl")  # some left: trains
    with pytest.raises(DataError, match="^--data long.jsonl: no token of it counts in the loss at --seq-len 16 "
                                        r"\(2 of its 2 examples are longer"):
        SFTDataset([long, long], BYTE, 16).check_loss_tokens("--data", "long.jsonl")
