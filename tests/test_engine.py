"""The instruction-stream engine on 2 real ranks gives the single-process loss and gradients."""
import torch

from pipelab.models import mlp
from pipelab.pipeline.engine import train_step


def test_engine_gradients_equal_single_process_reference():
    torch.manual_seed(0)
    model = mlp([8, 16, 16, 4])
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    loss_ref = torch.nn.functional.mse_loss(model(x), y)
    loss_ref.backward()
    results = train_step(model, x, y, num_stages=2, micro_batches=4, partition_method="uniform")
    grads = [g for _, gs, _ in results for g in gs]
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(results[-1][0]), loss_ref.detach(), atol=1e-5, rtol=1e-5)
