"""Colossal-AI's Gemini GPT-2 rows at the host-side rates Elixir's own search assumes: a sensitivity check.

The Gemini example's rows (examples/language/gpt/README.md @ d96cc37e) name their testbed: "8xA100 (80GB) and
1xAMD EPYC 7543 32-Core Processor (512 GB). GPUs are connected via PCI-e." They do not say how fast Adam runs
on that host, and the `a100-80gb-pcie` preset's host Adam rate (1.8e9 elements/s per node, DeepSpeed issue
#6834) is another machine's. The one host-side rate from the same authors found is in Elixir's search
(hpcaitech/ColossalAI, branch feature/elixir, colossalai/elixir/search/simulator.py @ 206280408, 2023-05-29):

    velocity_cpu(n) = 1.66 * ln(n) + 5.15        (used as 1 / velocity_cpu(n) beside bytes / GB/s, so read
    velocity_gpu(n) = 50 * n                      here as 1e9 elements/s with n ranks on the node)

The code states neither the machine it was fitted on nor its units, so these rates are NOT put in the table
or a preset: this prints what the pinned rows would predict with them, beside the table's figures. Host Adam
per rank is the preset's rule (``HardwareSpec.cpu_adam_rate_per_rank``): min(one process's rate, the node's
rate / ranks on the node), with velocity_cpu(1) as one process's rate and velocity_cpu(G) as the node's.
Nothing is fitted: the constants are Elixir's as written.

``--cpu-cache N`` pins the 'cpu' rows' cache at N gathered chunks instead of leaving it to the search:
CPUPlacementPolicy.evict_tensors moves every chunk not in the current op back to the host (colossalai/gemini/
placement_policy.py and gemini_mgr.py ``adjust_layout`` @ d96cc37e), so each use uploads its chunk again. How
many chunks an op holds depends on Gemini's own chunking, which the plan's does not reproduce, so the table
leaves the cache to the search and this shows what the pin would do.

    python scripts/published_gemini_host.py
    python scripts/published_gemini_host.py --cpu-cache 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import bench_published
from published_setups import PUBLISHED

from elixir_tune.hardware import load_hardware


def elixir_velocity_cpu(ranks_on_node: int) -> float:
    """Elixir's host Adam velocity with ``ranks_on_node`` ranks, read as elements/s (simulator.py @ 206280408)."""
    return (1.66 * math.log(ranks_on_node) + 5.15) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-cache", type=int, default=0, help="pin the 'cpu' rows' cache blocks (0: the search's)")
    args = parser.parse_args()
    for setup in PUBLISHED:
        if setup.source_key != "colossalai-gemini":
            continue
        if args.cpu_cache and "(Gemini cpu," in setup.name:
            setup = dataclasses.replace(setup, cache_blocks=args.cpu_cache)
        preset = load_hardware(setup.hardware)
        elixir = dataclasses.replace(
            preset,
            cpu_adam_elems_per_s=elixir_velocity_cpu(1),
            cpu_adam_node_elems_per_s=elixir_velocity_cpu(setup.gpus_per_node),
        )
        profile = bench_published.profile_of(setup)
        figures = []
        for label, spec in (("preset", preset), ("Elixir's rate", elixir)):
            result = bench_published.best_plan(
                profile, setup, bench_published.pinned_choices(setup), lift_memory=True, hardware=spec
            )
            if "error" in result:
                figures.append(f"{label}: no plan ({result['error']})")
                continue
            breakdown = result["breakdown"]
            ratio = result["tokens_per_s_per_gpu"] / setup.tokens_per_s_per_gpu
            figures.append(
                f"{label} {spec.cpu_adam_rate_per_rank(setup.gpus_per_node):.3g}/s per rank: step "
                f"{result['step_time_s']:.2f} s (host Adam exposed {breakdown.get('optimizer_exposed_s', 0):.2f} s, "
                f"fetches exposed {breakdown.get('exposed_fetch_s', 0):.2f} s), "
                f"ratio {ratio:.2f}"
            )
        print(f"{setup.name}: " + "; ".join(figures), flush=True)


if __name__ == "__main__":
    main()
