#!/usr/bin/env python
"""Activation memory per rank under tensor parallelism, measured on the CPU (gloo, 4 processes).

    python scripts/measure_tp_activations.py                       # GPT-2 and Llama (GQA), T = 1, 2, 4
    python scripts/measure_tp_activations.py --out benchmarks/results/tp-activations-cpu.json

Each configuration runs in one launch of ``--world`` processes (data x tensor) with the same
micro-batch per tensor group (``--micro`` samples of ``--seq`` tokens): tensor 1 (data only), 1D
tensor 2 with and without sequence parallelism, 1D tensor 4, and 2D 2 x 2 when the engine has it.
Per rank it reports the bytes autograd saves for backward in one forward (activations, parameter
storages left out), the measured step's allocation peak (tests/distributed/memory_probe.py) and
the bytes moved by the tensor-parallel collectives of one forward and backward (ring volumes).
Models (tests/distributed/tp_activation_worker.py): GPT-2 and Llama, hidden 128, 8 heads (Llama: 4
key/value heads), 2 layers, vocabulary 512, eager attention, fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = [
    dict(tensor=1),
    dict(tensor=2, mode="1d", sp=False),
    dict(tensor=2, mode="1d", sp=True),
    dict(tensor=4, mode="1d", sp=False),
    dict(tensor=4, mode="1d", sp=True),
    dict(tensor=4, mode="2d"),
]


def markdown(result: dict) -> str:
    """The rows as a table (MiB, the largest rank of each configuration)."""
    args = result["args"]
    lines = [
        "# Activation memory and tensor-parallel traffic per rank (CPU)",
        "",
        f"`python scripts/measure_tp_activations.py --out {args['out']}`; load average "
        f"{', '.join(f'{x:.1f}' for x in result['load'])} (1, 5, 15 min) at the end; world {args['world']}, "
        f"micro-batch {args['micro']} x seq {args['seq']} per tensor group.",
        "",
        "| model | T | mode | SP | activations saved (MiB) | step peak (MiB) | TP collectives fwd+bwd (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        moved = max(
            sum(fwd.values()) + sum(bwd.values())
            for fwd, bwd in zip(row["forward_collective_bytes"], row["backward_collective_bytes"], strict=True)
        )
        lines.append(
            f"| {row['model']} | {row['tensor']} | {row['mode']} | {row['sp']} | {max(row['saved_bytes']) / 2**20:.3f} "
            f"| {max(row['step_peak_bytes']) / 2**20:.3f} | {moved / 2**20:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    from tests.distributed.engine_launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--modes", default="1d,2d", help="tensor modes to measure (2d needs the engine's 2d mode)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        for config in CONFIGS:
            if config.get("mode", "1d") not in args.modes.split(","):
                continue
            case = dict(config, model=model, micro=args.micro, seq=args.seq)
            per_rank = launch("tp_activation_worker.py", [case], args.world, timeout_s=600)
            results = [ranks[0] for ranks in per_rank]
            failed = [r for r in results if not r["ok"]]
            if failed:
                print(f"{case}: failed: {failed[0]['error']}", file=sys.stderr)
                continue
            row = {
                "model": model,
                "tensor": config["tensor"],
                "mode": config.get("mode", "-"),
                "sp": config.get("sp", "-"),
                "saved_bytes": [r["saved_bytes"] for r in results],
                "step_peak_bytes": [r["step_peak_bytes"] for r in results],
                "live_bytes": [r["live_bytes"] for r in results],
                "forward_collective_bytes": [r["forward_collective_bytes"] for r in results],
                "backward_collective_bytes": [r["backward_collective_bytes"] for r in results],
            }
            moved = max(sum(r["forward_collective_bytes"].values()) + sum(r["backward_collective_bytes"].values())
                        for r in results)  # fmt: skip
            rows.append(row)
            print(
                f"{model:6} T={row['tensor']} mode={row['mode']:2} sp={row['sp']!s:5} "
                f"activations/rank {max(row['saved_bytes']) / 2**20:7.3f} MiB  "
                f"step peak/rank {max(row['step_peak_bytes']) / 2**20:7.3f} MiB  "
                f"TP collectives/rank (fwd+bwd) {moved / 2**20:7.3f} MiB",
                flush=True,
            )
    if args.out:
        load = os.getloadavg()
        result = {"args": vars(args) | {"out": str(args.out)}, "load": load, "rows": rows}
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
