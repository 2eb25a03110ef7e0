"""The capstone's language model (lesson 10): the PyTorch tutorial's Transformer LM as a list of
layers, so that lesson 08's partitioning can cut it into pipeline stages.

`TransformerLM(...)` is an `nn.Sequential`: a scaled token embedding, the sinusoidal positional
encoding, `nlayers` encoder layers that each apply a causal mask (a token sees only the tokens
before it), and a linear decoder to the vocabulary, initialised as the tutorial does
(`init_weights`). Tokens go in batch first, (batch, seq). Each layer initialises itself with its
`reset_parameters()`, so the model can be built on the meta device and each rank make only its own
stage real (`pipelab.build`).

`clip_grad_norm_` clips the gradients of the *whole* model while each process holds one stage:
the global norm is the square root of the sum of every stage's squared norm, so the squares are
summed across the pipeline group before any stage scales its gradients.

`window_losses` and `perplexity` score a model the right way (exp of the mean loss per token);
`tutorial_perplexity` is the tutorial's `evaluate`, line for line, to show what it gets wrong.
`gather_model` puts the stages' weights back in one model.

`stage_memory` says, before anything runs, how many bytes each stage will need: parameters,
gradients, optimizer state, and one micro-batch's activations times the most micro-batches the
schedule stashes at once (lesson 07's simulator).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipelab.build import is_meta, materialize
from pipelab.checks import whole_number
from pipelab.data import get_batch
from pipelab.pipeline.schedules import Schedule
from pipelab.pipeline.simulate import simulate


INITRANGE = 0.1  # the tutorial's: embedding and decoder weights uniform in +-0.1


class ScaledEmbedding(nn.Module):
    """Token ids -> vectors, multiplied by sqrt(d_model) as in "Attention is all you need"."""

    def __init__(self, ntoken: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(ntoken, d_model)
        self.scale = math.sqrt(d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The tutorial's initialisation: uniform in +-0.1 (after, so in place of, nn.Embedding's)."""
        nn.init.uniform_(self.embedding.weight, -INITRANGE, INITRANGE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids) * self.scale


