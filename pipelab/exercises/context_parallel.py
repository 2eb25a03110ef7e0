"""Exercise of lesson 14: the online-softmax merge of two blocks' partial attention results, the
step every ring-attention rank repeats once per block of keys it receives."""

from __future__ import annotations

import torch

from pipelab.context_parallel.online_softmax import attend_block
from pipelab.exercises.core import Wrong, call, checker, how_far, same


def _cases() -> list[tuple[str, tuple, tuple]]:
    """(what, (O_a, L_a, O_b, L_b), (O, L) over both blocks): two blocks of unequal length, and the
    same with scores large enough that exp(L) overflows float32."""
    g = torch.Generator().manual_seed(14)
    q, k, v = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    cases = []
    for what, scale in (("blocks of 4 and 8 keys", 8 ** -0.5), ("scores near 300 (exp overflows float32)", 60.0)):
        a = attend_block(q, k[:, :, :4], v[:, :, :4], scale)
        b = attend_block(q, k[:, :, 4:], v[:, :, 4:], scale)
        cases.append((what, (*a, *b), attend_block(q, k, v, scale)))
    return cases


def _diagnose(out, lse, parts) -> str:
    """Name the mistake: the result compared with the usual wrong merges."""
    oa, la, ob, lb = parts
    wa, wb = la.exp().unsqueeze(-1), lb.exp().unsqueeze(-1)
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        return ("gave inf or nan: exp(L) overflows float32 when scores are large; subtract the larger L first "
                "(torch.logaddexp, or m = max(L_a, L_b) and exp(L_a - m))")
    known = [((oa + ob) / 2, None, "is the plain average of the two outputs: weight each block by its share "
              "of the softmax's sum, exp(L_a - L) and exp(L_b - L)"),
             (wa * oa + wb * ob, None, "weights the blocks by exp(L_a) and exp(L_b) without dividing by their "
              "sum exp(L): the output is not normalised"),
             (torch.exp(lb - torch.logaddexp(la, lb)).unsqueeze(-1) * oa
              + torch.exp(la - torch.logaddexp(la, lb)).unsqueeze(-1) * ob, None,
              "swaps the weights: block a's output takes exp(L_a - L), not exp(L_b - L)"),
             (None, torch.maximum(la, lb), "L is the larger of L_a and L_b: the log-sum-exp of both blocks is "
              "log(exp(L_a) + exp(L_b)) (torch.logaddexp)"),
             (None, la + lb, "L is L_a + L_b: that is the log of the product of the sums, not of their sum "
              "(torch.logaddexp)")]
    for want_out, want_lse, message in known:
        if (want_out is not None and same(out, want_out)) or (want_lse is not None and same(lse, want_lse)):
            return message
    return ""


@checker("14_online_softmax_merge")
def check_online_softmax_merge(fn) -> str:
    """`fn(out_a, lse_a, out_b, lse_b) -> (out, lse)` must give attention over both blocks of keys."""
    for what, parts, (want_out, want_lse) in _cases():
        got = call(fn, *(t.clone() for t in parts))
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            raise Wrong(f"returned {type(got).__name__}: return a pair (out, lse), the merged output and log-sum-exp")
        out, lse = got
        if same(out, want_out) and same(lse, want_lse):
            continue
        why = _diagnose(out, lse, parts)
        if why:
            raise Wrong(f"{what}: your merge {why}")
        wrong_part, got_part, want_part = ("output", out, want_out) if not same(out, want_out) else ("lse", lse, want_lse)
        raise Wrong(f"{what}: the merged {wrong_part} {how_far(got_part, want_part)}")
    return "two blocks merge into attention over all their keys, also where exp(L) overflows float32"
