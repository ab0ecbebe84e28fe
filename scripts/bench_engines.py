"""Our engine beside plain PyTorch, DDP, FSDP2 and DeepSpeed ZeRO-3 on this CPU (world 2, gloo, fp32).

For GPT-2 models of about 10M, 50M and 150M parameters (seq 128, global batch 4): step time and peak
resident memory per rank of

* plain PyTorch in one process (``scripts/peers/torch_step.py``), DDP over 2 processes (same script);
* FSDP2 with and without ``CPUOffloadPolicy`` and DeepSpeed ZeRO-3, each through its plan runner
  (``elixir-run`` of a plan whose ``engine`` section names it: the search's peer plan at our plan's
  micro-batch and checkpointing); skipped with the reason while this elixir-tune has no runner for
  it (``measure.plans.runner_missing``);
* our engine on the search's plan and on a fully sharded pin (the smallest cache the search allows).

All runs of one size in interleaved rounds (each round runs every system once), each a fresh set of
processes; a system's figure is the median step after each run's first. Beside each, the cost model's
prediction: ours from the plan, the peers' from ``costmodel/peers.py``; plain PyTorch and DDP priced
as ZeRO-1 (the same bytes on the wire: an all-reduce is a reduce-scatter and an all-gather) at world 1
and 2. Memory: rank 0's peak RSS for plan runs (the recipes' log), the largest over ranks for the torch
baselines. Writes benchmarks/results/engines-cpu.md and .json. Stops starting runs at ``--budget``.

    python scripts/bench_engines.py                       # all sizes, 1 round, < 10 min on 2 cores
    python scripts/bench_engines.py --sizes 10m,50m --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PY = sys.executable
RESULTS = REPO / "benchmarks" / "results"
SEQ_LEN = 128
GLOBAL_BATCH = 4
WORLD = 2
# n_embd, n_layer, n_head, vocab: GPT-2 shapes near the sizes named (12 L h^2 + V h parameters).
SIZES = {
    "10m": (384, 4, 6, 8192),
    "50m": (512, 10, 8, 32768),
    "150m": (768, 16, 12, 50257),
}


@dataclasses.dataclass
class System:
    """One system of one size: how to run it and what is predicted."""

    name: str
    command: list[str]
    record: Path
    kind: str  # "torch" (common.py's record) or "plan" (a recipe's log)
    predicted_step_s: float | None
    predicted_peak_bytes: int | None
    skip: str | None = None
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: int = 0
    failure: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10m,50m,150m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--budget", type=float, default=570.0, help="seconds: no run starts after this")
    parser.add_argument("--out", default=str(RESULTS / "engines-cpu"), help="report path without .md/.json")
    parser.add_argument("--work", default="/tmp/bench-engines", help="models, profiles, plans and logs")
    return parser.parse_args()


def model_yaml(work: Path, size: str) -> Path:
    hidden, layers, heads, vocab = SIZES[size]
    path = work / f"gpt2-{size}.yaml"
    path.write_text(
        f"name: gpt2-{size}\narchitecture: gpt2\nseq_len: {SEQ_LEN}\nconfig:\n  n_embd: {hidden}\n  n_layer: {layers}\n"
        f"  n_head: {heads}\n  n_positions: {SEQ_LEN}\n  vocab_size: {vocab}\n  resid_pdrop: 0.0\n  embd_pdrop: 0.0\n"
        "  attn_pdrop: 0.0\n"
    )
    return path


def systems_of(size: str, work: Path, steps: int) -> tuple[list[System], dict]:
    """Profiles the model, searches its plans and returns the systems to run, with facts for the report."""
    from elixir_tune.costmodel.model import CostModel
    from elixir_tune.costmodel.peers import PeerModel, PeerShape
    from elixir_tune.hardware import load_hardware
    from elixir_tune.measure.plans import runner_missing
    from elixir_tune.plan.engine_choice import EngineChoice
    from elixir_tune.profiler import profile_model, save_profile
    from elixir_tune.search import search

    folder = work / size
    folder.mkdir(parents=True, exist_ok=True)
    model = model_yaml(folder, size)
    profile = profile_model(str(model), batch_size=2, seq_len=SEQ_LEN, dtype="fp32", checkpointing="all")
    save_profile(profile, folder / "profile.yaml")
    hardware = load_hardware("cpu")
    fixed = {"dtype": "fp32"}
    ours = search(profile, hardware, gpus_per_node=WORLD, global_batch_size=GLOBAL_BATCH, fixed=fixed).plan
    micro, accum = ours.training.micro_batch_size, ours.training.grad_accum_steps
    every = ours.training.activation_checkpointing.every
    systems = [_plan_system("elixir (search's plan)", ours, folder / "elixir.yaml", steps, None)]
    full = None
    for cache in (2, 3, 4):
        try:
            full = search(
                profile,
                hardware,
                gpus_per_node=WORLD,
                global_batch_size=GLOBAL_BATCH,
                fixed={**fixed, "cache_blocks": cache},
            ).plan
            break
        except ValueError:
            continue
    if full is not None:
        systems.append(_plan_system("elixir (full shard)", full, folder / "elixir-full.yaml", steps, None))
    pins = {**fixed, "micro_batch_size": micro, "checkpointing": every}
    base = search(
        profile, hardware, gpus_per_node=WORLD, global_batch_size=GLOBAL_BATCH, fixed=pins, engine="fsdp2"
    ).plan
    peers = PeerModel(CostModel(profile, hardware, WORLD, dtype="fp32"))
    for name, engine in (
        ("FSDP2", EngineChoice("fsdp2")),
        ("FSDP2 + CPUOffloadPolicy", EngineChoice("fsdp2", offload_params=True, offload_optimizer=True)),
        ("DeepSpeed ZeRO-3", EngineChoice("deepspeed", zero_stage=3)),
    ):
        shape = PeerShape(engine, micro, accum, every)
        assert base.prediction is not None
        prediction = dataclasses.replace(
            base.prediction,
            step_time_s=round(peers.step_time(shape).step_time_s, 6),
            peak_gpu_bytes=peers.memory(shape).peak_gpu_bytes,
        )
        plan = dataclasses.replace(base, engine=engine, prediction=prediction)
        path = folder / f"{engine.name}-{len(systems)}.yaml"
        systems.append(_plan_system(name, plan, path, steps, runner_missing(engine.name)))
    checkpointing = "none" if every == 0 else "all"
    for name, ddp, world in (("plain PyTorch (1 process)", False, 1), ("DDP", True, WORLD)):
        shape = PeerShape(EngineChoice("deepspeed", zero_stage=1), micro, accum * WORLD // world, every)
        priced = PeerModel(CostModel(profile, hardware, world, dtype="fp32"))
        record = folder / f"{'ddp' if ddp else 'plain'}.json"
        command = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
        command += [str(REPO / "scripts" / "peers" / "torch_step.py"), *(["--ddp"] if ddp else [])]
        command += [
            "--model",
            str(model),
            "--micro-batch-size",
            str(micro),
            "--grad-accum-steps",
            str(accum * WORLD // world),
        ]
        command += ["--seq-len", str(SEQ_LEN), "--checkpointing", checkpointing, "--dtype", "fp32"]
        command += ["--steps", str(steps), "--warmup", "1", "--out", str(record)]
        systems.insert(
            0 if not ddp else 1,
            System(
                name, command, record, "torch", priced.step_time(shape).step_time_s, priced.memory(shape).peak_gpu_bytes
            ),
        )
    facts = {
        "num_params": profile.num_params,
        "micro_batch_size": micro,
        "grad_accum_steps": accum,
        "checkpointing_every": every,
    }
    return systems, facts


def _plan_system(name: str, plan, path: Path, steps: int, skip: str | None) -> System:
    """A system run as ``elixir-run PLAN pretrain --synthetic`` (the plan written to ``path``)."""
    from elixir_tune.plan import save_plan

    save_plan(plan, path, header=f"{name}: scripts/bench_engines.py")
    log = path.with_suffix(".log.json")
    command = [PY, "-m", "elixir_tune.cli.run", str(path), "pretrain", "--synthetic", "--steps", str(steps)]
    command += ["--log", str(log), "--print-every", str(steps)]
    assert plan.prediction is not None
    return System(name, command, log, "plan", plan.prediction.step_time_s, plan.prediction.peak_gpu_bytes, skip)


def run(system: System, timeout_s: float) -> None:
    """One run of a system; its timed steps and peak memory added."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)
    system.record.unlink(missing_ok=True)
    try:
        done = subprocess.run(
            system.command, capture_output=True, text=True, timeout=timeout_s, env=env, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        system.failure = f"timed out after {timeout_s:.0f} s"
        return
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        system.failure = f"exit {done.returncode}: {lines[-1][:200] if lines else 'no output'}"
        return
    record = json.loads(system.record.read_text())
    if system.kind == "torch":
        system.step_times_s += record["step_times_s"][1:]
        system.peak_bytes = max(system.peak_bytes, record["peak_rss_bytes"])
    else:
        system.step_times_s += [step["step_time_s"] for step in record["steps"][1:]]
        system.peak_bytes = max([system.peak_bytes, *(step["memory_bytes"] for step in record["steps"])])


def report(args, results: dict, started: str, load: tuple, elapsed_s: float) -> None:
    """The Markdown and JSON reports."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    from report_meta import generated, header_line  # scripts/ is on the path when this runs as a script

    command = f"python scripts/bench_engines.py --sizes {args.sizes} --steps {args.steps} --rounds {args.rounds}"
    header = generated(round(load[0], 2), command)
    lines = [
        "# Engines on the CPU: ours beside plain PyTorch, DDP, FSDP2 and DeepSpeed ZeRO-3",
        "",
        header_line(header)
        + f" {elapsed_s:.0f} s. World {WORLD}, gloo, fp32, seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, synthetic "
        "tokens. Compare within a size.",
        "",
        "Step: median after each run's first step, over the rounds. Memory: peak resident memory of a rank "
        "(rank 0 for plan runs, the largest rank for the torch baselines). Predicted: the cost model "
        "(ours from the plan; peers from costmodel/peers.py; plain and DDP priced as ZeRO-1).",
    ]
    for size, (systems, facts) in results.items():
        lines += [
            "",
            f"## {size}: {facts['num_params']:,} parameters, micro-batch {facts['micro_batch_size']} x "
            f"{facts['grad_accum_steps']}, checkpointing every {facts['checkpointing_every']}",
            "",
        ]
        lines += [
            "| system | predicted ms | measured ms | measured / predicted | peak MiB per rank | status |",
            "|---|---|---|---|---|---|",
        ]
        for s in systems:
            ratio = s.median_s / s.predicted_step_s if s.median_s and s.predicted_step_s else None
            status = _status(s)
            lines.append(
                f"| {s.name} | {_ms(s.predicted_step_s)} | {_ms(s.median_s)} | {f'{ratio:.2f}' if ratio else '-'} | "
                f"{s.peak_bytes / 2**20:,.0f} | {status} |"
                if s.peak_bytes
                else f"| {s.name} | {_ms(s.predicted_step_s)} | {_ms(s.median_s)} | - | - | {status} |"
            )
        lines += ["", _ratios(systems)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    record = {
        "generated": header,
        "date": started,
        "commit": commit,
        "load_average_start": load[0],
        "elapsed_s": elapsed_s,
        "args": vars(args),
        "sizes": {
            size: {
                **facts,
                "systems": [
                    {
                        "name": s.name,
                        "predicted_step_time_s": s.predicted_step_s,
                        "measured_step_time_s": s.median_s,
                        "step_times_s": s.step_times_s,
                        "peak_bytes": s.peak_bytes or None,
                        "predicted_peak_bytes": s.predicted_peak_bytes,
                        "status": _status(s),
                    }
                    for s in systems
                ],
            }
            for size, (systems, facts) in results.items()
        },
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))


def _status(system: System) -> str:
    if system.skip or system.failure:
        return system.skip or system.failure or ""
    return "ran" if system.step_times_s else "not run: the budget was spent first (--budget, --sizes)"


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:,.1f}" if seconds else "-"


def _ratios(systems: list[System]) -> str:
    """Our engine's median step over FSDP2's and DeepSpeed's (where both ran)."""
    by_name = {s.name: s.median_s for s in systems}
    parts = []
    for ours in ("elixir (search's plan)", "elixir (full shard)"):
        for peer in ("FSDP2", "DeepSpeed ZeRO-3"):
            if by_name.get(ours) and by_name.get(peer):
                parts.append(f"{ours} / {peer}: {by_name[ours] / by_name[peer]:.2f}x")
    return "Our engine's median step over the peer's (below 1: ours is faster): " + (
        "; ".join(parts) if parts else "none: a peer did not run (see status)"
    )


def main() -> int:
    args = parse_args()
    sizes = [size.strip().lower() for size in args.sizes.split(",") if size.strip()]
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {', '.join(unknown)} (known: {', '.join(SIZES)})")
    started_at = time.monotonic()
    started = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}"
    load = os.getloadavg()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for size in sizes:
        print(f"[{size}] profiling and searching", flush=True)
        results[size] = systems_of(size, work, args.steps)
    for round_index in range(args.rounds):
        for size in sizes:
            systems = results[size][0]
            order = systems[round_index % len(systems) :] + systems[: round_index % len(systems)]
            for system in order:
                left = args.budget - (time.monotonic() - started_at)
                if system.skip or system.failure or left <= 0:
                    continue
                print(f"[{size}] round {round_index + 1}: {system.name}", flush=True)
                run(system, min(left, 600))
    report(args, results, started, load, time.monotonic() - started_at)
    print(f"wrote {args.out}.md and .json", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