class PositionalEncoding(nn.Module):
    """Adds sin/cos of the position at geometric frequencies (no parameters, a buffer)."""

    def __init__(self, d_model: int, max_len: int = 5000):
        super().__init__()
        self.register_buffer("pe", torch.empty(max_len, d_model), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Compute the buffer (it is no weight: a rank that makes this layer real computes it)."""
        max_len, d_model = self.pe.shape
        position = torch.arange(max_len, device=self.pe.device).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, device=self.pe.device) * (-math.log(10000.0) / d_model))
        self.pe[:, 0::2] = torch.sin(position * div_term)
        self.pe[:, 1::2] = torch.cos(position * div_term)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:x.shape[1]]


class CausalEncoderLayer(nn.TransformerEncoderLayer):
    """An encoder layer that masks the future itself, so a stage needs nothing but its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return super().forward(x, src_mask=mask, is_causal=True)


class Decoder(nn.Linear):
    """The last layer: hidden vectors -> one logit per word of the vocabulary."""

    def reset_parameters(self) -> None:
        """The tutorial's initialisation, in place of nn.Linear's: weight uniform in +-0.1, bias 0."""
        nn.init.uniform_(self.weight, -INITRANGE, INITRANGE)
        nn.init.zeros_(self.bias)


def init_weights(model: nn.Sequential, initrange: float = INITRANGE) -> None:
    """The tutorial's initialisation: embedding and decoder weights uniform in +-0.1, decoder bias 0
    (what `ScaledEmbedding` and `Decoder` do when they are built, and in `reset_parameters()`).

    Width matters with it: after the encoder's last LayerNorm a hidden vector has length about
    sqrt(emsize), so a logit starts with a spread of about 0.1 / sqrt(3) x sqrt(emsize) (0.46 at
    emsize 64, 3.7 at 4096), and a step that moves a decoder row by `delta` moves a logit by up to
    `delta` x sqrt(emsize)."""
    for layer in model:
        if isinstance(layer, ScaledEmbedding):
            nn.init.uniform_(layer.embedding.weight, -initrange, initrange)
        elif isinstance(layer, Decoder):
            nn.init.uniform_(layer.weight, -initrange, initrange)
            nn.init.zeros_(layer.bias)


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
    return nn.Sequential(*layers, Decoder(emsize, ntoken))  # each layer initialised as `init_weights` does


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


def activation_bytes(layer: nn.Module, tokens: int) -> int:
    """Bytes (float32) autograd keeps for the backward of `layer` on `tokens` tokens: what lesson
    06's stash meter counts. An encoder layer keeps per token 8 vectors of width emsize (the
    attention's input, q, k, v and output, the output projection's input, the two norms' inputs),
    the feed-forward's hidden vector, one number per head (the fused attention kernels keep each
    row's log-sum-exp, not the seq x seq maps) and the norms' mean and 1/std; the decoder keeps its
    input and the loss's log-probabilities over the vocabulary. The embedding keeps only the ids."""
    if isinstance(layer, CausalEncoderLayer):
        width, hidden = layer.linear1.in_features, layer.linear1.out_features
        return 4 * tokens * (8 * width + hidden + layer.self_attn.num_heads + 4)
    if isinstance(layer, Decoder):
        return 4 * tokens * (layer.in_features + layer.out_features)
    return 0


def stage_memory(model: nn.Sequential, parts: list[int], schedule: Schedule, tokens: int,
                 optimizer_states: int = 0, host_copy: bool = False) -> list[dict]:
    """Bytes each stage will need, before anything runs: parameters, their gradients, optimizer
    state (`optimizer_states` tensors per parameter: plain SGD 0, momentum 1, Adam 2), and the
    activations of one micro-batch of `tokens` tokens times the most micro-batches the schedule
    keeps stashed at once on that stage's rank (`simulate(schedule).peak_stash`, lesson 07). With
    `host_copy` the last stage's process also holds the whole model (it gathers the stages' weights
    to validate); the others build the model on the meta device and hold their own stage only.
    `model` may live on the "meta" device: only sizes are read."""
    peaks = simulate(schedule).peak_stash
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for s, stage in enumerate(stages_of(model, parts)):
        params = sum(p.numel() * p.element_size() for p in stage.parameters())
        per_microbatch = sum(activation_bytes(layer, tokens) for layer in stage)
        stash = peaks[schedule.rank_of(s)]
        row = {"stage": s, "layers": f"{parts[s]}-{parts[s + 1] - 1}", "parameters": params, "gradients": params,
               "optimizer": optimizer_states * params, "activations/mb": per_microbatch, "peak stash": stash,
               "activations": per_microbatch * stash, "model copy": whole if host_copy and s == len(parts) - 2 else 0}
        row["total"] = sum(v for k, v in row.items() if k not in ("stage", "layers", "activations/mb", "peak stash"))
        rows.append(row)
    return rows


def check_fits(rows: list[dict], available: int, where: str = "a device") -> None:
    """Refuse, before any process starts, a recipe whose largest stage exceeds the memory there is."""
    worst = max(rows, key=lambda r: r["total"])
    if worst["total"] > available:
        raise ValueError(f"stage {worst['stage']} needs about {worst['total'] / 2**30:.2f} GiB and {where} has "
                         f"{available / 2**30:.2f} GiB: use more stages (pipe), fewer micro-batch tokens "
                         "(batch_size, bptt, a larger num_microbatches) or a smaller model (emsize, nhid, nlayers)")


@torch.no_grad()
def generate(model: nn.Module, vocab, prompt: str, words: int = 20, top_k: int = 1, bptt: int = 35,
             seed: int = 0) -> str:
    """Continue `prompt` by `words` words: greedy (`top_k=1`) or sampled among the k likeliest."""
    from pipelab.data import tokenize
    model.eval()
    device = next(model.parameters()).device  # the prompt goes where the model is (a GPU, if there)
    ids = [vocab.index.get(w, 0) for w in tokenize(prompt)] or [1]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(words):
        with torch.no_grad():
            logits = model(torch.tensor([ids[-bptt:]], device=device))[0, -1].cpu()
        top = torch.topk(logits, top_k)
        choice = top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)]
        ids.append(int(choice))
    return vocab.decode(ids).replace(" <eos> ", "\n")


def window_losses(model, source: torch.Tensor, bptt: int) -> list[tuple[float, int]]:
    """(mean token loss, seq_len) of every window of `source`, the short last one included."""
    model.eval()
    out = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for i in range(0, source.shape[0] - 1, bptt):
            x, y = (t.to(device) for t in get_batch(source, i, bptt))
            out.append((float(lm_loss(model(x), y)), x.shape[1]))
    model.train()
    return out


def perplexity(losses: list[tuple[float, int]]) -> float:
    """exp of the mean loss per token: each window weighted by its length, divided by all of them."""
    return math.exp(sum(loss * n for loss, n in losses) / sum(n for _, n in losses))


