"""What every checker shares: the `Grade` it returns, running a student's function on real ranks
without ever hanging, comparing with the reference in a sentence, and loading a solution.

A student's function may be unwritten (it raises NotImplementedError), raise, return the wrong
thing, or wait for a message nobody sends. Each of these ends in a Grade whose message says so,
never in an exception or a hang: the ranks run under NCCL's ordering rule, whose watchdog stops a
deadlock within seconds and names what every rank waits on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipelab.exercises.recorder import Wrong

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"


@dataclass(frozen=True)
class Grade:
    """The checker's answer: whether the exercise passed, and one or two lines saying why."""

    exercise: str
    passed: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} {self.exercise}: {self.message}"

    def __bool__(self) -> bool:
        return self.passed


def checker(exercise: str):
    """Turn `check(fn) -> pass message` (raising `Wrong` when the answer is wrong) into a checker
    that prints and returns a `Grade`, whatever the student's function does."""
    def wrap(check: Callable) -> Callable:
        @functools.wraps(check)
        def run(fn: Callable, *args, quiet: bool = False, **kwargs) -> Grade:
            try:
                grade = Grade(exercise, True, check(fn, *args, **kwargs))
            except Wrong as e:
                grade = Grade(exercise, False, str(e))
            except NotImplementedError as e:
                grade = Grade(exercise, False, not_written(fn, e))
            except Exception as e:  # noqa: BLE001 - the student's error is the grade's message
                grade = Grade(exercise, False, f"{name_of(fn)} raised {type(e).__name__}: {first_line(e)}")
            if not quiet:
                print(grade)
                if not grade.passed:
                    print(f"(stuck? the worked solution: print(exercises.solution_text({exercise!r})))")
            return grade
        run.exercise = exercise
        return run
    return wrap


