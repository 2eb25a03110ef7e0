"""Mixed precision (lesson 16): what a training step holds, and in which format.

- `formats`: fp32, tf32, bf16, fp16 and FP8's range and precision, and what rounding does to gradients;
- `loss_scaler`: fp16's dynamic loss scaling (scale, check for inf/nan, skip and halve, grow);
- `master_weights`: 16-bit weights for the math, fp32 master weights for the update;
- `fp8`: per-tensor scaling into float8_e4m3fn, current and delayed (an amax history);
- `recompute`: a Transformer block that keeps all, none, or all but the attention's scores;
- `zero`: ZeRO-1/2/3 in mixed precision, from lesson 11's flat shards.
"""

from pipelab.precision.formats import FORMATS, Format, format_of, rounding_effect
from pipelab.precision.fp8 import DelayedScaling, amax, dequantize, fp8_matmul, quantize, scale_for
from pipelab.precision.loss_scaler import DynamicLossScaler
from pipelab.precision.master_weights import RECIPES, MasterWeights, bytes_per_parameter
from pipelab.precision.recompute import MODES, RecomputedBlock, attention_core
from pipelab.precision.zero import MixedZero

__all__ = ["DelayedScaling", "DynamicLossScaler", "FORMATS", "Format", "MODES", "MasterWeights", "MixedZero",
           "RECIPES", "RecomputedBlock", "amax", "attention_core", "bytes_per_parameter", "dequantize",
           "format_of", "fp8_matmul", "quantize", "rounding_effect", "scale_for"]
