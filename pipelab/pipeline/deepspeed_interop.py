"""The real DeepSpeed beside `pipelab.pipeline`: our layer lists as `deepspeed.pipe`'s, its module
built with our loss, seeds and checkpointing, and DeepSpeed imported quietly onto our process group.

DeepSpeed is optional (`pip install -e ".[deepspeed]"`, which works on a CPU-only machine); nothing
here imports it until it is asked for.
"""

from __future__ import annotations

import importlib.util

import torch

from pipelab.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec


def deepspeed_available() -> bool:
    """True when `import deepspeed` works here (`pip install -e ".[deepspeed]"`)."""
    return importlib.util.find_spec("deepspeed") is not None


def to_deepspeed_layers(layers: list) -> list:
    """Our layer list with each LayerSpec / TiedLayerSpec rewritten as DeepSpeed's own."""
    from deepspeed.pipe import LayerSpec as DSLayerSpec, TiedLayerSpec as DSTiedLayerSpec

    out = []
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            out.append(DSTiedLayerSpec(layer.key, layer.typename, *layer.module_args, forward_fn=layer.forward_fn,
                                       tied_weight_attr=layer.tied_weight_attr, **layer.module_kwargs))
        elif isinstance(layer, LayerSpec):
            out.append(DSLayerSpec(layer.typename, *layer.module_args, **layer.module_kwargs))
        else:
            out.append(layer)
    return out


def import_deepspeed(backend: str):
    """Import DeepSpeed in a worker, quietly, and have it adopt the process group already started."""
    import logging
    import os
    import warnings

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than have DeepSpeed warn
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed broadcasts tied weights that require grad; autograd warns about it, harmlessly.
    warnings.filterwarnings("ignore", message="c10d::broadcast_")
    deepspeed.init_distributed(dist_backend=backend)
    return deepspeed


def deepspeed_module(layers: list, num_stages: int, method: str, like: PipelineModule):
    """`deepspeed.pipe.PipelineModule` on our layers, with `like`'s loss, seeds and checkpointing."""
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    return DSPipelineModule(
        to_deepspeed_layers(layers), num_stages=num_stages, loss_fn=like.loss_fn, partition_method=method,
        base_seed=like.base_seed, seed_layers=like.seed_layers,
        activation_checkpoint_interval=like.activation_checkpoint_interval,
        # DeepSpeed's own seeding passes a numpy integer to random.seed, which Python 3.11 refuses.
        seed_fn=lambda seed: torch.manual_seed(int(seed)))


def deepspeed_partitions(layers: list, cuts: list[tuple[int, str]]) -> dict[tuple[int, str], list[int]]:
    """DeepSpeed's boundaries of `layers` for each (num_stages, method) in `cuts`, on a rank whose
    process group has formed (`import_deepspeed` first)."""
    import contextlib
    import io

    like = PipelineModule(layers, num_stages=1, partition_method="uniform", verbose=False)
    parts = {}
    for num_stages, method in cuts:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints every stage table
            module = deepspeed_module(layers, num_stages, method, like)
        parts[num_stages, method] = [int(p) for p in module.parts]
    return parts


def deepspeed_train(deepspeed, module: PipelineModule, inputs: torch.Tensor, targets: torch.Tensor,
                    num_microbatches: int, steps: int, lr: float, world_size: int):
    """`module`'s layers, partition method and seeds trained by DeepSpeed's pipeline engine with SGD
    for `steps` batches, each replica taking its share of `inputs` in `num_microbatches`: this
    rank's (boundaries, losses per step, weights after the last step)."""
    ds_module = deepspeed_module(module._layer_specs, module.num_stages, module.partition_method, module)
    optimizer = torch.optim.SGD(ds_module.parameters(), lr=lr)
    dp, M = world_size // module.num_stages, num_microbatches
    micro = inputs.shape[0] // (dp * M)
    config = {"train_batch_size": micro * M * dp, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": M, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=ds_module, optimizer=optimizer, config=config)
    replica = engine.grid.get_data_parallel_rank()
    data = list(zip(inputs.chunk(dp)[replica].chunk(M), targets.chunk(dp)[replica].chunk(M)))
    losses = [float(engine.train_batch(iter(data))) for _ in range(steps)]
    weights = {n: p.detach().cpu().clone() for n, p in ds_module.named_parameters()}
    return [int(p) for p in ds_module.parts], losses, weights
