"""Lesson 17: finding what goes wrong in a distributed job -- hangs and silently wrong gradients.

* `collective_check`: before each collective the ranks compare (kind, group, shape, dtype) and a
  mismatch raises at once, naming both ranks' calls (`consistency`).
* `flight_recorder`: each rank's last N communication operations in a ring buffer, dumped when one
  waits too long; `diagnose(load_dumps(dir))` reads all ranks' dumps: who waits for whom (`reader`).
* `check_replicas`: replicas that should agree compare checksums; the disagreeing ones are named
  with the first parameter that differs (`replicas`).
* `compare_with_one_process`: a user's distributed step beside the same math in one process (`compare`).
* `bugs`: four real bugs from the trackers, in miniature, each with its fix.
"""

from pipelab.debug.compare import Comparison, compare_with_one_process
from pipelab.debug.consistency import CollectiveMismatch, collective_check
from pipelab.debug.flight_recorder import FlightRecorder, flight_recorder
from pipelab.debug.reader import Diagnosis, diagnose, load_dumps
from pipelab.debug.replicas import ReplicaReport, check_replicas

__all__ = ["CollectiveMismatch", "Comparison", "Diagnosis", "FlightRecorder", "ReplicaReport", "check_replicas",
           "collective_check", "compare_with_one_process", "diagnose", "flight_recorder", "load_dumps"]
