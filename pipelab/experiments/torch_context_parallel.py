"""torch's side of lesson 14: `torch.distributed.tensor.experimental.context_parallel` on the same
data as ours, and what it answers on CPU where it does not run (the exception it raised)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from pipelab.worker import RankContext


def torch_context_parallel(ctx: RankContext, cfg) -> tuple[torch.Tensor, dict[str, str]]:
    """torch's `context_parallel` on the same data, non-causal with the math backend (what runs on
    CPU): it shards q, k and v in place (head-tail: our zig-zag) and patches
    scaled_dot_product_attention inside the block. Returns this rank's shard of the output, and
    per backend what it answered for causal attention: "ran", or the exception (type, first line)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))

    def attend(causal: bool, kernel) -> torch.Tensor:
        q, k, v = (t.to(ctx.device) for t in cfg.data()[:3])
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]), kernel:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = attend(False, sdpa_kernel(SDPBackend.MATH)).detach().cpu()
    answers = {}
    for backend in ("math", "default"):
        try:
            attend(True, sdpa_kernel(SDPBackend.MATH) if backend == "math" else nullcontext())
            answers[f"causal, {backend} backend"] = "ran"
        except Exception as e:  # noqa: BLE001 - what torch raised is the lesson's figure
            answers[f"causal, {backend} backend"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return out, answers
