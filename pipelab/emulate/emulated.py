"""What a lesson's `emulate=` can say: a node's name alone ("2xH100-nvlink"), or the node together
with the size its clock times the lesson's model at, `Emulated("2xH100-nvlink", width=8192)`.

A lesson's `Config` has this one field for emulation. The lesson declares its emulated size's
names and defaults (`Config.SIZE`); `size_of` merges what `emulate=` gives into them, refusing a
name the lesson does not have, so a typo fails before any process starts.
"""

from __future__ import annotations

from types import MappingProxyType, SimpleNamespace
from typing import Any, Mapping


class Emulated:
    """An emulated node (`node`, e.g. "2xH100-nvlink") and the size it times the lesson's model at
    (`size`: the lesson's own names, e.g. width=8192, dtype="bfloat16")."""

    __slots__ = ("node", "size")

    def __init__(self, node: Any, **size: Any) -> None:
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "size", MappingProxyType(dict(size)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Emulated is frozen: build a new one")

    def __str__(self) -> str:
        return str(self.node)

    def __repr__(self) -> str:
        sizes = "".join(f", {k}={v!r}" if not hasattr(v, "shape") else f", {k}=<{type(v).__name__}>"
                        for k, v in self.size.items())
        return f"Emulated({self.node!r}{sizes})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Emulated) and self.node == other.node and self.size.keys() == other.size.keys()
                and all(_same(self.size[k], other.size[k]) for k in self.size))

    def __hash__(self) -> int:
        return hash(str(self.node))

    def __reduce__(self):  # ranks receive it inside their Config
        return (_rebuild, (self.node, dict(self.size)))


def _same(a: Any, b: Any) -> bool:
    """Equal sizes: the same object, or equal plain values (a tensor or module compares by identity)."""
    if a is b:
        return True
    if hasattr(a, "shape") or hasattr(a, "parameters") or hasattr(b, "shape") or hasattr(b, "parameters"):
        return False
    return bool(a == b)


def _rebuild(node: Any, size: dict) -> Emulated:
    return Emulated(node, **size)


def node_name(emulate: Any) -> Any:
    """The node part of an `emulate=` value: the name (or `specs.Node`) itself; None for None."""
    return emulate.node if isinstance(emulate, Emulated) else emulate


def size_of(defaults: Mapping[str, Any], emulate: Any) -> SimpleNamespace:
    """The emulated size: the lesson's `defaults`, overridden by what `emulate` gives; a ValueError
    naming a size the lesson does not have, or a size given with no node to time it."""
    given = dict(emulate.size) if isinstance(emulate, Emulated) else {}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        have = ", ".join(defaults) or "none (this lesson times its own model as it is)"
        raise ValueError(f"emulate={emulate!r} gives {', '.join(unknown)}, which this lesson's emulated size "
                         f"does not have; its sizes: {have}")
    if given and node_name(emulate) is None:
        raise ValueError(f"emulate={emulate!r} gives a size but no node to time it on; name one, e.g. "
                         f"Emulated('2xH100-nvlink', {', '.join(f'{k}=...' for k in given)})")
    return SimpleNamespace(**{**defaults, **given})
