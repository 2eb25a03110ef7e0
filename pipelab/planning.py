"""What `pipelab run` will do with each notebook on this machine, decided before anything runs.

A notebook's profile (metadata["pipelab"]["profiles"][NAME]) sets its parameters; its needs
(metadata["pipelab"]["needs"][NAME]) say how many GPUs the profile asks for. Where the machine has
them, the profile runs as it is. Where it has exactly one GPU and the profile asks for more, the
lesson still runs (one GPU is a GPU node too): with its default sizes, the parts one GPU runs for
real (a profile's `"cuda"` device choice: lessons 02-04's two devices as streams of this GPU,
lesson 08's layer profile, lesson 10's one-process baseline) measured on this GPU, and the rest on
its emulated node made of the GPU this machine has, calibrated by `pipelab calibrate`
(`emulate="8x:FILE"`, modelled time). Without GPUs, a profile that needs them is skipped (GPU
sizes never run on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The parameters in which a lesson names its emulated node ("auto", a node name, or None).
EMULATE_PARAMETERS = ("emulate", "grid_emulate")
# A one-GPU machine's emulated node: eight of its GPU, as many as any lesson's ranks.
ONE_GPU_NODE_SIZE = 8


class PlanError(ValueError):
    """A chosen notebook cannot be planned as asked (reported before any notebook runs)."""


@dataclass(frozen=True)
class Machine:
    """What the planner knows of a machine: its GPUs' names and memory (GiB). A test can describe one."""

    gpus: tuple[str, ...] = ()
    gpu_memory_gib: tuple[float, ...] = ()

    @staticmethod
    def detect() -> "Machine":
        """This machine's CUDA GPUs, as torch sees them."""
        import torch

        if not torch.cuda.is_available():
            return Machine()
        count = torch.cuda.device_count()
        return Machine(tuple(torch.cuda.get_device_name(i) for i in range(count)),
                       tuple(torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(count)))


@dataclass(frozen=True)
class Needs:
    """What a profile needs from the machine (metadata["pipelab"]["needs"][profile]), and what it
    costs there: `estimate` says how long on which node, from the FLOP count in `flops`."""

    gpus: int = 0
    gpu_memory_gib: float = 0.0
    flops: float = 0.0  # the profile's whole run, counted (see the notebook's comment on it)
    estimate: str = ""
    one_gpu_steps: str = ""  # what runs on a GPU whenever there is one, untimed (e.g. one-process checks)

    def __str__(self) -> str:
        parts = [f"{self.gpus} GPU(s)" + (f" with {self.gpu_memory_gib:g} GiB each" if self.gpu_memory_gib else "")]
        if self.flops:
            parts.append(f"{self.flops / 1e12:,.1f} TFLOP")
        if self.estimate:
            parts.append(self.estimate)
        return "needs " + "; ".join(parts)


@dataclass
class Planned:
    """One notebook of a batch, with the parameters it will get."""

    path: str
    parameters: dict
    note: str = ""  # said when it starts, e.g. that it has no such profile, or how it runs on one GPU
    skip: str = ""  # why it does not run at all, e.g. its profile needs GPUs this machine lacks
    calibration: str = ""  # the calibration file its emulated node is made from (one-GPU runs)
    real: dict = field(default_factory=dict)  # the parameters that put a part on this GPU for real


def unmet(needs: Needs, machine: Machine, profile: str = "gpu") -> str:
    """Why `machine` cannot run a profile with `needs` ('' if it can), in one short line."""
    have = len(machine.gpus)
    if have < needs.gpus:
        return f"the {profile} profile needs {needs.gpus} GPUs; this machine has {have} (GPU sizes never run on CPU)"
    # A card sold as 80 GB shows CUDA 79.6 GiB (85.5e9 bytes): a need is met within 5 %.
    if needs.gpu_memory_gib and machine.gpus and min(machine.gpu_memory_gib) < 0.95 * needs.gpu_memory_gib:
        return (f"the {profile} profile needs {needs.gpu_memory_gib:g} GiB per GPU; this machine's smallest "
                f"has {min(machine.gpu_memory_gib):.0f} GiB")
    return ""


