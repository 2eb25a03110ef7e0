"""Running a lesson from a notebook: start the workers, gather what they measured, compare with
the single-process reference and with torch's (or DeepSpeed's) own implementation.

One file per lesson family. The algorithms these run live below (`pipelab.ddp`,
`pipelab.pipeline`, `pipelab.model_parallel`, ...) and never import from here.
"""
