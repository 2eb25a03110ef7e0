"""Expert parallelism (lesson 15): a Mixture-of-Experts layer, then its experts spread over ranks.

- `routing`: the router's scores, the top-k experts of each token with their weights, each expert's
  capacity and which assignments it drops, and Switch Transformer's load-balancing loss;
- `experts`: a bank of expert MLPs, one weight matrix pair per expert;
- `layer`: the whole layer in one process (route, keep within capacity, compute, weighted combine);
- `dispatch`: the same layer with `experts / n` experts per rank: tokens sent to the rank holding
  their expert with `all_to_all_single` (counts first, as the splits are uneven) and combined back
  with a second one; the gradients reduced over the ranks that share each weight.
"""

from pipelab.expert_parallel.dispatch import (AllToAll, ExpertParallelGroups, ExpertParallelMoE, all_to_all_counts,
                                              reduce_gradients)
from pipelab.expert_parallel.experts import Experts
from pipelab.expert_parallel.layer import MoELayer, MoEOutput
from pipelab.expert_parallel.routing import (Routing, capacity, keep_within_capacity, load_balancing_loss, route)

__all__ = ["AllToAll", "ExpertParallelGroups", "ExpertParallelMoE", "Experts", "MoELayer", "MoEOutput", "Routing",
           "all_to_all_counts", "capacity", "keep_within_capacity", "load_balancing_loss", "reduce_gradients",
           "route"]
