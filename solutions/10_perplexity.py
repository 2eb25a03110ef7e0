"""Lesson 10: perplexity from the last stage's per-micro-batch losses. Each loss is a mean over its
micro-batch's tokens; the batch's loss per token weights each by its token count (micro-batches
can differ in size), and perplexity is exp of that."""

import math


def my_perplexity(mb_losses, mb_tokens):
    total = sum(loss * tokens for loss, tokens in zip(mb_losses, mb_tokens))
    return math.exp(total / sum(mb_tokens))
