"""Every exercise's checker held against the wrong and right answers of tests/exercise_answers.py
(lessons 14-17: of the test modules its ELSEWHERE names), each run REPEATS times: a wrong answer
must fail every time with the words that name its mistake, the solution and a differently written
right answer must pass every time.

    python benchmarks/exercise_sweep.py [REPEATS] [EXERCISE ...]

Prints one line per answer (how many runs gave the expected verdict, and the message); the last
line is one JSON object with the counts."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import importlib  # noqa: E402

import exercise_answers as answers  # noqa: E402

from pipelab import exercises  # noqa: E402


def main(argv: list[str]) -> int:
    repeats = int(argv[0]) if argv and argv[0].isdigit() else 5
    only = [a for a in argv if not a.isdigit()]
    cases = [(name, fn, words, False) for name, fn, words in answers.WRONG]
    cases += [(name, fn, [], True) for name, fn in answers.RIGHT]
    for name, module in answers.ELSEWHERE.items():  # lessons 14-17 keep theirs beside their tests
        held = importlib.import_module(module)
        cases += [(name, fn, [words] if isinstance(words, str) else list(words), False) for fn, words in held.WRONG_ANSWERS]
        cases += [(name, fn, [], True) for fn in held.RIGHT_ANSWERS]
    cases += [(name, exercises.solution(name), [], True) for name in exercises.EXERCISES]
    if only:  # in the order asked
        cases = sorted((c for c in cases if c[0] in only), key=lambda c: only.index(c[0]))
    counts = {"answers": 0, "always_as_expected": 0, "runs": 0}
    start = time.monotonic()
    for name, fn, words, right in cases:
        check = exercises.EXERCISES[name][1]
        good, messages = 0, set()
        for _ in range(repeats):
            grade = check(fn, quiet=True)
            good += grade.passed if right else (not grade.passed and all(w in grade.message for w in words))
            messages.add(grade.message)
        counts["answers"] += 1
        counts["runs"] += repeats
        counts["always_as_expected"] += good == repeats
        kind = "right" if right else "wrong"
        print(f"{good}/{repeats} {name} {kind} {fn.__name__}: {' | '.join(sorted(messages))}", flush=True)
    counts["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(counts))
    return 0 if counts["always_as_expected"] == counts["answers"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
