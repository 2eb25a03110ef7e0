"""What an emulated node is made of: accelerators (how fast they compute, how fast they read their
memory, how much memory they have) and the links between them (latency and bandwidth).

The devices and links themselves, every figure with its public source, are in `datasheets` (and
are used from here). A user adds their own device or link with `add_device` and `add_link`;
`parse_node("4xH100-nvlink")` turns a name into a `Node` (how many devices, which device, which
link joins them); `parse_node("8x:calibration.json")` a node of a GPU measured by `pipelab calibrate`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from pipelab.emulate.datasheets import (  # noqa: F401 - the tables and types, used from here
    DEVICE_ALIASES, DEVICES, DTYPE_NAMES, EFFICIENCY_FROM, GB, LINK_ALIASES, LINKS, TERA, Device, Link,
    dtype_name, torch_dtype,
)

KEY = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def _checked_key(kind: str, key: str, table: dict, replace: bool) -> str:
    key = str(key).lower()
    if not KEY.match(key):
        raise ValueError(f"{kind} name {key!r} must be lowercase letters, digits, '.', '_' or '-', e.g. 'mygpu'")
    if key in table and not replace:
        raise ValueError(f"{kind} {key!r} is already known ({table[key].name}); pass replace=True to redefine it")
    return key


def _positive(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be a number > 0, got {value!r}")


def add_device(key: str, device: Device, *, replace: bool = False) -> Device:
    """Make `device` known as `key` (so "2xKEY-pcie4" names a node of it). Every figure must be
    positive and have a source. Returns the device."""
    key = _checked_key("device", key, DEVICES, replace)
    if not device.flops:
        raise ValueError(f"device {device.name!r} needs at least one rate, e.g. flops={{'float32': 20e12}}")
    for dtype, rate in device.flops.items():
        dtype_name(dtype)
        _positive(f"{device.name}'s {dtype} FLOP/s", rate)
    _positive(f"{device.name}'s memory_bandwidth (bytes/s)", device.memory_bandwidth)
    _positive(f"{device.name}'s memory_bytes", device.memory_bytes)
    if not device.source.strip():
        raise ValueError(f"device {device.name!r} needs a source: where its figures come from "
                         "(a data sheet's title and URL)")
    for link in (device.nvlink, device.pcie):
        if link is not None and link not in LINKS:
            raise ValueError(f"device {device.name!r} names link {link!r}; known links: {sorted(LINKS)}")
    DEVICES[key] = Device(device.name, {dtype_name(k): float(v) for k, v in device.flops.items()},
                          device.memory_bandwidth, device.memory_bytes, device.source, device.nvlink,
                          device.pcie, device.notes, device.efficiency)
    return DEVICES[key]


def add_link(key: str, link: Link, *, replace: bool = False) -> Link:
    """Make `link` known as `key` (so "4xH100-KEY" names a node joined by it). Returns the link."""
    key = _checked_key("link", key, LINKS, replace)
    _positive(f"{link.name}'s bandwidth_Bps", link.bandwidth_Bps)
    if isinstance(link.latency_s, bool) or not isinstance(link.latency_s, (int, float)) or link.latency_s < 0:
        raise ValueError(f"{link.name}'s latency_s must be a number >= 0, got {link.latency_s!r}")
    if not link.source.strip():
        raise ValueError(f"link {link.name!r} needs a source: where its figures come from")
    LINKS[key] = link
    return link


def key_of(device: Device) -> str:
    """The key `device` is known by in DEVICES ("" if it is not there)."""
    for key, known in DEVICES.items():
        if known is device or known.name == device.name:
            return key
    return ""


def device_from_spec(spec: dict) -> Device:
    """A Device from a calibration spec (JSON): the data-sheet fields of `Device` (name, flops per
    dtype, memory_bandwidth, memory_bytes, source, optional nvlink/pcie/notes) and, where the spec
    was measured, `efficiency` = {"launch_s", "memory_fraction", "matmul": {dtype: [e_max,
    half_flops]}, "source"} as `calibrated.Efficiency` takes it. Checked as `add_device` checks."""
    fields = {k: spec[k] for k in ("name", "flops", "memory_bandwidth", "memory_bytes", "source") if k in spec}
    missing = {"name", "flops", "memory_bandwidth", "memory_bytes", "source"} - set(fields)
    if missing:
        raise ValueError(f"a device spec needs {sorted(missing)}; got keys {sorted(spec)}")
    efficiency = spec.get("efficiency")
    if efficiency is not None:
        for key in ("launch_s", "memory_fraction", "matmul"):
            if key not in efficiency:
                raise ValueError(f"a device spec's efficiency needs {key!r}; got {sorted(efficiency)}")
    device = Device(**fields, nvlink=spec.get("nvlink"), pcie=spec.get("pcie", "pcie4"),
                    notes=spec.get("notes", ""), efficiency=efficiency)
    return add_device(re.sub(r"[^a-z0-9_.-]", "-", device.name.lower()), device, replace=True)


def link_from_spec(spec: dict) -> Link:
    """A Link from a calibration spec: name, latency_s, bandwidth_Bps, source, and where it was
    measured `fabric` = the fields of `calibrated.Fabric` (per-step latencies, bus bandwidths)."""
    missing = {"name", "latency_s", "bandwidth_Bps", "source"} - set(spec)
    if missing:
        raise ValueError(f"a link spec needs {sorted(missing)}; got keys {sorted(spec)}")
    return Link(spec["name"], spec["latency_s"], spec["bandwidth_Bps"], spec["source"],
                spec.get("latency_source", ""), fabric=spec.get("fabric"))


# Readers of node names parse_node itself does not know ("8x:calibration.json"): each takes the
# name and returns a Node, or None when the name is not its kind. `pipelab.emulate.calibrate`
# registers its reader here.
NODE_READERS: list = []


# ---------------------------------------------------------------------------------------------
# Nodes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """`count` devices of one kind, every pair joined by `link` (as an NVSwitch or a network
    switch joins them: each device reaches each other at the link's full rate)."""
    count: int
    device: Device
    link: Link

    def __str__(self) -> str:
        return f"{self.count} x {self.device.name} over {self.link.name}"

    def to_json(self) -> str:
        """The node as JSON, so a process that never saw an `add_device` can rebuild it."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "Node":
        data = json.loads(text)
        return Node(data["count"], Device(**data["device"]), Link(**data["link"]))


def _known_names() -> str:
    devices = sorted(set(DEVICES) | set(DEVICE_ALIASES))
    links = sorted(set(LINKS) | set(LINK_ALIASES) | {"nvlink", "pcie"})
    return (f"known devices: {', '.join(devices)}; known links: {', '.join(links)} ('nvlink' and "
            f"'pcie' mean the device's own); e.g. '4xH100-nvlink', '2xA100-ib-ndr', '2xL4'")


def _device(name: str) -> Device | None:
    name = name.lower()
    return DEVICES.get(DEVICE_ALIASES.get(name, name))


def _link(name: str, device: Device) -> Link | None:
    name = name.lower()
    if name == "nvlink":
        return LINKS[device.nvlink] if device.nvlink else None
    if name == "pcie":
        return LINKS[device.pcie]
    return LINKS.get(LINK_ALIASES.get(name, name))


def _machines(machines: int, per_machine: int, rest: str) -> Node:
    """"2x8xH100" (or "2x8xH100-ib-ndr", "2x8xL4-100gbe"): machines of `per_machine` devices, each
    machine joined inside by the device's own link, the machines by a network (InfiniBand NDR
    unless named), one network card per device."""
    if machines < 1 or per_machine < 1:
        raise ValueError(f"cannot read node '{machines}x{per_machine}x{rest}': machines and devices per "
                         "machine must be >= 1, e.g. '2x8xH100'")
    device = _device(rest)
    net = LINKS["ib-ndr"]
    if device is None:
        one = parse_node(f"{per_machine}x{rest}")
        device, net = one.device, one.link
        if net.kind.startswith(("nvlink", "pcie")):
            raise ValueError(f"'{machines}x{per_machine}x{rest}': machines are joined by a network, not {net.name}; "
                             f"name one of ib-ndr, 100gbe (or leave it out for InfiniBand NDR), e.g. "
                             f"'{machines}x{per_machine}x{rest.split('-')[0]}-ib-ndr'")
    inner_key = device.nvlink or device.pcie
    inner = LINKS[inner_key]
    link = Link(f"{net.name} between machines of {per_machine} over {inner.name}", net.latency_s,
                net.bandwidth_Bps, f"{net.source}; inside a machine: {inner.source}", net.latency_source,
                kind=net.kind, per_node=per_machine, inner=inner_key, fabric=net.fabric)
    return Node(machines * per_machine, device, link)


def parse_node(text: "str | Node") -> Node:
    """"4xH100-nvlink" -> Node(4, the H100, NVLink 4). The link may be left out ("2xL4": the
    device's NVLink if it has one, else its PCIe). "2x8xH100" is two machines of eight H100s, NVLink
    inside each, InfiniBand NDR between them ("2x8xH100-100gbe" names the network). A name a
    registered reader knows (`NODE_READERS`, e.g. a calibration file) is read by it. A Node is
    returned as it is."""
    if isinstance(text, Node):
        return text
    for reader in NODE_READERS:
        node = reader(str(text))
        if node is not None:
            return node
    machines = re.fullmatch(r"\s*(\d+)\s*[x*]\s*(\d+)\s*[x*]\s*(\S+?)\s*", str(text), flags=re.IGNORECASE)
    if machines:
        return _machines(int(machines.group(1)), int(machines.group(2)), machines.group(3))
    match = re.fullmatch(r"\s*(\d+)\s*[x*]\s*(\S+?)\s*", str(text), flags=re.IGNORECASE)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"cannot read node {text!r}: write COUNTxDEVICE-LINK; {_known_names()}")
    count, rest = int(match.group(1)), match.group(2)
    device = _device(rest)
    if device is not None:  # no link named: the card's own
        return Node(count, device, LINKS[device.nvlink or device.pcie])
    # Device and link names may hold '-' themselves ("ib-ndr"): try every split.
    for at in [i for i, ch in enumerate(rest) if ch == "-"]:
        device = _device(rest[:at])
        if device is None:
            continue
        link = _link(rest[at + 1:], device)
        if link is None and rest[at + 1:].lower() == "nvlink":
            raise ValueError(f"{device.name} has no NVLink; use '{count}x{rest[:at]}-pcie' or a network link; "
                             f"{_known_names()}")
        if link is not None:
            return Node(count, device, link)
    raise ValueError(f"unknown device or link in node {text!r}; {_known_names()}")
