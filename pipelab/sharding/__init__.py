"""Sharding data parallelism (lesson 11): ZeRO-1, ZeRO-2 and ZeRO-3 / FSDP, built from the two
halves of the ring all-reduce, reduce-scatter and all-gather.

- `flat`: a layer's parameters as one flat vector, padded to split into equal shards;
- `comm`: the three collectives, each call counted (bytes sent) and put on the timeline;
- `memory`: the bytes a rank really holds (tensor storages) and the formula beside them;
- `zero`: plain data parallelism, ZeRO-1 and ZeRO-2 (whole parameters, sharded state);
- `fsdp`: ZeRO-3 / FSDP (sharded parameters, gathered layer by layer, with prefetch).
"""

from pipelab.sharding.comm import Collectives, Pending, ring_bytes
from pipelab.sharding.flat import FlatLayout, Layer, layers_of
from pipelab.sharding.fsdp import Zero3
from pipelab.sharding.memory import Held, formula, held_by, storage_bytes
from pipelab.sharding.zero import OPTIMIZERS, DataParallel, Trainer, Zero1, Zero2, make_optimizer

__all__ = ["Collectives", "DataParallel", "FlatLayout", "Held", "Layer", "OPTIMIZERS", "Pending", "Trainer",
           "Zero1", "Zero2", "Zero3", "formula", "held_by", "layers_of", "make_optimizer", "ring_bytes",
           "storage_bytes"]
