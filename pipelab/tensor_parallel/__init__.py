"""Tensor and sequence parallelism (lesson 12): a layer's matrices cut across the ranks of a
tensor-parallel group, as Megatron-LM does.

- `comm`: the conjugate operators (identity forward / all-reduce backward and the reverse, and the
  sequence-parallel all-gather / reduce-scatter pair), and a meter of the bytes they send;
- `layers`: column- and row-parallel linear layers, the MLP and the attention built from them, and
  a Transformer block, each made from the unsplit layer's weights so they can be compared with it.
"""

from pipelab.tensor_parallel.comm import (CommMeter, TensorParallelGroup, copy_to_parallel,
                                          gather_from_sequence, reduce_from_parallel,
                                          scatter_to_sequence)
from pipelab.tensor_parallel.layers import (ColumnParallelLinear, ParallelAttention, ParallelBlock,
                                            ParallelMLP, RowParallelLinear)

__all__ = ["ColumnParallelLinear", "CommMeter", "ParallelAttention", "ParallelBlock", "ParallelMLP",
           "RowParallelLinear", "TensorParallelGroup", "copy_to_parallel", "gather_from_sequence",
           "reduce_from_parallel", "scatter_to_sequence"]
