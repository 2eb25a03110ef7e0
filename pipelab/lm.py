"""The capstone's language model (lesson 10): the PyTorch tutorial's Transformer LM as a list of
layers, so that lesson 08's partitioning can cut it into pipeline stages.

`TransformerLM(...)` is an `nn.Sequential`: a scaled token embedding, the sinusoidal positional
encoding, `nlayers` encoder layers that each apply a causal mask (a token sees only the tokens
before it), and a linear decoder to the vocabulary. Tokens go in batch first, (batch, seq).

`clip_grad_norm_` clips the gradients of the *whole* model while each process holds one stage:
the global norm is the square root of the sum of every stage's squared norm, so the squares are
summed across the pipeline group before any stage scales its gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from pipelab.checks import whole_number


class ScaledEmbedding(nn.Module):
    """Token ids -> vectors, multiplied by sqrt(d_model) as in "Attention is all you need"."""

    def __init__(self, ntoken: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(ntoken, d_model)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids) * self.scale


class PositionalEncoding(nn.Module):
    """Adds sin/cos of the position at geometric frequencies (no parameters, a buffer)."""

    def __init__(self, d_model: int, max_len: int = 5000):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:x.shape[1]]


class CausalEncoderLayer(nn.TransformerEncoderLayer):
    """An encoder layer that masks the future itself, so a stage needs nothing but its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return super().forward(x, src_mask=mask, is_causal=True)


class Decoder(nn.Linear):
    """The last layer: hidden vectors -> one logit per word of the vocabulary."""


def TransformerLM(ntoken: int, emsize: int = 64, nhead: int = 2, nhid: int = 128, nlayers: int = 4,
                  dropout: float = 0.0) -> nn.Sequential:
    """The tutorial's model as layers: embedding, positional encoding, `nlayers` causal encoder
    layers, decoder. (The tutorial's sizes on 4 GPUs: emsize=nhid=4096, nhead=16, nlayers=8.)"""
    for name, value in (("ntoken", ntoken), ("emsize", emsize), ("nhead", nhead), ("nhid", nhid), ("nlayers", nlayers)):
        whole_number(name, value, example=f"{name}=2")
    if emsize % nhead:
        raise ValueError(f"emsize={emsize} must be a multiple of nhead={nhead} (each head gets emsize/nhead)")
    layers = [ScaledEmbedding(ntoken, emsize), PositionalEncoding(emsize)]
    layers += [CausalEncoderLayer(emsize, nhead, nhid, dropout, batch_first=True) for _ in range(nlayers)]
    return nn.Sequential(*layers, Decoder(emsize, ntoken))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per token, averaged over all the batch's tokens (ln(vocab) when guessing)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def stages_of(model: nn.Sequential, parts: list[int]) -> list[nn.Sequential]:
    """The stage modules of a partition (`partition_layers`' boundaries); layer names are kept."""
    return [model[lo:hi] for lo, hi in zip(parts[:-1], parts[1:])]


def squared_norm(params) -> torch.Tensor:
    """Sum of the squares of these parameters' gradients."""
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    zero = torch.zeros((), device=grads[0].device if grads else "cpu")
    return sum((g.pow(2).sum() for g in grads), zero)


def clip_grad_norm_(params, max_norm: float, group=None) -> float:
    """Clip the whole model's gradient to norm `max_norm` when each process of `group` (the
    pipeline) holds some of its parameters: sum the squared norms over the group, take the root,
    and scale every stage's gradients by the same factor. Returns the global norm (before clipping).
    Clipping each stage by its own norm would scale the stages differently: a different direction."""
    params = [p for p in params if p.grad is not None]
    total_sq = squared_norm(params)
    if group is not None:
        dist.all_reduce(total_sq, group=group)
    total = total_sq.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(scale.to(p.grad.device))
    return float(total)


@torch.no_grad()
def generate(model: nn.Module, vocab, prompt: str, words: int = 20, top_k: int = 1, bptt: int = 35,
             seed: int = 0) -> str:
    """Continue `prompt` by `words` words: greedy (`top_k=1`) or sampled among the k likeliest."""
    from pipelab.data import tokenize
    model.eval()
    ids = [vocab.index.get(w, 0) for w in tokenize(prompt)] or [1]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(words):
        logits = model(torch.tensor([ids[-bptt:]]))[0, -1]
        top = torch.topk(logits, top_k)
        choice = top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)]
        ids.append(int(choice))
    return vocab.decode(ids).replace(" <eos> ", "\n")
