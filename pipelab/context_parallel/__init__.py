"""Context parallelism (lesson 14): one sequence's attention split over ranks along the tokens.

- `online_softmax`: attention over one block of keys, the exact merge of two blocks' results, and
  a block's gradients from the final result;
- `layout`: which tokens each rank holds, contiguous or zig-zag (the causal load balance);
- `ring`: ring attention, keys and values passed around the ring, forward and backward;
- `ulysses`: all-to-all attention, re-sharding from the sequence to the heads and back.
"""

from pipelab.context_parallel.layout import LAYOUTS, Layout, causal_pair
from pipelab.context_parallel.online_softmax import attend_block, block_grads, merge
from pipelab.context_parallel.ring import Ring, RingAttention, ring_attention
from pipelab.context_parallel.ulysses import heads_to_sequence, sequence_to_heads, ulysses_attention

__all__ = ["LAYOUTS", "Layout", "Ring", "RingAttention", "attend_block", "block_grads", "causal_pair",
           "heads_to_sequence", "merge", "ring_attention", "sequence_to_heads", "ulysses_attention"]
