"""The machines the course claims but this one is not, reproduced here by their rules: a container's
cgroup limits, macOS (no SC_AVPHYS_PAGES, memory from sysctl), Windows (no process groups), a full
TMPDIR, a shared output folder, a worker's detached helper and unfinished lines."""

import errno
import json
import os
import subprocess
import sys
import time

import pytest

from pipelab import cli, hardware, launch
from pipelab.launch import WorkerError, spawn


def fake_cgroup(root, **files):
    root.mkdir(exist_ok=True)
    for name, text in files.items():
        (root / name.replace("_", ".")).write_text(text + "\n")
    return root


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """A cgroup v2 mount of our own; /proc/self/cgroup's "0::/..." line is read as the folder below it."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(hardware, "CGROUP_ROOT", str(root))
    real_open = open

    def open_(path, *args, **kwargs):
        if path == "/proc/self/cgroup":
            return real_open(tmp_path / "self_cgroup", *args, **kwargs)
        return real_open(path, *args, **kwargs)

    (tmp_path / "self_cgroup").write_text("0::/\n")
    monkeypatch.setattr("builtins.open", open_)
    return root


def test_a_cpu_quota_limits_the_cores(cgroup, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    fake_cgroup(cgroup, cpu_max="150000 100000")  # docker run --cpus 1.5
    assert hardware.cgroup_cpu_limit() == 1.5
    assert hardware.cpu_cores() == 1
    fake_cgroup(cgroup, cpu_max="max 100000")  # no quota: every core of the affinity mask
    assert hardware.cpu_cores() == 64


def test_a_memory_limit_bounds_the_available_memory(cgroup, monkeypatch):
    monkeypatch.setattr(hardware, "_meminfo_available", lambda: 100 * 2**30)  # the host's, large
    fake_cgroup(cgroup, memory_max=str(4 * 2**30), memory_current=str(1 * 2**30))
    assert hardware.available_memory() == 3 * 2**30
    fake_cgroup(cgroup, memory_max="max")
    assert hardware.available_memory() == 100 * 2**30


def test_ranks_that_do_not_fit_the_cgroup_are_refused_before_starting(cgroup, monkeypatch):
    from pipelab.checks import ranks_fit

    monkeypatch.setattr(hardware, "_meminfo_available", lambda: 100 * 2**30)
    fake_cgroup(cgroup, memory_max=str(2**30), memory_current="0")
    with pytest.raises(ValueError, match=r"world_size=4 ranks need about 1\.2 GiB .* 1\.0 GiB available"):
        ranks_fit(4)


def test_macos_memory_comes_from_sysctl(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(hardware, "_meminfo_available", lambda: None)
    monkeypatch.setattr(hardware, "cgroup_memory_available", lambda: None)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="17179869184\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    assert hardware.available_memory() == 16 * 2**30
    assert calls == [["sysctl", "-n", "hw.memsize"]]
    assert hardware.cpu_cores() >= 1  # no affinity call on macOS: os.cpu_count()


def test_windows_is_refused_before_any_process_starts(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "win32")

    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(RuntimeError, match="WSL2"):
        spawn(launch.hello, 2)
    assert cli.main(["doctor"]) == 2
    assert "WSL2" in capsys.readouterr().err


def test_no_killpg_is_refused_like_windows(monkeypatch):
    monkeypatch.delattr(os, "killpg")
    assert "WSL2" in hardware.platform_problem()


def loopback_name(ctx):
    return os.environ.get("GLOO_SOCKET_IFNAME")


def test_local_ranks_talk_over_loopback():
    assert spawn(loopback_name, 2) == [hardware.loopback_interface()] * 2


def full_disk(ctx):
    """Every file the rank writes for its parent fails as on a full disk."""
    import pipelab.worker as worker

    def no_space(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    worker.dump_pickle = no_space
    return "a result that cannot be written"


def test_a_full_tmpdir_is_named():
    with pytest.raises(WorkerError, match="is full .* point TMPDIR at a larger disk"):
        spawn(full_disk, 2)


# The helper prints 3 s after it starts, when spawn has returned, then leaves its stamp (also when
# the print fails on the closed pipe, as it should).
LATE_HELPER = "import sys, time\ntime.sleep(3)\ntry:\n    print('late', flush=True)\nfinally:\n    open(sys.argv[1], 'w').close()"


def print_unfinished_and_detach(ctx, stamp):
    print("z" * 5, end="", flush=True)  # no end of line
    if ctx.rank == 0:  # a helper that leaves the rank's process group but keeps its stdout
        subprocess.Popen([sys.executable, "-c", LATE_HELPER, stamp], start_new_session=True)
    return ctx.rank


def test_a_detached_helper_neither_delays_nor_prints_later_and_lines_stay_apart(capfd, tmp_path):
    import threading

    before = threading.active_count()
    stamp = tmp_path / "helper-done"
    assert spawn(print_unfinished_and_detach, 2, str(stamp)) == [0, 1]
    assert threading.active_count() == before  # no output thread left behind
    deadline = time.monotonic() + 60
    while not stamp.exists() and time.monotonic() < deadline:  # the helper has printed, into a closed pipe
        time.sleep(0.05)
    assert stamp.exists(), "the helper never finished"
    time.sleep(0.2)  # where a reader still held the pipe, its line would be out by now
    out = capfd.readouterr().out
    assert "late" not in out
    lines = out.splitlines()
    assert "[rank 0] zzzzz" in lines and "[rank 1] zzzzz" in lines


def write_notebook(path, cells, metadata=None):
    import nbformat  # here, not above: every rank of this file's spawn() calls imports this file

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.update(metadata or {})
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nbformat.write(nb, str(path))
    return str(path)


@pytest.mark.parametrize("bad", ["a_file", "/proc", "a_file/below"])
def test_an_unwritable_out_folder_is_a_usage_error(tmp_path, capsys, bad):
    (tmp_path / "a_file").write_text("")
    nb = write_notebook(tmp_path / "01_x.ipynb", ["x = 1"])
    out = bad if bad.startswith("/") else str(tmp_path / bad)
    assert cli.main(["run", nb, "--out", out]) == 2
    err = capsys.readouterr().err
    assert "is not a folder we can write into" in err and "--out build" in err


def test_two_runs_into_one_folder_keep_both_rows(tmp_path):
    a = write_notebook(tmp_path / "01_a.ipynb", ["x = 1", "import pipelab\npipelab.headline('a', 1)"])
    b = write_notebook(tmp_path / "02_b.ipynb", ["x = 1", "import pipelab\npipelab.headline('b', 2)"])
    out = str(tmp_path / "out")
    pipelab_cmd = [sys.executable, "-m", "pipelab.cli", "run", "--out", out]
    runs = [subprocess.Popen(pipelab_cmd + [nb], stdout=subprocess.DEVNULL) for nb in (a, b)]
    assert [p.wait(timeout=300) for p in runs] == [0, 0]
    rows = json.load(open(os.path.join(out, "summary.json")))["notebooks"]
    assert sorted(r["notebook"] for r in rows) == ["01_a.ipynb", "02_b.ipynb"]


def test_a_profile_that_needs_gpus_is_skipped_with_its_reason(tmp_path, capsys, monkeypatch):
    from pipelab.planning import Machine

    monkeypatch.setattr(Machine, "detect", staticmethod(lambda: Machine()))
    needs = {"gpu": {"gpus": 4, "gpu_memory_gib": 80, "flops": 9.5e15, "estimate": "about 4 minutes on 4 x H100"}}
    nb = write_notebook(tmp_path / "01_big.ipynb", ["width = 8", "import pipelab\npipelab.headline('w', width)"],
                        {"pipelab": {"profiles": {"gpu": {"width": 4096}}, "needs": needs}})
    out = tmp_path / "out"
    assert cli.main(["run", nb, "--profile", "gpu", "--out", str(out)]) == cli.NOTHING_RAN  # nothing ran
    printed = capsys.readouterr().out
    assert "skipped" in printed and "the gpu profile needs 4 GPUs; this machine has 0" in printed
    (row,) = json.load(open(out / "summary.json"))["notebooks"]
    assert row["status"] == "skipped" and "this machine has 0" in row["note"]
    assert row["seconds"] == 0 and not (out / "01_big.ipynb").exists()  # nothing ran
    cli.main(["profiles", nb])
    listed = capsys.readouterr().out
    assert "needs 4 GPU(s) with 80 GiB each; 9,500.0 TFLOP; about 4 minutes on 4 x H100" in listed


COURSE = sorted(cli.course_notebooks(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")))


def test_every_gpu_profile_says_what_it_needs_and_lesson_10s_flops_are_counted():
    from pipelab.experiments import capstone

    for path in COURSE:
        if "gpu" in cli.notebook_profiles(path):
            needs = cli.profile_needs(path).get("gpu")
            assert needs is not None and needs.gpus >= 2 and needs.estimate, f"{path}: its gpu profile states no needs"
    lesson10 = next(p for p in COURSE if os.path.basename(p).startswith("10_"))
    gpu = cli.notebook_profiles(lesson10)["gpu"]
    counted = capstone.run_flops(gpu)  # the notebook's defaults where the profile says nothing
    assert cli.profile_needs(lesson10)["gpu"].flops == pytest.approx(counted, rel=1e-3)


def test_the_gpu_profiles_on_a_machine_without_gpus_skip_every_lesson_at_once(tmp_path, capsys, monkeypatch):
    from pipelab.planning import Machine

    monkeypatch.setattr(Machine, "detect", staticmethod(lambda: Machine()))
    start = time.monotonic()
    assert cli.main(["run", *COURSE, "--profile", "gpu", "--out", str(tmp_path)]) == cli.NOTHING_RAN
    assert time.monotonic() - start < 60  # nothing ran: GPU sizes never run on CPU
    rows = json.load(open(tmp_path / "summary.json"))["notebooks"]
    assert len(rows) == len(COURSE) and all(r["status"] == "skipped" and ("GPU" in r["note"]) for r in rows)
    assert "skipped" in capsys.readouterr().out