# What a device parameter set to "cuda" by a profile puts on this GPU for real (measured there).
REAL_PARTS = {"device": "the lesson's two devices as two sets of CUDA streams of this GPU, sharing its SMs",
              "profile_device": "AlexNet's layer profile",
              "baseline_device": "the one-process baseline's tokens/s"}
# A "cuda" value for one of these runs the lesson's own devices on this GPU: no emulated node then.
OWN_DEVICES = ("device",)


def one_gpu_plan(path: str, declared: dict, profile_params: dict, machine: Machine, calibration: str,
                 needs: Needs) -> Planned:
    """The lesson on a one-GPU machine: its defaults, the profile's device choices that put a part
    on the GPU ("cuda") for real, and its emulated node calibrated on this GPU for the rest; the
    note says which part is measured on this GPU and which is modelled."""
    real = {name: value for name, value in profile_params.items() if value == "cuda" and name in declared}
    own = any(name in OWN_DEVICES for name in real)
    node = f"{ONE_GPU_NODE_SIZE}x:{calibration}"
    params = {} if own else {name: node for name in EMULATE_PARAMETERS if name in declared}
    emulated = bool(params)
    params.update(real)
    said = [f"one GPU ({machine.gpus[0]}) where the profile asks for {needs.gpus}: the defaults' sizes"]
    if emulated:
        said.append(f"modelled: its emulated node, {ONE_GPU_NODE_SIZE} x this GPU as calibrated in {calibration} "
                    "(modelled time)")
    elif own:
        said.append("no emulated node: its devices are this GPU's streams (-p device auto: the emulated node instead)")
    else:
        said.append("no emulated node in this lesson (its ranks run on this machine's CPU cores, measured)")
    said.append("measured on this GPU: " + ("; ".join(f"{REAL_PARTS.get(k, k)} ({k}={v!r})" for k, v in real.items())
                                            if real else "nothing"))
    if needs.one_gpu_steps:
        said.append(f"run on this GPU, not timed: {needs.one_gpu_steps}")
    return Planned(path, params, "; ".join(said), calibration=calibration if emulated else "", real=real)


def parse_value(text: str):
    """A command-line parameter value, read as papermill's `-p` reads it."""
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def check_value(path: str, name: str, value, default: str) -> None:
    """Refuse a `-p NAME VALUE` whose kind the parameters cell's default rules out (a fraction for
    a whole number, text for a number), naming the parameter and the value the user gave."""
    if value is None:
        return
    expected = parse_value(default.strip())
    whole = isinstance(expected, int) and not isinstance(expected, bool)
    if whole and not (isinstance(value, int) and not isinstance(value, bool)):
        raise PlanError(f"-p {name} {value!r}: {path} declares {name} = {default.strip()}, a whole number; "
                        f"give one, e.g. -p {name} {expected}")
    if isinstance(expected, float) and not isinstance(value, (int, float)) or \
            isinstance(expected, bool) and not isinstance(value, bool):
        raise PlanError(f"-p {name} {value!r}: {path} declares {name} = {default.strip()}; give a value of "
                        f"that kind, e.g. -p {name} {default.strip()}")


