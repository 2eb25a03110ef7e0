"""Exercises of lessons 09 and 10: where to put a split point so the stages balance, and a
language model's perplexity from the losses the last stage computed per micro-batch."""

from __future__ import annotations

import math

import torch
from torch import nn

from pipelab.exercises.core import Wrong, call, checker, unchanged

# ---------------------------------------------------------------------------------------------
# 09: where to split
# ---------------------------------------------------------------------------------------------


class Tower(nn.Module):
    """An embedding, three blocks and a wide head: not a list of layers, so it is traced to be cut."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.head(h)


def _stage_parameters(model: nn.Module, point: str) -> list[int]:
    from pipelab.pipeline.trace import split

    stages = split(model, [point]).stages
    x = torch.randn(3, 8)
    out = x
    for stage in stages:
        out = stage(out)
    if not torch.allclose(out, model(x), atol=1e-6):
        raise Wrong(f"the two stages cut before {point!r} do not compute the model's output")
    return [sum(p.numel() for p in stage.parameters()) for stage in stages]


@checker("09_split_point")
def check_split_point(my_split_point) -> str:
    """`my_split_point(model)` -> the name of the submodule before which to cut `model` into two
    stages holding as equal a number of parameters as possible (the heaviest as light as it can be)."""
    torch.manual_seed(9)
    model = Tower()
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    point = call(my_split_point, model)
    if set(model.state_dict()) != set(kept) or any(not torch.equal(v, kept[k]) for k, v in model.state_dict().items()):
        raise Wrong("your function changed the model it was given (its parameters or submodules): only read it")
    names = [name for name, _ in model.named_modules() if name and name != "blocks"]
    if isinstance(point, nn.Module):
        raise Wrong(f"you returned a module ({type(point).__name__}), not its name: return the name "
                    f"model.named_modules() gives it, one of {names}")
    if point not in names:
        raise Wrong(f"{point!r} is not a submodule of the model; the candidates are {names}")
    if point == names[0]:
        raise Wrong(f"cut before {point!r}, the first stage would hold nothing: the cut goes between two submodules")
    try:
        mine = _stage_parameters(model, point)
    except Wrong:
        raise
    except Exception as e:  # noqa: BLE001 - a point torch.fx cannot cut at
        raise Wrong(f"the model cannot be cut before {point!r}: {e}") from None
    candidates = [(n, _stage_parameters(model, n)) for n in names[1:]]
    best_point, best = min(candidates, key=lambda t: max(t[1]))
    if max(mine) > max(best):
        at = names.index(point)
        why = ""
        if abs(at - (len(names) - at)) <= 1:
            why = (f": this cut puts {at} and {len(names) - at} submodules on the stages, balancing the layers; "
                   "count each submodule's parameters instead")
        elif at == names.index(best_point) + 1:
            why = (f": the best cut is just before, before {best_point!r}; the name is of the first submodule of the "
                   "second stage")
        raise Wrong(f"cut before {point!r}, the stages hold {mine[0]:,} and {mine[1]:,} parameters; the best cut's "
                    f"heaviest stage holds {max(best):,}{why}")
    return f"cut before {point!r}: stages of {mine[0]:,} and {mine[1]:,} parameters, the best balance"


# ---------------------------------------------------------------------------------------------
# 10: perplexity from per-micro-batch losses
# ---------------------------------------------------------------------------------------------

MICROBATCH_ROWS = [2, 2, 1]  # the last micro-batch is shorter, as at the end of a text


def perplexity_case() -> tuple[list[float], list[int], float]:
    """Per-micro-batch mean losses and token counts of a small LM, and the batch's perplexity."""
    from pipelab.lm import TransformerLM, lm_loss

    torch.manual_seed(10)
    model = TransformerLM(50, emsize=16, nhead=2, nhid=32, nlayers=1)
    ids = torch.randint(0, 50, (sum(MICROBATCH_ROWS), 13))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    losses, tokens = [], []
    with torch.no_grad():
        for rows_in, rows_out in zip(inputs.split(MICROBATCH_ROWS), targets.split(MICROBATCH_ROWS)):
            losses.append(lm_loss(model(rows_in), rows_out).item())
            tokens.append(rows_out.numel())
        want = math.exp(lm_loss(model(inputs), targets).item())
    return losses, tokens, want


@checker("10_perplexity")
def check_perplexity(my_perplexity) -> str:
    """`my_perplexity(mb_losses, mb_tokens)` -> the batch's perplexity, from each micro-batch's
    loss (a mean over its tokens, as the last stage computed it) and its number of tokens."""
    losses, tokens, want = perplexity_case()
    given_losses, given_tokens = list(losses), list(tokens)
    got = call(my_perplexity, given_losses, given_tokens)
    unchanged("mb_losses", losses, given_losses)
    unchanged("mb_tokens", tokens, given_tokens)
    try:
        got = float(got)
    except (TypeError, ValueError):
        raise Wrong(f"my_perplexity returned {got!r}, not a number") from None
    if math.isclose(got, want, rel_tol=1e-4):
        return f"perplexity {got:.3f}, the batch's exp(loss per token) over {sum(tokens)} tokens"
    wrong = {
        math.exp(sum(losses) / len(losses)): f"exp of the micro-batches' mean loss: weight each loss by its tokens "
                                              f"({tokens}), since the last micro-batch is shorter",
        math.exp(sum(losses) / sum(tokens)): "each loss is already a mean over its tokens: "
                                             "it is divided by the token count twice",
        math.exp(sum(losses)): "the losses are summed but never divided: average them per token",
        sum(l * n for l, n in zip(losses, tokens)) / sum(tokens): "that is the loss per token; perplexity is its exp",
        2 ** (sum(l * n for l, n in zip(losses, tokens)) / sum(tokens)):
            "that is 2 to the loss per token: the loss is in nats (natural log), so perplexity is exp of it",
        sum(math.exp(l) * n for l, n in zip(losses, tokens)) / sum(tokens):
            "the token-weighted mean of the micro-batches' perplexities: average the losses per token first, "
            "then exp (the exp of a mean is not the mean of the exps)",
    }
    for left_out in range(len(losses)):  # a micro-batch dropped, e.g. the shorter last one
        kept = [(l, n) for i, (l, n) in enumerate(zip(losses, tokens)) if i != left_out]
        wrong.setdefault(math.exp(sum(l * n for l, n in kept) / sum(n for _, n in kept)),
                         f"micro-batch {left_out} ({tokens[left_out]} tokens) is left out: every micro-batch counts")
    shown = ", ".join(f"{loss:.3f}" for loss in losses)  # where no known mistake fits: what it should be
    why = next((text for value, text in wrong.items() if math.isclose(got, value, rel_tol=1e-4)),
               f"it is exp(sum of loss x tokens / all {sum(tokens)} tokens) for the losses [{shown}] and tokens {tokens}")
    raise Wrong(f"your perplexity is {got:.4g}, the batch's is {want:.4g}: {why}")
