"""Data: from a corpus on disk to the samples of an optimizer step.

Everything here serves the design invariant "any parallel layout trains the same model as
one process": the corpus becomes one token array in a fixed order, the array is cut into
fixed windows, and the sampler maps an optimizer step to the same global batch whatever
the data-parallel size or micro-batch size.

* tokenizers.py: the byte tokenizer and Hugging Face ``tokenizer.json`` files;
* corpora.py: every source (built-in corpus, text file, folder, JSON lines, token file)
  as one token array; counting it before any process starts;
* prepare.py: ``gridtrain prepare``, a corpus of any size into a token file in bounded
  memory, with several processes;
* token_files.py: the files ``gridtrain prepare`` writes (tokens, document index,
  header), memory-mapped on reading;
* datasets.py: windows, the train/validation split, :class:`Datasets`, ``collate``;
* sampler.py: :class:`GlobalBatchSampler`, step -> global batch -> rank -> micro-batch;
* sft.py: fine-tuning sets (prompt/completion or chat JSON lines), the loss on the answers
  only, packed into samples (:class:`SFTDataset`);
* errors.py: :class:`DataError`, the one-line error every module raises (and
  :class:`TokenIdError`, a batch's id outside the vocabulary, found by ``collate``).

The names are re-exported here: ``from gridtrain.data import build_datasets``.
"""

from __future__ import annotations

from gridtrain.data.corpora import (EXCLUDED_DIRS, JSONL_SUFFIX, builtin_corpus_files, builtin_corpus_root,
                                    check_enough_tokens, corpus_files, count_tokens, load_tokens)
from gridtrain.data.datasets import (Batch, Datasets, TokenWindows, WindowSubset, build_datasets, check_token_ids,
                                     collate, count_loss_tokens, split_windows, unigram_entropy)
from gridtrain.data.errors import DataError, TokenIdError
from gridtrain.data.prepare import prepare
from gridtrain.data.sampler import GlobalBatchSampler
from gridtrain.data.sft import (ChatTemplate, SFTDataset, encode_example, encode_examples, is_sft_jsonl,
                                load_chat_template, read_examples)
from gridtrain.data.token_files import (TOKEN_FILE_FORMAT, TOKEN_FILE_VERSION, find_token_header, open_token_file,
                                        read_document_index, read_token_file, write_token_file)
from gridtrain.data.tokenizers import (EOT_CANDIDATES, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer,
                                       token_dtype)

__all__ = [
    "EOT_CANDIDATES", "EXCLUDED_DIRS", "JSONL_SUFFIX", "TOKEN_FILE_FORMAT", "TOKEN_FILE_VERSION",
    "Batch", "ByteTokenizer", "DataError", "TokenIdError", "Datasets", "GlobalBatchSampler", "HFTokenizer",
    "TokenWindows",
    "Tokenizer", "WindowSubset", "build_datasets", "builtin_corpus_files", "builtin_corpus_root",
    "check_enough_tokens", "check_token_ids", "collate", "corpus_files", "count_loss_tokens", "count_tokens",
    "find_token_header", "load_tokenizer",
    "load_tokens", "open_token_file", "prepare", "read_document_index", "read_token_file", "split_windows", "token_dtype",
    "unigram_entropy", "write_token_file",
    "ChatTemplate", "SFTDataset", "encode_example", "encode_examples", "is_sft_jsonl", "load_chat_template",
    "read_examples",
]
