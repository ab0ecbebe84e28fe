"""Worker for the setup-memory test: a GPT-2 built on the meta device, its weights read from a Hugging Face
directory by ``setup(..., weights=DIR)``; reports the process's peak RSS during setup against its RSS before.

Each case: ``dir`` (written by transformers' ``save_pretrained``), ``chunk_size``, ``cache`` (cache blocks).
The peak is the kernel's high-water mark (``VmHWM``), reset just before setup (``/proc/self/clear_refs``: 5),
so the imports' and the model building's own peaks do not hide setup's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import elixir_tune
from tests.distributed.engine_launch import worker_main
from tests.distributed.engine_plans import make_plan


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_bytes() -> int:
    """The peak RSS since the last reset (``VmHWM`` of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_case(case: dict, index: int, rank: int, world: int, out_path: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(case["dir"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = make_plan(model, world, case["chunk_size"], cache=case["cache"])
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the RSS now
    before = rss_bytes()
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan, weights=case["dir"])
    peak = high_water_bytes()
    engine = model.engine
    return {
        "rss_before_bytes": before,
        "peak_bytes": peak,
        "master_bytes": sum(chunk.master.nbytes for chunk in engine.chunks),
        "resident_bytes": sum(chunk.chunk_size * 4 for chunk in engine.chunks if chunk.resident),
        "chunk_bytes": plan.memory.chunk_size * 4,
        "model_bytes": plan.model.num_params * 4,
        "chunks": len(engine.chunks),
    }


if __name__ == "__main__":
    worker_main(run_case)
