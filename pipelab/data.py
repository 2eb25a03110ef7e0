"""Text for the capstone language model (lesson 10), as the PyTorch tutorial prepares WikiText-2.

* `load_corpus()`: a corpus every machine has without a download, the English text of Python's
  own documentation (`pydoc_data.topics`), split train/valid/test; or WikiText-2's raw files
  (`wiki.train.raw`, ...) when `text_path` points at the folder holding them.
* `Vocab.build(train)`: a word-level tokenizer and vocabulary from the training split only, as the
  tutorial builds it; words never seen in training become `<unk>`.
* `batchify(ids, columns)`: the token stream cut into `columns` parallel columns, the remainder
  trimmed; `get_batch(source, i, bptt)`: a `bptt`-long window and its targets, shifted by one.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass

import torch

from pipelab.checks import whole_number

SPLITS = ("train", "valid", "test")
WIKITEXT_FILES = {"train": "wiki.train.raw", "valid": "wiki.valid.raw", "test": "wiki.test.raw"}
UNK, EOS = "<unk>", "<eos>"


def tokenize(line: str) -> list[str]:
    """Words and punctuation marks of one line, lower-cased (the tutorial's `basic_english`)."""
    return re.findall(r"[a-z0-9_]+(?:'[a-z]+)?|[^\sa-z0-9_]", line.lower())


def pydoc_lines() -> list[str]:
    """The non-empty lines of Python's documentation topics: ~1 MB of English on every machine."""
    from pydoc_data.topics import topics
    lines = (line.strip() for key in sorted(topics) for line in topics[key].splitlines())
    return [line for line in lines if re.search("[A-Za-z]", line)]  # no rules of "*****" lines


def split_lines(lines: list[str], valid: float = 0.05, test: float = 0.05) -> dict[str, list[str]]:
    """Cut `lines` in order into train / valid / test (the last `valid` and `test` shares held out)."""
    n_valid, n_test = int(len(lines) * valid), int(len(lines) * test)
    n_train = len(lines) - n_valid - n_test
    return {"train": lines[:n_train], "valid": lines[n_train:n_train + n_valid], "test": lines[n_train + n_valid:]}


def wikitext_lines(text_path: str) -> dict[str, list[str]]:
    """WikiText-2 (raw) from a local folder holding wiki.train.raw, wiki.valid.raw, wiki.test.raw."""
    missing = [f for f in WIKITEXT_FILES.values() if not os.path.exists(os.path.join(text_path, f))]
    if missing:
        raise ValueError(f"text_path={text_path!r} lacks {missing}; point it at the unpacked "
                         "wikitext-2-raw folder (wiki.train.raw, wiki.valid.raw, wiki.test.raw)")
    splits = {}
    for split, name in WIKITEXT_FILES.items():
        with open(os.path.join(text_path, name), encoding="utf-8") as f:
            splits[split] = [line.strip() for line in f if line.strip()]
    return splits


@dataclass
class Vocab:
    """Word <-> id. Built from the training split; id 0 is `<unk>`, every line ends with `<eos>`."""

    words: list[str]

    @classmethod
    def build(cls, lines: list[str], max_size: int | None = None, min_freq: int = 1) -> "Vocab":
        """The training split's words, most frequent first (ties alphabetical), at most `max_size`."""
        counts = Counter(w for line in lines for w in tokenize(line))
        ranked = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
        ranked = [w for w in ranked if w not in (UNK, EOS)]
        if max_size is not None:
            ranked = ranked[:max(max_size - 2, 0)]
        return cls([UNK, EOS, *ranked])

    def __post_init__(self):
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, lines: list[str]) -> torch.Tensor:
        """One flat stream of token ids, `<eos>` after each line (unknown words -> `<unk>`)."""
        ids = [self.index.get(w, 0) for line in lines for w in [*tokenize(line), EOS]]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids) -> str:
        return " ".join(self.words[int(i)] for i in ids)


@dataclass
class Corpus:
    """The three splits as id streams, and the vocabulary they share."""

    vocab: Vocab
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    source: str


def load_corpus(text_path: str | None = None, max_vocab: int | None = None, max_lines: int | None = None) -> Corpus:
    """The corpus: WikiText-2 from `text_path` if given, else Python's documentation. `max_lines`
    keeps each split's first lines (a quick run); `max_vocab` caps the vocabulary."""
    if text_path:
        splits, source = wikitext_lines(text_path), f"WikiText-2 ({text_path})"
    else:
        splits, source = split_lines(pydoc_lines()), "Python documentation (pydoc_data.topics)"
    if max_lines is not None:
        whole_number("max_lines", max_lines, example="max_lines=2000")
        splits = {k: v[:max_lines] for k, v in splits.items()}
    vocab = Vocab.build(splits["train"], max_size=max_vocab)
    return Corpus(vocab, *(vocab.encode(splits[s]) for s in SPLITS), source)


def batchify(ids: torch.Tensor, columns: int) -> torch.Tensor:
    """(steps, columns): the stream cut into `columns` equal columns, the remainder trimmed (the
    tutorial's `batchify`). Each data-parallel rank takes its own columns (`data_columns`)."""
    whole_number("columns", columns, example="columns=20")
    steps = ids.numel() // columns
    if steps < 2:
        raise ValueError(f"{ids.numel()} tokens give fewer than 2 rows in {columns} columns; use fewer columns")
    return ids[:steps * columns].view(columns, steps).t().contiguous()


def data_columns(source: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The columns of data-parallel rank `rank` out of `size` (its share of every batch)."""
    if source.shape[1] % size:
        raise ValueError(f"{source.shape[1]} columns do not split over {size} data-parallel ranks; "
                         f"use a batch size that is a multiple of {size}")
    per = source.shape[1] // size
    return source[:, rank * per:(rank + 1) * per]


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs rows i..i+bptt-1 and targets one token later, both (columns, seq): batch first, so
    that micro-batches split the columns. The last window is shorter (the tutorial's `get_batch`)."""
    seq_len = min(bptt, len(source) - 1 - i)
    if seq_len < 1:
        raise ValueError(f"window start i={i} leaves no target in {len(source)} rows; use i < {len(source) - 1}")
    return source[i:i + seq_len].t().contiguous(), source[i + 1:i + 1 + seq_len].t().contiguous()
