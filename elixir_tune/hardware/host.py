"""Facts about the host read from the OS: CPU name, cores, RAM, network links. No torch."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo ("model name"), or the platform's name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def host_cores() -> int:
    """Logical CPUs this process may run on (cgroup/affinity aware where the OS says)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def _cgroup_cpu_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _meminfo_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def host_memory_bytes() -> int:
    """Host RAM this process can use: MemTotal, or the cgroup limit when that is smaller."""
    total = _meminfo_bytes("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
    limit = _cgroup_memory_limit()
    return min(total, limit) if limit else total


def host_available_bytes() -> int:
    """Host RAM free for new allocations now (MemAvailable, capped by the cgroup limit)."""
    available = _meminfo_bytes("MemAvailable") or host_memory_bytes()
    return min(available, host_memory_bytes())


def network_gbps() -> tuple[float, str]:
    """Aggregate bandwidth of the node's fast network links, in GB/s, and how it was found.

    InfiniBand/RoCE ports (/sys/class/infiniband/*/ports/*/rate) are summed; without them the
    fastest Ethernet interface counts. Returns (0.0, reason) when nothing can be read.
    """
    total_gbit, ports = 0.0, 0
    for rate_file in Path("/sys/class/infiniband").glob("*/ports/*/rate"):
        try:
            total_gbit += float(rate_file.read_text().split()[0])
            ports += 1
        except (OSError, ValueError, IndexError):
            continue
    if ports:
        return total_gbit / 8, f"{ports} InfiniBand/RoCE port(s), {total_gbit:.0f} Gb/s in all"
    best_mbit = 0
    for speed_file in Path("/sys/class/net").glob("*/speed"):
        if speed_file.parent.name == "lo":
            continue
        try:
            best_mbit = max(best_mbit, int(speed_file.read_text().strip()))
        except (OSError, ValueError):
            continue
    if best_mbit > 0:
        return best_mbit / 8000, f"fastest Ethernet link {best_mbit} Mb/s"
    return 0.0, "no link speed readable"
