"""A `gpu` profile's FLOP count in a notebook's metadata is what its lesson's `run_flops` counts at
the profile's sizes (on the meta device), so `pipelab profiles` never prints a stale budget."""

import json
from pathlib import Path

import pytest

from pipelab.emulate.cost import budget, step_flops
from pipelab.experiments import context_parallel, expert_parallel, sharding, tensor_parallel, v_schedules

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def gpu_profile(stem: str) -> tuple[dict, dict]:
    """The notebook's parameters (its defaults with the gpu profile's values) and its needs."""
    nb = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    params: dict = {}
    exec("".join(cell["source"]), {}, params)
    params.update(nb["metadata"]["pipelab"]["profiles"]["gpu"])
    return params, nb["metadata"]["pipelab"]["needs"]["gpu"]


COUNTS = {
    "11_sharding": sharding.run_flops,
    "12_tensor_parallelism": tensor_parallel.run_flops,
    "13_zbv_dualpipev_looped_bfs": v_schedules.run_flops,
    "14_context_parallelism": context_parallel.run_flops,
    "15_expert_parallelism": expert_parallel.run_flops,
}


@pytest.mark.parametrize("stem", sorted(COUNTS))
def test_profile_flops_match_the_count(stem):
    params, needs = gpu_profile(stem)
    assert needs["flops"] == pytest.approx(COUNTS[stem](params), rel=1e-3)


def test_step_flops_of_a_linear_layer_by_hand():
    import torch

    layer = torch.nn.Linear(64, 32).to("meta")
    # forward 2*rows*in*out, input gradient the same, weight gradient the same (bias sums are not FLOPs
    # torch's counter counts)
    assert step_flops(layer, torch.empty(8, 64, device="meta")) == 3 * 2 * 8 * 64 * 32


def test_budget_spreads_flops_over_the_node():
    # 4 H100s at half their dense fp32 peak (67 TFLOP/s each): 134 TFLOP/s together
    assert budget(134e12, "4xH100-nvlink").startswith("about 1 s of compute on 4 x NVIDIA H100 SXM")
