#!/usr/bin/env python
"""Peak memory per rank with and without LoRA for the same model at world 2: predicted vs measured (CPU, gloo).

    python scripts/bench_lora_memory.py
    python scripts/bench_lora_memory.py --out benchmarks/results/lora-memory.md

A Llama (hidden 256, 4 layers, vocabulary 2048, untied head) is written as a Hugging Face directory;
each case profiles it (``profile_model``, with ``lora`` for the LoRA cases: rank 8 on the q, k, v
and o projections), searches a plan at world 2 with the shape pinned (``--fix`` choices: chunk size,
offload, cache blocks), builds the model (wrapped by ``apply_lora``), sets it up and runs one
warm-up and one measured AdamW step in one launch of two processes
(tests/distributed/lora_worker.py, kind ``memory``). Measured as the engine's memory test measures
(tests/distributed/memory_probe.py): the live tensor storages at the step's start plus the
step's allocation peak. Predicted: the plan's device peak plus this rank's share of the node's
host peak (on a CPU device both are one pool).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from report_meta import generated, load_average, with_header, write_pair

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
SHAPES = [
    ("on device, cache all", {"chunk_size": 524288, "offload": 0.0, "cache_blocks": "all", "checkpointing": "none"}),
    ("half offloaded, cache 2", {"chunk_size": 524288, "offload": 0.5, "cache_blocks": 2, "checkpointing": "none"}),
]


def write_model(directory: Path) -> None:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", help="write the report here: PREFIX.md and PREFIX.json (e.g. benchmarks/results/lora-memory)"
    )
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=2)
    args = parser.parse_args()

    from tests.distributed.engine_launch import launch

    load_before = load_average()

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp, "llama")
        write_model(directory)
        cases = []
        for label, fixed in SHAPES:
            for lora in (None, LORA):
                cases.append(
                    dict(
                        kind="memory",
                        label=label,
                        dir=str(directory),
                        lora=lora,
                        fixed=fixed,
                        micro=args.micro,
                        seq=args.seq,
                    )
                )
        started = time.time()
        per_rank = launch("lora_worker.py", cases, world_size=2, timeout_s=1800)
        elapsed_s = time.time() - started
    rows, records = [], []
    for rank, results in enumerate(per_rank):
        for case, result in zip(cases, results, strict=True):
            if not result["ok"]:
                raise SystemExit(f"rank {rank} {case['label']}: {result['error']}\n{result['trace']}")
            measured = result["measured"]["peak_bytes"]
            predicted = result["predicted_gpu_bytes"] + result["predicted_host_bytes_per_rank"]
            states = result["model_state_bytes"]
            records.append(
                {
                    "shape": case["label"],
                    "lora": case["lora"],
                    "rank": rank,
                    "trainable": result["trainable"],
                    "chunks": result["chunks"],
                    "frozen_chunks": result["frozen_chunks"],
                    "offloaded": result["offloaded"],
                    "cache_blocks": result["cache_blocks"],
                    "shard_bytes": states["device_shard_bytes"] + states["host_shard_bytes"],
                    "measured_peak_bytes": measured,
                    "predicted_bytes": predicted,
                }
            )
            rows.append(
                "| {} | {} | {} | {:,} | {} ({} frozen, {} offloaded), cache {} | {} | {} | {} | {:.3f} |".format(
                    case["label"],
                    "LoRA r8 q,k,v,o" if case["lora"] else "full",
                    rank,
                    result["trainable"],
                    result["chunks"],
                    result["frozen_chunks"],
                    result["offloaded"],
                    result["cache_blocks"],
                    mib(states["device_shard_bytes"] + states["host_shard_bytes"]),
                    mib(measured),
                    mib(predicted),
                    predicted / measured,
                )
            )
    params = per_rank[0][0]["params"]
    lines = [
        f"# LoRA memory: predicted vs measured peak per rank, Llama {params:,} params, world 2 (CPU, gloo)",
        "",
        f"Command: `python scripts/bench_lora_memory.py --out benchmarks/results/lora-memory`; "
        f"micro-batch {args.micro} x {args.seq} tokens, fp32, AdamW, chunk size 524,288 elements, torch "
        f"{__import__('torch').__version__} CPU, {os.cpu_count()} cores (shared), run took {elapsed_s:.0f} s.",
        "",
        "| shape | training | rank | trainable params | chunks | shard bytes MiB (master+grad+Adam or frozen weights) | "
        "measured peak MiB | predicted MiB | predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "measured: live tensor storages at the step's start + the step's allocation peak "
        "(tests/distributed/memory_probe.py). predicted: the plan's peak_gpu_bytes + this rank's share of "
        "peak_host_bytes (one pool on a CPU device). The margin the search keeps free is not in either.",
        "",
        "Shard bytes per rank: a trainable chunk costs 16 bytes per element of its shard (fp32 master, gradient, "
        "AdamW moments), a frozen one 4 (its fp32 weights, nothing else). The LoRA rows hold one trainable chunk "
        "(57,344 adapter elements, padded to the pinned chunk size) and 7 frozen ones.",
    ]
    command = " ".join(["python scripts/bench_lora_memory.py"] + sys.argv[1:])
    report = {
        "generated": generated(load_before, command),
        "params": params,
        "micro_batch": args.micro,
        "seq": args.seq,
        "elapsed_s": round(elapsed_s, 1),
        "rows": records,
    }
    text = with_header("\n".join(lines) + "\n", report["generated"])
    print(text)
    if args.out:
        write_pair(Path(args.out).with_suffix(""), report, text)


if __name__ == "__main__":
    main()
