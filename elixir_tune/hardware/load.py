"""Whether the machine is busy with other work while the probe measures it. No torch.

A probe taken on a busy machine reads slow rates and long latencies (a quick probe beside other jobs on
a 2-core machine read a matmul rate 5x low and a collective latency 90x high) and a search then plans
with them. So the probe samples the machine before and after it measures (``sample_load``), while it
runs nothing itself, and judges the two samples with ``judge`` against three signals:

- **Other processes' CPU time** (``/proc/stat``, over ``SAMPLE_WINDOW_S`` while the probe sleeps): the
  probe spreads its threads over every core, so the cores others keep busy are taken from its rates.
  Loaded from ``BUSY_SHARE_LOADED`` (a quarter of the cores: rates up to 1/(1 - 0.25) = 1.33x slow,
  beyond the 10-20% a quick probe's figures move from run to run on an idle machine).
- **Stolen time** (``/proc/stat`` steal, from the sample before to the one after, the whole probe):
  time the hypervisor gave to other guests. Loaded from ``STEAL_SHARE_LOADED`` (5% of the CPU time).
- **Spread between repeats**: a fixed pure-Python reference loop (one core) timed ``REFERENCE_REPEATS``
  times in each sample. Loaded when its repeats spread (upper over lower quartile) beyond
  ``SPREAD_LOADED`` or its median moved by more than that between the two samples: on an idle core
  the same loop repeats within a few percent.

The 1-minute load average (``/proc/loadavg``) is recorded beside them but decides nothing: it lags a
minute behind the machine, and after the probe it counts the probe's own processes.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLE_WINDOW_S = 0.5
BUSY_SHARE_LOADED = 0.25
STEAL_SHARE_LOADED = 0.05
SPREAD_LOADED = 1.25
REFERENCE_REPEATS = 9
REFERENCE_LOOP = 50_000  # iterations of the reference loop: a few ms on one core


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU time of all the host's CPUs (``/proc/stat``'s ``cpu`` line), in clock ticks."""

    busy: int
    steal: int
    total: int


@dataclass(frozen=True)
class LoadSample:
    """The machine while the probe runs nothing.

    Attributes:
        load1: the 1-minute load average.
        busy_share: the share of all CPUs' time others spent busy during the window (0-1).
        cores: CPUs counted in ``/proc/stat``.
        reference_s: the reference loop's time per repeat.
        times: the CPU times at the end of the window (for the steal over the whole probe).
    """

    load1: float
    busy_share: float
    cores: int
    reference_s: list[float]
    times: CpuTimes

    @property
    def reference_spread(self) -> float:
        """Upper over lower quartile of the reference loop's repeats (1: identical repeats)."""
        q1, _, q3 = statistics.quantiles(self.reference_s, n=4)
        return q3 / q1 if q1 > 0 else 1.0


def read_cpu_times(stat_path: str = "/proc/stat") -> tuple[CpuTimes, int]:
    """All CPUs' cumulative times and the CPU count; zeros where ``/proc/stat`` cannot be read."""
    try:
        lines = Path(stat_path).read_text().splitlines()
    except OSError:
        return CpuTimes(0, 0, 0), os.cpu_count() or 1
    fields = [int(v) for v in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    fields += [0] * (8 - len(fields))
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    cores = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    busy = user + nice + system + irq + softirq
    return CpuTimes(busy=busy, steal=steal, total=busy + idle + iowait + steal), max(1, cores)


def read_load1(path: str = "/proc/loadavg") -> float:
    """The 1-minute load average (0 where it cannot be read)."""
    try:
        return float(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def _reference_s() -> float:
    begin = time.perf_counter()
    total = 0
    for i in range(REFERENCE_LOOP):
        total += i * i
    return time.perf_counter() - begin


def sample_load(window_s: float = SAMPLE_WINDOW_S) -> LoadSample:
    """Samples the machine: others' CPU time over ``window_s`` while this process sleeps, then the
    reference loop's repeats."""
    first, cores = read_cpu_times()
    time.sleep(window_s)
    last, _ = read_cpu_times()
    total = last.total - first.total
    busy_share = (last.busy - first.busy) / total if total > 0 else 0.0
    reference = [_reference_s() for _ in range(REFERENCE_REPEATS)]
    return LoadSample(read_load1(), max(0.0, min(1.0, busy_share)), cores, reference, read_cpu_times()[0])


def steal_share(before: LoadSample, after: LoadSample) -> float:
    """The stolen share of all CPU time from ``before`` to ``after``."""
    total = after.times.total - before.times.total
    return (after.times.steal - before.times.steal) / total if total > 0 else 0.0


def sample_reasons(sample: LoadSample, when: str) -> list[str]:
    """Why one sample is loaded (empty: it is not)."""
    reasons = []
    if sample.busy_share >= BUSY_SHARE_LOADED:
        reasons.append(
            f"{when}, other processes kept {sample.busy_share * sample.cores:.1f} of {sample.cores} cores busy "
            f"(loaded from {BUSY_SHARE_LOADED * sample.cores:.1f}; load average {sample.load1:.2f})"
        )
    if sample.reference_spread > SPREAD_LOADED:
        reasons.append(
            f"{when}, repeats of a fixed reference loop spread {sample.reference_spread:.2f}x "
            f"(loaded above {SPREAD_LOADED}x)"
        )
    return reasons


def judge(before: LoadSample, after: LoadSample) -> list[str]:
    """Why the probe between ``before`` and ``after`` ran on a loaded machine (empty: it did not)."""
    reasons = sample_reasons(before, "before the probe") + sample_reasons(after, "after it")
    stolen = steal_share(before, after)
    if stolen >= STEAL_SHARE_LOADED:
        reasons.append(f"the hypervisor stole {stolen:.0%} of the CPU time (loaded from {STEAL_SHARE_LOADED:.0%})")
    drift = statistics.median(after.reference_s) / statistics.median(before.reference_s)
    if max(drift, 1 / drift) > SPREAD_LOADED:
        reasons.append(f"the reference loop ran {drift:.2f}x as long after the probe as before it")
    return reasons


def load_record(before: LoadSample, after: LoadSample) -> dict[str, float]:
    """What a hardware file records of the load it was measured under (``HardwareSpec.probe_load``)."""
    drift = statistics.median(after.reference_s) / statistics.median(before.reference_s)
    return {
        "loaded": 1.0 if judge(before, after) else 0.0,
        "busy_cores_before": round(before.busy_share * before.cores, 3),
        "busy_cores_after": round(after.busy_share * after.cores, 3),
        "cores": float(before.cores),
        "load1_before": before.load1,
        "load1_after": after.load1,
        "steal_share": round(steal_share(before, after), 4),
        "reference_spread": round(max(before.reference_spread, after.reference_spread), 3),
        "reference_drift": round(drift, 3),
    }


def loaded_note(record: dict[str, float]) -> str:
    """One line on a hardware file measured under load ('' when it was not, or was not recorded)."""
    if not record or not record.get("loaded"):
        return ""
    return (
        f"it was measured on a loaded machine ({record.get('busy_cores_before', 0):.1f} and "
        f"{record.get('busy_cores_after', 0):.1f} of {record.get('cores', 0):.0f} cores busy with other work "
        f"before and after, steal {record.get('steal_share', 0):.0%}): its rates may read slow"
    )