def name_of(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


def first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__ if isinstance(e, BaseException) else ""


def not_written(fn, e: BaseException | str = "") -> str:
    why = first_line(e)
    name = fn if isinstance(fn, str) else name_of(fn)
    return f"{name} is not written yet ({why or 'NotImplementedError'}): write its body, then run this cell again"


def call(fn: Callable, *args, **kwargs):
    """The student's function on these arguments; a crash inside becomes a failing grade."""
    try:
        return fn(*args, **kwargs)
    except (Wrong, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001
        raise Wrong(f"{name_of(fn)} raised {type(e).__name__}: {first_line(e)}") from e


# ---------------------------------------------------------------------------------------------
# Comparing with the reference
# ---------------------------------------------------------------------------------------------


def ratio(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The factor `got` is of `want` when it is one (least squares), else None."""
    got, want = got.detach().double().flatten(), want.detach().double().flatten()
    scale = float(got @ want / (want @ want)) if float(want @ want) > 0 else float("nan")
    if scale == scale and torch.allclose(got, scale * want, rtol=1e-3, atol=1e-6):
        return scale
    return None


def how_far(got: torch.Tensor, want: torch.Tensor, hints: dict[float, str] | None = None) -> str:
    """'2.00x the reference: <hint>' or 'off by up to 0.31 (largest where the reference is 1.2)'."""
    if got.shape != want.shape:
        return f"has shape {tuple(got.shape)} where the reference has {tuple(want.shape)}"
    scaled = scale_text(got, want, hints)
    if scaled is not None:
        return scaled
    diff = (got.detach().double() - want.detach().double()).abs()
    worst = int(diff.flatten().argmax())
    return (f"differs from the reference by up to {diff.max().item():.3g} "
            f"(element {worst}: yours {got.flatten()[worst].item():.4g}, reference {want.flatten()[worst].item():.4g})")


def scale_text(got: torch.Tensor, want: torch.Tensor, hints: dict[float, str] | None = None) -> str | None:
    """'is 2.00x the reference: <hint or what a scale means>' when `got` is a multiple of `want`, else None."""
    if got.shape != want.shape:
        return None
    scale = ratio(got, want)
    if scale is None:
        return None
    hint = next((text for k, text in (hints or {}).items() if abs(scale - k) < 1e-3 * max(1, abs(k))), "")
    return f"is {scale:.2f}x the reference: " + (hint or "the right direction at the wrong scale (a factor too many or missing)")


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-5)


def unchanged(name: str, before, after) -> None:
    """Raise Wrong when the student's function changed an input the caller still uses."""
    equal = torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after
    if not equal:
        raise Wrong(f"your function changed its input {name} in place (it was {_short(before)}, now {_short(after)}): "
                    "the caller still uses it; compute on a copy")


def _short(value) -> str:
    text = str(value.tolist() if isinstance(value, torch.Tensor) else value)
    return text if len(text) < 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Real ranks that never hang
# ---------------------------------------------------------------------------------------------


def on_ranks(body: Callable, world_size: int, *args, timeout: float = 90.0, runs: int = 1) -> list:
    """`body(ctx, *args)` on `world_size` real ranks under NCCL's ordering rule (`spawn(...,
    nccl_rule=True)`): a wrong order of sends, receives or collectives fails within seconds, as it
    would hang on GPUs. Run `runs` times, sends starting late in the first run and at once in the
    next, so an answer that is right only by timing fails. Returns the last run's results; raises
    `Wrong` saying which ranks waited on what, or what the student's function raised."""
    from pipelab.exercises.recorder import SEND_DELAY
    from pipelab.launch import WorkerError, spawn

    printed = io.StringIO()
    try:
        for run in range(runs):
            with contextlib.redirect_stdout(printed):
                try:
                    results = spawn(_perturbed, world_size, body, SEND_DELAY if run == 0 else 0.0, *args,
                                    timeout=timeout, nccl_rule=True)
                except WorkerError as e:
                    raise Wrong(_explain(e, name_of(args[0]) if args else "your function")) from None
            printed = io.StringIO() if run < runs - 1 else printed
        return results
    finally:
        _print_students_lines(printed.getvalue())


def _perturbed(ctx, body: Callable, send_delay: float, *args):
    """In a rank: the body, with the recorder's sends starting `send_delay` s late."""
    from pipelab.exercises import recorder

    recorder.SEND_DELAY = send_delay
    return body(ctx, *args)


def student_call(ctx, fn: Callable, *args, refuse=None):
    """`fn(*args)` on this rank with its torch.distributed calls recorded; every request it issued
    must have been waited for. Returns (result, the Recorder)."""
    from pipelab.exercises import recorder

    with recorder.Recorder(ctx.rank, refuse, recorder.SEND_DELAY) as rec:
        out = fn(*args)
    rec.finish()
    return out, rec


def _print_students_lines(text: str) -> None:
    """What the ranks printed, less the C++ backtraces a rank stopped mid-message leaves behind."""
    noise = re.compile(r"^\[rank \d+\] (\[[WE]\d{4} |frame #|Exception raised from|<omitting|\s*$)")
    lines = [line for line in text.splitlines() if not noise.match(line)]
    if lines:
        print("\n".join(lines))


def _explain(e, name: str) -> str:
    """One or two lines from a failed run: the deadlock's waits, the student's error, or the cause."""
    text = e.args[0]
    for each in [e, *getattr(e, "consequences", [])]:  # a failed check on any rank names the mistake best
        if "raised Wrong: " in each.args[0]:
            return each.args[0].split("raised Wrong: ", 1)[1].strip()
    if "raised DeadlockError: " in text:
        report = text.split("raised DeadlockError: ", 1)[1]
        lines = [line.strip(" ;.") for line in report.splitlines()[1:] if line.startswith("  ")]
        waits = [line for line in lines if "has finished" not in line]
        done = [line.split()[1] for line in lines if "has finished" in line]
        finished = f" (rank{'s' if len(done) > 1 else ''} {', '.join(done)} finished)" if done else ""
        return ("deadlock, it would hang on GPUs: " + "; ".join(waits) + finished
                + ". A send waits until its receive is posted: every receive needs its send, in the same order")
    if "raised NotImplementedError: " in text:
        return not_written(name, text.split("raised NotImplementedError: ", 1)[1])
    if "GLHF" in text or "Connection closed by peer" in text:
        return ("a rank's connection closed in the middle of a message: a peer ended while a message to or from "
                "it was still in flight (a request never waited for, or a send with no receive)")
    last = e.traceback.strip().splitlines()[-1] if e.traceback.strip() else ""
    return first_line(text) + (f" ({first_line(last)})" if last and last not in text else "")


# ---------------------------------------------------------------------------------------------
# Solutions
# ---------------------------------------------------------------------------------------------


def solution_text(name: str) -> str:
    """The worked solution of exercise `name` as text, for a student who passed or gave up."""
    path = SOLUTIONS / f"{name}.py"
    if not path.exists():
        raise ValueError(f"no solution {name!r} in {SOLUTIONS}; known: {sorted(p.stem for p in SOLUTIONS.glob('[0-9]*.py'))}")
    return path.read_text()


def solution(name: str) -> Callable:
    """The reference solution of exercise `name` ("12_row_parallel"): the function defined in
    solutions/<name>.py at the root of the repository, sent to workers by value like a notebook's."""
    import cloudpickle

    path = SOLUTIONS / f"{name}.py"
    if not path.exists():
        known = sorted(p.stem for p in SOLUTIONS.glob("[0-9]*.py"))
        raise ValueError(f"no solution {name!r} in {SOLUTIONS}; known: {known}")
    module_name = f"pipelab_solution_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    functions = [v for k, v in vars(module).items() if k.startswith("my_") and callable(v)]
    if len(functions) != 1:
        raise ValueError(f"{path} must define exactly one my_... function, found {len(functions)}")
    return functions[0]
