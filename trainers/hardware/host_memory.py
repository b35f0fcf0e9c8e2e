"""How much host memory (RAM) this process can still take, for choosing what the trainer keeps there.

The kernel's MemAvailable (/proc/meminfo) estimates what can be allocated without swapping: free
memory plus the page cache and other memory it can reclaim. In a container the cgroup limit may be
lower; there the room is the limit minus the group's usage, not counting inactive file pages (page
cache the kernel reclaims before it kills anything), at every level of the group's path. Without
either, total RAM is all that is known.

Allocating more than this does not fail cleanly on Linux: allocations succeed (overcommit) and the
kernel's out-of-memory killer ends the process with SIGKILL when the pages are touched. Hence
the check before large host buffers are taken.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GiB = 2 ** 30
_UNLIMITED = 2 ** 60  # cgroup v1 reports "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class HostMemory:
    available: int  # bytes this process may still allocate
    total: int  # RAM of the machine (or the container's limit when lower), bytes
    source: str  # where `available` comes from, for messages

    def describe(self) -> str:
        return f"{self.available / GiB:.1f} GiB available ({self.source}) of {self.total / GiB:.1f} GiB"


def total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def host_memory(root: Path = Path("/")) -> HostMemory | None:
    """What this process may still allocate; None when not even total RAM is known.

    `root` is where /proc and /sys are found (tests point it at a fake tree)."""
    info = _meminfo(root / "proc" / "meminfo")
    total = info.get("MemTotal") or total_ram_bytes()
    found = [(info["MemAvailable"], "MemAvailable")] if "MemAvailable" in info else []
    for limit, room, name in _cgroup_limits(root):
        total = min(total, limit) if total else limit
        found.append((room, name))
    if found:
        available, source = min(found)
        return HostMemory(max(0, available), total, source)
    return HostMemory(total, total, "total RAM") if total else None


def _text(path: Path, encoding: str = "ascii") -> str:
    """A file of /proc or /sys; "" where it cannot be read (absent: no such limit here)."""
    try:
        return path.read_text(encoding=encoding)
    except (OSError, UnicodeDecodeError):
        return ""


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    for line in _text(path).splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


# (limit file, usage file, key of the inactive file pages in memory.stat) of cgroup v2 and v1.
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _cgroup_limits(root: Path) -> list[tuple[int, int, str]]:
    """(limit, limit - usage not counting inactive file pages, name) of each memory limit on this process:
    its own memory cgroup (v2 or v1) and every parent of it, whose limits bind too."""
    base = root / "sys" / "fs" / "cgroup"
    v2, v1 = _own_cgroups(root)
    found = []
    for folder, relative, (limit_file, usage_file, inactive_key) in ((base, v2, _V2), (base / "memory", v1, _V1)):
        parts = [p for p in relative.split("/") if p and p != ".."]
        for group in (folder.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)):
            limit, usage = _read_int(group / limit_file), _read_int(group / usage_file)
            if limit is not None and usage is not None and limit < _UNLIMITED:
                room = limit - max(0, usage - _stat_value(group / "memory.stat", inactive_key))
                found.append((limit, room, f"cgroup limit {limit / GiB:.1f} GiB"))
    return found


def _own_cgroups(root: Path) -> tuple[str, str]:
    """This process's cgroup v2 path and cgroup v1 memory-controller path ("" when unknown)."""
    v2 = v1 = ""
    for line in _text(root / "proc" / "self" / "cgroup", "utf-8").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            v2 = path.strip()
        elif "memory" in controllers.split(","):
            v1 = path.strip()
    return v2, v1


def _read_int(path: Path) -> int | None:
    """An integer file; None when missing or "max" (no limit)."""
    text = _text(path).strip()
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    for line in _text(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