def tutorial_windows(rows: int, bptt: int, max_windows: int = 50) -> int:
    """How many windows the tutorial's `evaluate` scores: `range(0, min(50 * bptt, rows - 1), bptt)`."""
    return len(range(0, min(max_windows * bptt, rows - 1), bptt))


def tutorial_perplexity(losses: list[tuple[float, int]], rows: int, bptt: int, columns: int, max_windows: int = 50) -> float:
    """The tutorial's `evaluate`, exactly. Its `get_batch` returns `data.t()`, (columns, seq_len), so
    `len(data)` is the number of COLUMNS (its eval batch size, 10):

        nbatches = min(50 * bptt, data_source.size(0) - 1)
        for i in range(0, nbatches, bptt):
            data, targets = get_batch(data_source, i)
            total_loss += len(data) * criterion(output_flat, targets).item()
        return total_loss / (len(data_source) - 1)       # then math.exp of it

    `losses` are (mean token loss, seq_len) of the windows of a `rows` x `columns` set, in order
    (`window_losses`). Each window weighs `columns`, not its columns x seq_len tokens, and the sum
    is divided by the set's rows less one, not by the tokens scored."""
    scored = tutorial_windows(rows, bptt, max_windows)
    if len(losses) < scored:
        raise ValueError(f"the tutorial's evaluate scores {scored} windows of a {rows}-row set with bptt={bptt}; "
                         f"got the losses of {len(losses)}: pass every window's (`window_losses`)")
    return math.exp(sum(columns * loss for loss, _ in losses[:scored]) / (rows - 1))


def tutorial_evaluate_figures(losses: list[tuple[float, int]], rows: int, bptt: int, columns: int) -> dict:
    """The tutorial's `evaluate` taken apart on the same windows: what it adds up and divides by,
    beside what the mean loss per token adds up and divides by."""
    scored = losses[:tutorial_windows(rows, bptt)]
    return {"windows": len(losses), "windows scored": len(scored), "columns": columns, "rows": rows,
            "weight per window": columns, "tokens per window": columns * bptt,
            "divisor": rows - 1, "tokens scored": columns * sum(n for _, n in scored),
            "tutorial": tutorial_perplexity(losses, rows, bptt, columns),
            "right, same windows": perplexity(scored), "right": perplexity(losses)}


def tutorial_evaluate_table(figures: dict) -> list[dict]:
    """`tutorial_evaluate_figures` as rows: what the tutorial's formula adds up and divides by,
    beside the mean loss per token's."""
    f = figures
    return [{"": "each window's mean loss weighted by", "the tutorial's evaluate": f"len(data) = {f['columns']} (columns)",
             "the loss per token": f"its tokens: {f['columns']} x {f['tokens per window'] // f['columns']} = {f['tokens per window']}"},
            {"": "the sum divided by", "the tutorial's evaluate": f"len(data_source) - 1 = {f['divisor']:,} (rows - 1)",
             "the loss per token": f"the tokens scored: {f['tokens scored']:,}"},
            {"": "perplexity", "the tutorial's evaluate": f"{f['tutorial']:.2f}",
             "the loss per token": (f"{f['right']:.1f}" if f["windows scored"] == f["windows"] else
                                    f"{f['right, same windows']:.1f} ({f['windows scored']} windows), {f['right']:.1f} (all {f['windows']})")}]


def gather_model(model, stage, group, keep: bool = True):
    """The whole model, its stages' weights gathered from the pipeline `group` (every stage calls;
    only where `keep` is the model loaded, elsewhere None: the others hold their stage only)."""
    pieces = [None] * (dist.get_world_size(group) if group is not None else 1)
    mine = {k: v.detach().cpu() for k, v in stage.state_dict().items()}
    if group is not None:
        dist.all_gather_object(pieces, mine, group=group)
    else:
        pieces = [mine]
    return load_whole(model, pieces) if keep else None


def load_whole(model, pieces: Sequence[dict]):
    """`model` (real, or built on the meta device) with the stages' weights `pieces` loaded. A meta
    model takes the tensors as its own (`assign=True`: no second copy), and `materialize` computes
    what no state dict holds (the positional encoding's buffer)."""
    state = {k: v for piece in pieces for k, v in piece.items()}
    if not is_meta(model):
        model.load_state_dict(state)
        return model
    model.load_state_dict(state, assign=True)
    return materialize(model)
