#!/usr/bin/env python
"""Wall time and peak memory of `elixir-tune profile` on the largest models.

Each model is profiled in a fresh process (so peak RSS is its own): batch 8, seq 1024, fp16,
checkpointing all (both traces recorded), profile written to a temporary file.

    .venv/bin/python scripts/bench_profile.py                 # gpt2-20b and opt-175b
    .venv/bin/python scripts/bench_profile.py gpt2-4b --json bench.json

Targets (2-core CPU): gpt2-20b under 20 s, opt-175b under 60 s, peak memory under 4 GiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = {"gpt2-20b": 20.0, "opt-175b": 60.0}
TARGET_PEAK_GIB = 4.0


def measure_one(model: str, batch_size: int, seq_len: int) -> dict:
    """Profiles one model in this process and returns its figures."""
    start = time.perf_counter()
    from elixir_tune.profiler import profile_model, save_profile

    imported = time.perf_counter()
    profile = profile_model(model, batch_size=batch_size, seq_len=seq_len, dtype="fp16", checkpointing="all")
    profiled = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        save_profile(profile, Path(tmp) / "profile.yaml")
    saved = time.perf_counter()
    return {
        "model": model,
        "num_params": profile.num_params,
        "import_s": round(imported - start, 2),
        "profile_s": round(profiled - imported, 2),
        "save_s": round(saved - profiled, 2),
        "total_s": round(saved - start, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "trace_steps": len(profile.trace),
        "trace_checkpointed_steps": len(profile.trace_checkpointed),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(TARGET_S))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child mode: measure this model, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.batch_size, args.seq_len)))
        return 0

    rows = []
    print(
        f"{'model':<10} {'params':>16} {'import s':>9} {'profile s':>10} {'save s':>7} {'total s':>8} {'peak GiB':>9}  target"
    )
    for model in args.models:
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                model,
                "--batch-size",
                str(args.batch_size),
                "--seq-len",
                str(args.seq_len),
            ],
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            print(f"{model}: failed\n{child.stderr[-2000:]}")
            return 1
        row = json.loads(child.stdout.strip().splitlines()[-1])
        target = TARGET_S.get(model)
        ok = (target is None or row["total_s"] < target) and row["peak_rss_gib"] < TARGET_PEAK_GIB
        verdict = f"< {target:.0f} s, < {TARGET_PEAK_GIB:.0f} GiB: {'ok' if ok else 'MISSED'}" if target else ""
        print(
            f"{model:<10} {row['num_params']:>16,} {row['import_s']:>9.2f} {row['profile_s']:>10.2f} "
            f"{row['save_s']:>7.2f} {row['total_s']:>8.2f} {row['peak_rss_gib']:>9.3f}  {verdict}"
        )
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
