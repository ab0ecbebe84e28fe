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


def predictions(models: list[str], micro: int, seq: int) -> dict[tuple, int]:
    """The cost model's activation bytes per rank for every configuration: the profile of the same
    model (traced on the meta device at ``micro`` x ``seq``) seen by one tensor rank
    (``costmodel/stage_profile.py`` ``rank_profile``), its activation line at ``micro``."""
    import torch

    from elixir_tune.costmodel.model import CostModel
    from elixir_tune.costmodel.parallel import Layout
    from elixir_tune.hardware import load_hardware
    from elixir_tune.profiler import profile_model
    from elixir_tune.profiler.source import ModelSource
    from tests.distributed.tp_activation_worker import build

    def batch(size: int, length: int) -> dict:
        ids = torch.zeros(size, length, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    hardware = load_hardware("cpu")
    out = {}
    for name in models:
        case = {"model": name, "seq": seq}
        source = ModelSource(name=name, source=name, _build=lambda case=case: build(case), _batch=batch)
        profile = profile_model(source, batch_size=micro, seq_len=seq)
        for config in CONFIGS:
            layout = Layout(
                tensor=config["tensor"], tensor_mode=config.get("mode", "1d"), sequence_parallel=config.get("sp", True)
            )
            model = CostModel(profile, hardware, gpus_per_node=4, layout=layout)
            key = (name, config["tensor"], config.get("mode", "-"), config.get("sp", "-"))
            out[key] = int(model.profile.activation.at(micro))
    return out


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
        "Predicted: the cost model's activation memory per rank (the profile's activation line, seen by one",
        "tensor rank: the blocks 1/T for 1D with sequence parallelism and 2D, (10 + 24/T)/34 for 1D without it; logits whole).",
        "",
        "| model | T | mode | SP | activations saved (MiB) | step peak (MiB) | predicted (MiB) | peak / predicted "
        "| TP collectives fwd+bwd (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    predicted = {tuple(key): value for key, value in result.get("predicted", [])}
    for row in result["rows"]:
        moved = max(
            sum(fwd.values()) + sum(bwd.values())
            for fwd, bwd in zip(row["forward_collective_bytes"], row["backward_collective_bytes"], strict=True)
        )
        peak = max(row["step_peak_bytes"])
        guess = predicted.get((row["model"], row["tensor"], row["mode"], row["sp"]))
        versus = f"{guess / 2**20:.3f} | {peak / guess:.2f}" if guess else "- | -"
        lines.append(
            f"| {row['model']} | {row['tensor']} | {row['mode']} | {row['sp']} | {max(row['saved_bytes']) / 2**20:.3f} "
            f"| {peak / 2**20:.3f} | {versus} | {moved / 2**20:.3f} |"
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
    parser.add_argument(
        "--render-only", action="store_true", help="add the predictions to --out's measured JSON and rewrite its .md"
    )
    args = parser.parse_args()
    models = args.models.split(",")
    if args.render_only:
        result = json.loads(args.out.read_text())
        saved = result["args"]
        result["predicted"] = [[list(k), v] for k, v in predictions(models, saved["micro"], saved["seq"]).items()]
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result))
        return
    rows = []
    for model in models:
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
        result["predicted"] = [[list(k), v] for k, v in predictions(models, args.micro, args.seq).items()]
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