def plan_one(path: str, declared: dict, profiles: dict, needs: dict[str, Needs], given: dict,
             profile: str | None, machine: Machine, calibration: str) -> Planned:
    """One notebook's plan: the profile's parameters (or the one-GPU plan, or a skip), then the `-p`s."""
    params, note, plan = {}, "", None
    if profile is not None:
        if profile in profiles:
            params = dict(profiles[profile])
            unknown = sorted(set(params) - set(declared))
            if unknown:
                raise PlanError(f"{path}: profile {profile!r} sets {', '.join(unknown)}, which its "
                                f"parameters cell does not declare ({', '.join(declared) or 'none'})")
            need = needs.get(profile)
            why = unmet(need, machine, profile) if need is not None else ""
            if why and len(machine.gpus) == 1 and need.gpus > 1:
                plan = one_gpu_plan(path, declared, params, machine, calibration, need)
            elif why:
                plan = Planned(path, {}, skip=why)
        elif profile == "gpu" and not machine.gpus:  # without a GPU, a GPU batch run runs nothing
            plan = Planned(path, {}, skip="no gpu profile and this machine has 0 GPUs: it runs on CPU cores; run it without --profile")
        else:
            note = f"no profile {profile!r} (has: {', '.join(profiles) or 'none'}); running with its defaults"
    plan = plan or Planned(path, params, note)
    for name, value in given.items():
        if name in declared:
            check_value(path, name, value, declared[name])
            if plan.calibration and name in EMULATE_PARAMETERS:
                plan.note += f"; -p {name} {value!r} replaces the calibrated node"
            plan.parameters[name] = value
    if plan.calibration and not any(str(v).endswith(f":{plan.calibration}") for v in plan.parameters.values()):
        plan.calibration = ""  # every emulated node replaced: nothing to calibrate for it
    return plan


def declared_parameters(path: str) -> dict:
    """The names the notebook's `parameters` cell assigns, with their default values (as text)."""
    import papermill as pm

    return {name: p["default"] for name, p in pm.inspect_notebook(path).items()}


def notebook_profiles(path: str) -> dict[str, dict]:
    """The notebook's profiles: metadata["pipelab"]["profiles"], name -> parameters."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    profiles = nb.metadata.get("pipelab", {}).get("profiles", {})
    return {name: dict(params) for name, params in profiles.items()}


def profile_needs(path: str) -> dict[str, Needs]:
    """Each profile's needs, from the notebook's metadata["pipelab"]["needs"]."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    needs = nb.metadata.get("pipelab", {}).get("needs", {})
    return {name: Needs(**dict(n)) for name, n in needs.items()}


def plan_runs(notebooks: list[str], given: dict, profile: str | None, machine: Machine | None = None,
              calibration: str | None = None) -> list[Planned]:
    """Each notebook's parameters: its profile (if asked for), then each `-p` it declares.

    `machine` (default: this one) decides which profiles run, which run on one GPU with the emulated
    node calibrated in `calibration` (default: calibrate.default_path()), which are skipped.
    Raises PlanError for a `-p` that no notebook declares or whose kind its default rules out, a
    profile that no notebook has, or a profile setting a parameter its notebook does not declare."""
    plans, used, profiled = [], set(), False
    if profile is not None and machine is None:
        machine = Machine.detect()
    if calibration is None:
        from pipelab.emulate.calibrate import default_path

        calibration = default_path()
    for path in notebooks:
        if not given and profile is None:
            plans.append(Planned(path, {}))
            continue
        declared, profiles = _read_parameters(path)
        profiled = profiled or (profile in profiles)
        needs = _read_needs(path) if profile in profiles else {}
        plans.append(plan_one(path, declared, profiles, needs, given, profile, machine or Machine(), calibration))
        used.update(name for name in given if name in declared)
    unused = [name for name in given if name not in used]
    if unused:
        raise PlanError(f"no chosen notebook declares parameter {', '.join(unused)} in its parameters cell "
                         "(see `pipelab profiles` and the notebooks' parameters cells)")
    if profile is not None and not profiled:
        raise PlanError(f"no chosen notebook has a profile {profile!r} (see `pipelab profiles`)")
    return plans


def _read_needs(path: str) -> dict[str, Needs]:
    try:
        return profile_needs(path)
    except (TypeError, ValueError) as e:
        raise PlanError(f"{path}: its metadata's pipelab.needs is not understood: {e}") from e


def _read_parameters(path: str) -> tuple[dict, dict]:
    try:
        return declared_parameters(path), notebook_profiles(path)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook is a usage error here
        raise PlanError(f"cannot read the parameters of {path}: {e}") from e
