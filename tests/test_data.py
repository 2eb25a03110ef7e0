"""Lesson 10's text data: tokenizer, vocabulary, batchify and get_batch on known small inputs."""

import pytest
import torch

from pipelab.data import Vocab, batchify, data_columns, get_batch, load_corpus, split_lines, tokenize


def test_tokenize_splits_words_and_punctuation():
    assert tokenize("The cat's hat, 42 times!") == ["the", "cat's", "hat", ",", "42", "times", "!"]


def test_vocab_from_training_split_unknown_words_become_unk():
    vocab = Vocab.build(["b a b", "c b"])
    assert vocab.words == ["<unk>", "<eos>", "b", "a", "c"]  # most frequent first, ties alphabetical
    assert vocab.encode(["a z"]).tolist() == [3, 0, 1]
    assert vocab.decode([2, 3, 1]) == "b a <eos>"


def test_batchify_trims_the_remainder_into_columns():
    source = batchify(torch.arange(26), 4)  # 26 tokens, 4 columns: 6 rows, 2 tokens trimmed
    assert source.shape == (6, 4)
    assert source[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert source[:, 3].tolist() == [18, 19, 20, 21, 22, 23]


def test_each_data_rank_takes_its_own_columns():
    source = batchify(torch.arange(24), 4)
    assert data_columns(source, 1, 2).tolist() == source[:, 2:].tolist()
    with pytest.raises(ValueError, match="multiple of 3"):
        data_columns(source, 0, 3)


def test_get_batch_windows_and_targets_shifted_by_one():
    source = batchify(torch.arange(24), 2)  # columns 0..11 and 12..23
    x, y = get_batch(source, 0, 5)
    assert x.tolist() == [[0, 1, 2, 3, 4], [12, 13, 14, 15, 16]]  # batch first
    assert y.tolist() == [[1, 2, 3, 4, 5], [13, 14, 15, 16, 17]]
    x, y = get_batch(source, 10, 5)  # the last window is shorter
    assert x.tolist() == [[10], [22]] and y.tolist() == [[11], [23]]
    with pytest.raises(ValueError):
        get_batch(source, 11, 5)


def test_split_keeps_order_and_builtin_corpus_loads():
    parts = split_lines([str(i) for i in range(100)], 0.1, 0.2)
    assert [len(parts[k]) for k in ("train", "valid", "test")] == [70, 10, 20]
    assert parts["valid"][0] == "70"
    corpus = load_corpus(max_lines=500)
    assert corpus.train.numel() > 1000 and len(corpus.vocab) > 100
    assert corpus.valid.max() < len(corpus.vocab)
