#!/usr/bin/env python
"""Validate a GPU machine end to end in one command, and bring back everything it measured.

    python scripts/gpu_validate.py                 # under 9 minutes on one GPU
    python scripts/gpu_validate.py --quick         # under 4 minutes: fewer shapes, quick probe
    python scripts/gpu_validate.py --dry-run-cpu   # the same steps at toy size on the CPU (gloo)

Steps, each recorded with its exact command, exit status, time and output tail:
  1. the machine: GPUs, driver, torch and CUDA versions; install the wheels of wheels/ (built by
     scripts/build_gpu_wheels.sh where a registry is reachable: DeepSpeed, hjson, pydantic, ...);
  2. `elixir-tune probe` (full; --quick: quick) and `pytest tests/gpu`;
  3. a GPT-2 sized from the probe so that its model states (16 B per parameter) are about 1.5x the
     device memory, capped by host memory (about 5-6B parameters on an 80 GB card with 128 GiB of
     host RAM): it needs partial offload. Profiled on the meta device;
  4. plans from `elixir-tune search` for at least 6 shapes (the search's best, Elixir's rule, full
     offload, no cache, checkpointing none and all, two micro-batch sizes; `--fix` pins each), each
     trained a few steps through `elixir-run` (scripts/train_gpt2.py --synthetic), recording
     predicted vs measured step time, peak device memory (max_memory_allocated and
     max_memory_reserved), host memory, TFLOPS per GPU and MFU; on 2 or more GPUs also at world 2;
  5. the same model, batch, sequence and checkpointing under PyTorch FSDP2 (CPUOffloadPolicy, bf16)
     and DeepSpeed ZeRO-3 with optimizer and parameter offload (scripts/peers/); a peer that cannot
     run says why;
  6. the search's best plan on the three engines: the plan with its engine section set to fsdp2
     and to deepspeed (mapped as `elixir-tune export` maps it), through the same elixir-run script.
On a lent machine whose files come back from $OUT: `python scripts/gpu_validate.py --out-dir $OUT`.
Results: benchmarks/results/gpu-<device>-<date>.md and .json, rewritten after every step so that a
run cut off at its time limit still returns what it measured; a short summary on stdout. Steps
that would not finish inside the time budget are recorded as not run, with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
PY = sys.executable
GiB = 2**30
# `elixir-tune` subcommands that a dry run runs inside this interpreter (same arguments, same exit
# status and output): they only plan, so nothing they do is measured, and each fresh interpreter would
# import torch and transformers again. Training, peers and the probe always get processes of their own.
CLI = [PY, "-m", "elixir_tune.cli.main"]
IN_PROCESS_IN_DRY_RUN = ("profile", "search")

from bench_prediction import MODEL_YAML  # noqa: E402
from gpu_validate_engines import run_engines  # noqa: E402
from gpu_validate_report import error_line, summary, write_markdown  # noqa: E402
from gpu_validate_shapes import gpt2_dims, peak_tflops, shape_pins  # noqa: E402
from report_meta import commit  # noqa: E402

from elixir_tune.hardware import load_hardware  # noqa: E402
from elixir_tune.hardware.load import loaded_note  # noqa: E402


def probe_load(hardware_path: Path) -> dict:
    """The load the probe measured under (``HardwareSpec.probe_load``; empty when it recorded none)."""
    return dict(load_hardware(str(hardware_path)).probe_load or {})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="under 4 minutes: quick probe, fewer shapes")
    parser.add_argument("--dry-run-cpu", action="store_true", help="toy size on the CPU with gloo")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget (default 510; quick 225)")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--wheels", default=str(REPO / "wheels"), help="wheels to install (no index)")
    parser.add_argument("--hardware", default=None, help="a preset or hardware file instead of probing")
    parser.add_argument("--skip-pytest", action="store_true", help="do not run pytest tests/gpu")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names to run (default: all)")
    parser.add_argument(
        "--world2-shapes", default="search-best,elixir-rule,full-offload", help="shapes at world 2 (2+ GPUs, dry run)"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per shape (default 4; dry run 3)")
    parser.add_argument("--params", type=float, default=None, help="model size to build instead of sizing it")
    return parser.parse_args()


def cli_in_process(args: list[str]) -> tuple[int, str]:
    """Runs ``elixir-tune ARGS`` in this interpreter: (exit status, stdout and stderr together)."""
    import contextlib
    import io
    import traceback

    from elixir_tune.cli.main import cli

    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            cli.main(args, prog_name="elixir-tune", standalone_mode=True)
            rc = 0
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except Exception:  # what the interpreter would print before exiting 1
            traceback.print_exc()
            rc = 1
    return rc, output.getvalue()


class Validation:
    """The record of one validation run: steps, rows and peers, written out after each change."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dry = args.dry_run_cpu
        self.started = time.monotonic()
        self.budget_s = args.budget_s or (225.0 if args.quick else 510.0)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_validate_"))
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.env["TRANSFORMERS_VERBOSITY"] = "error"
        if self.dry:
            self.env["OMP_NUM_THREADS"] = "1"
        else:  # a 5B model's random init would take a minute of each run (scripts/peers/common.py)
            self.env["VALIDATE_FAST_INIT"] = "1"
        self.record: dict = {"argv": sys.argv[1:], "dry_run_cpu": self.dry, "quick": args.quick, "steps": []}
        self.record["rows"], self.record["peers"], self.record["engines"] = [], [], []
        self.paths: tuple[Path, Path] | None = None
        self.current: subprocess.Popen | None = None
        self.estimate_s = 0.0  # seconds a training run takes, once one has run
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, signum, _frame) -> None:
        """Killed from outside: end the running step's whole process group (its own session would
        outlive us), keep what was measured, exit."""
        if self.current is not None and self.current.poll() is None:
            os.killpg(self.current.pid, signal.SIGKILL)
        self.record["stopped"] = f"signal {signum} after {time.monotonic() - self.started:.0f} s"
        self.write()
        raise SystemExit(128 + signum)

    # -- bookkeeping ---------------------------------------------------------------------------

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def say(self, message: str) -> None:
        print(f"[gpu_validate {time.monotonic() - self.started:6.1f} s] {message}", flush=True)

    def write(self) -> None:
        """Rewrites the JSON and markdown results (called after every step)."""
        if self.paths is None:
            return
        self.record["elapsed_s"] = round(time.monotonic() - self.started, 1)
        json_path, md_path = self.paths
        json_path.write_text(json.dumps(self.record, indent=1, default=str))
        md_path.write_text(write_markdown(self.record))

    def run(self, name: str, command: list[str], timeout_s: float, env: dict | None = None) -> dict:
        """Runs a command, records it as a step, returns the step."""
        timeout_s = max(1.0, min(timeout_s, self.left_s() - 5))
        step = {"name": name, "command": shlex.join(command), "timeout_s": round(timeout_s)}
        self.say(f"{name}: {step['command']}")
        started = time.monotonic()
        if self.dry and command[:3] == CLI and command[3] in IN_PROCESS_IN_DRY_RUN:
            step["rc"], output = cli_in_process(command[3:])
            step["in_process"] = True
            return self._done(name, step, started, output)
        # Own session: on a timeout the whole tree (torchrun and its workers, which hold GPU memory)
        # is killed, not only the launcher.
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env or self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.current = proc
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            step["rc"] = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            step["rc"] = "timeout"
        self.current = None
        return self._done(name, step, started, output)

    def _done(self, name: str, step: dict, started: float, output: str) -> dict:
        """Records a finished step with its time and output tail, returns it."""
        step["elapsed_s"] = round(time.monotonic() - started, 1)
        step["output_tail"] = output[-2500:]
        self.record["steps"].append(step)
        self.say(f"{name}: rc {step['rc']} in {step['elapsed_s']} s")
        self.write()
        return step

    def skip(self, name: str, reason: str) -> None:
        self.say(f"{name}: skipped ({reason})")
        self.record["steps"].append({"name": name, "rc": "skipped", "reason": reason})
        self.write()

    # -- steps ---------------------------------------------------------------------------------

    def environment(self) -> None:
        import torch

        info = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "host": platform.node(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "cpu_cores": os.cpu_count(),
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "commit": commit(),
        }
        if self.dry:
            info.update(device="cpu", device_name="CPU (dry run, gloo)", gpus=0, world_main=1)
        else:
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA device: run on a GPU machine, or use --dry-run-cpu")
            info.update(device="cuda", gpus=torch.cuda.device_count(), world_main=1)
            info["device_name"] = torch.cuda.get_device_name(0)
            smi = shutil.which("nvidia-smi")
            if smi:
                out = subprocess.run(
                    [smi, "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                )
                info["nvidia_smi"] = out.stdout.strip()
                info["driver"] = out.stdout.split(",")[0].strip() if out.stdout else None
        self.record["machine"] = info
        slug = re.sub(r"[^a-z0-9]+", "-", info["device_name"].lower()).strip("-")
        slug = "cpu-dry-run" if self.dry else slug.replace("nvidia-", "")
        out_dir = Path(self.args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / f"gpu-{slug}-{time.strftime('%Y-%m-%d', time.gmtime())}"
        self.paths = (stem.with_suffix(".json"), stem.with_suffix(".md"))
        self.say(f"machine: {info['device_name']}, torch {info['torch']}, results in {stem}.md/.json")
        self.write()

    def install_wheels(self) -> None:
        wheels = sorted(Path(self.args.wheels).glob("*.whl"))
        if self.dry:
            self.skip("install wheels", "dry run: uses this environment as it is")
        elif not wheels:
            self.skip("install wheels", f"no wheels in {self.args.wheels}: run scripts/build_gpu_wheels.sh first")
        else:
            # --no-deps: the image has the rest; the project itself runs from this tree (PYTHONPATH).
            command = [PY, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
            self.run("install wheels", command + [str(w) for w in wheels], 120)

    def hardware(self) -> str:
        target = self.work / "hardware.yaml"
        if self.args.hardware:
            self.skip("probe", f"--hardware {self.args.hardware} given")
            return self.args.hardware
        # A lent machine's window is short: a loaded probe is written anyway, after one wait, and the
        # load it ran under is recorded beside every figure instead of losing the window.
        command = [*CLI, "probe", "--out", str(target), "--allow-loaded", "--load-retries", "1"]
        if self.args.quick or self.dry:
            command.append("--quick")
        step = self.run("probe", command, 240 if not self.args.quick else 90)
        if step["rc"] != 0:
            raise SystemExit("probe failed: see the results file")
        self.record["hardware_yaml"] = target.read_text()
        self.record["probe_load"] = probe_load(target)
        if self.record["probe_load"].get("loaded"):
            self.say(f"probe: {loaded_note(self.record['probe_load'])}; going on, the figures are marked")
        return str(target)

    def pytest_gpu(self) -> None:
        if self.args.skip_pytest:
            self.skip("pytest tests/gpu", "--skip-pytest")
            return
        step = self.run("pytest tests/gpu", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], 150)
        found = re.findall(r"(\d+) (passed|failed|skipped|error)", step.get("output_tail", ""))
        step["summary"] = {kind: int(count) for count, kind in found}
        self.write()

    def size_model(self, hardware_path: str) -> dict:
        """A GPT-2 whose model states need partial offload here, and its profile."""
        from elixir_tune.hardware import load_hardware

        spec = load_hardware(hardware_path)
        if self.dry:
            dims = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256, "seq": 128}
            why = "dry run: the demo's GPT-2 tiny"
            batch, dtype = 8, "fp32"
        else:
            # 16 B/parameter of model states = 1.5x device memory, and the host must hold the states of
            # full offload (16 B) plus the fp32 model train_gpt2.py builds (4 B) plus pinned buffers.
            by_device = 1.5 * spec.gpu_memory_bytes / 16
            by_host = 0.75 * spec.host_memory_bytes / 22
            target = self.args.params or min(by_device, by_host) * (0.7 if self.args.quick else 1.0)
            dims = gpt2_dims(target)
            why = (
                f"target {target / 1e9:.2f}B = min(1.5 x device {spec.gpu_memory_bytes / GiB:.0f} GiB / 16 B, "
                f"0.75 x host {spec.host_memory_bytes / GiB:.0f} GiB / 22 B)"
                + (" x 0.7 (quick)" if self.args.quick else "")
            )
            batch, dtype = 8, "bf16"
        name = f"gpt2-validate-{dims['hidden']}x{dims['layers']}"
        model_path = self.work / f"{name}.yaml"
        model_path.write_text(MODEL_YAML.format(name=name, **dims))
        profile_path = self.work / "profile.yaml"
        command = [*CLI, "profile", str(model_path), "--batch-size", str(batch)]
        command += ["--seq-len", str(dims["seq"]), "--dtype", dtype, "--checkpointing", "all"]
        step = self.run("profile", command + ["--out", str(profile_path)], 180)
        if step["rc"] != 0:
            raise SystemExit("profile failed: see the results file")
        from elixir_tune.profiler import load_profile

        profile = load_profile(profile_path)
        model = {
            **dims,
            "name": name,
            "why": why,
            "num_params": profile.num_params,
            "model_state_bytes": 16 * profile.num_params,
            "device_memory_bytes": spec.gpu_memory_bytes,
            "dtype": dtype,
            "per_rank_batch": batch,
            "flops_per_sample": profile.flops_per_sample,
            "yaml": str(model_path),
            "profile": str(profile_path),
            "peak_tflops": peak_tflops(spec, dtype),
        }
        self.record["model"] = {k: v for k, v in model.items() if k not in ("yaml", "profile")}
        self.write()
        return model

    def plan(self, name: str, world: int, hardware: str, model: dict, pins: list[str], strategy: str) -> dict:
        """Searches one shape's plan; a row (without measurements yet) or the reason there is none."""
        out = self.work / f"plan-{name}-w{world}.yaml"
        command = [*CLI, "search", "--gpus", str(world), "--profile", model["profile"]]
        command += ["--hardware", hardware, "--global-batch-size", str(model["per_rank_batch"] * world)]
        command += ["--loop", "forward_backward"]  # elixir-run trains through the pretrain recipe's forward_backward
        command += [arg for pin in pins for arg in ("--fix", pin)] + ["--strategy", strategy, "--out", str(out)]
        step = self.run(f"search {name} (world {world})", command, 120)
        row = {"name": name, "world": world, "pins": pins, "strategy": strategy, "search_command": step["command"]}
        if step["rc"] != 0:
            row["status"] = "no plan: " + error_line(step)
            return row
        from elixir_tune.plan import load_plan

        plan = load_plan(out)
        chunks = plan.memory.chunks
        row.update(
            plan_path=str(out),
            shape={
                "chunk_size": plan.memory.chunk_size,
                "cache_blocks": plan.memory.cache_blocks,
                "cacheable_chunks": sum(not c.resident for c in chunks),
                "prefetch": plan.memory.prefetch,
                "offloaded_chunks": sum(c.offload for c in chunks),
                "num_chunks": len(chunks),
                "checkpointing": plan.training.activation_checkpointing.every,
                "micro_batch_size": plan.training.micro_batch_size,
                "grad_accum_steps": plan.training.grad_accum_steps,
            },
            predicted_step_time_s=plan.prediction.step_time_s,
            predicted_peak_gpu_bytes=plan.prediction.peak_gpu_bytes,
            predicted_peak_host_bytes=plan.prediction.peak_host_bytes,
            predicted_breakdown=plan.prediction.breakdown,
            status="planned",
        )
        return row

    def train(self, row: dict, model: dict, estimate_s: float) -> None:
        """Trains a planned row a few steps through elixir-run and adds the measurements."""
        if self.left_s() < estimate_s:
            row["status"] = f"not run: {self.left_s():.0f} s of the budget left, a run takes ~{estimate_s:.0f} s"
            return
        steps = self.args.steps or (3 if self.dry else 4)
        mem_dir = self.work / f"mem-{row['name']}-w{row['world']}"
        mem_dir.mkdir()
        log = self.work / f"train-{row['name']}-w{row['world']}.json"
        command = [PY, "-m", "elixir_tune.cli.run", row["plan_path"], str(REPO / "scripts/peers/engine_wrapper.py")]
        command += ["--synthetic", "--steps", str(steps), "--log", str(log)]
        step = self.run(
            f"train {row['name']} (world {row['world']})", command, 300, {**self.env, "VALIDATE_MEM_DIR": str(mem_dir)}
        )
        row["train_command"] = step["command"]
        row["wall_s"] = step["elapsed_s"]
        if step["rc"] != 0 or not log.exists():
            row["status"] = f"failed: rc {step['rc']}: {error_line(step)}"
            return
        times = [s["step_time_s"] for s in json.loads(log.read_text())["steps"]]
        ranks = [json.loads(p.read_text()) for p in sorted(mem_dir.glob("rank*.json"))]
        measured = statistics.median(times[1:] or times)
        tflops = model["flops_per_sample"] * model["per_rank_batch"] / measured / 1e12
        predicted = row.get("predicted_step_time_s")
        row.update(
            status="measured",
            step_times_s=times,
            measured_step_time_s=measured,
            time_ratio=measured / predicted if predicted else None,
            max_memory_allocated_bytes=max((r.get("max_memory_allocated_bytes", 0) for r in ranks), default=0),
            max_memory_reserved_bytes=max((r.get("max_memory_reserved_bytes", 0) for r in ranks), default=0),
            peak_rss_bytes=max((r.get("peak_rss_bytes", 0) for r in ranks), default=0),
            host_rss_sum_bytes=sum(r.get("peak_rss_bytes", 0) for r in ranks),
            memory_report=ranks[0].get("memory_report") if ranks else None,
            tflops_per_gpu=tflops,
            mfu=tflops / model["peak_tflops"],
        )

    def peer(self, name: str, script: str, best: dict, model: dict, reason_missing: str | None) -> None:
        entry = {"name": name}
        self.record["peers"].append(entry)
        if reason_missing:
            entry["status"] = f"skipped: {reason_missing}"
            self.skip(name, reason_missing)
            return
        shape = best["shape"]
        entry["checkpointing"] = "all" if shape["checkpointing"] else "none"
        if shape["checkpointing"] > 1:
            entry["note"] = f"our plan checkpoints every {shape['checkpointing']}-th block; the peer checkpoints all"
        world = best["world"]
        out = self.work / f"{name}.json"
        command = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), script]
        command += ["--model", model["yaml"], "--micro-batch-size", str(shape["micro_batch_size"])]
        command += ["--grad-accum-steps", str(shape["grad_accum_steps"]), "--seq-len", str(model["seq"])]
        command += ["--checkpointing", entry["checkpointing"], "--dtype", model["dtype"], "--out", str(out)]
        command += ["--steps", str(self.args.steps or (3 if self.dry else 4))]
        step = self.run(name, command, 300)
        entry["command"] = step["command"]
        if step["rc"] != 0 or not out.exists():
            entry["status"] = f"failed: rc {step['rc']}: {error_line(step)}"
        else:
            result = json.loads(out.read_text())
            tflops = model["flops_per_sample"] * model["per_rank_batch"] / result["median_step_time_s"] / 1e12
            entry.update(result, status="measured", tflops_per_gpu=tflops, mfu=tflops / model["peak_tflops"])
            entry["vs_our_best"] = result["median_step_time_s"] / best.get("measured_step_time_s", float("nan"))
        self.write()


def run_world(
    v: Validation, world: int, hardware: str, model: dict, wanted: set[str] | None, limit: int, peers: bool
) -> None:
    """Plans and trains the shapes at one world size: the search's best first, then (``peers``) the
    peers on the best's batch, then the other shapes while the time budget lasts."""
    best = v.plan("search-best", world, hardware, model, [], "joint")
    v.record["rows"].append(best)
    if best["status"] != "planned":
        v.write()
        return
    v.train(best, model, v.estimate_s)  # the first run always goes (0 s), a later world's best only if it fits
    v.write()
    if best.get("status") != "measured":
        return
    estimate = v.estimate_s = best.get("wall_s", 60) * 1.2
    if peers:
        run_peers(v, best, model, estimate)
        run_engines(v, best, model, estimate)
    shapes = shape_pins(best, model["profile"], hardware, world, model["per_rank_batch"])[: limit - 1]
    for name, pins, strategy in shapes:
        if wanted is not None and name not in wanted and name.rsplit("-", 1)[0] not in wanted:
            continue
        row = v.plan(name, world, hardware, model, pins, strategy)
        v.record["rows"].append(row)
        same = next(
            (r for r in v.record["rows"][:-1] if r.get("shape") == row.get("shape") and r["world"] == world), None
        )
        if row["status"] == "planned" and same is not None:
            row["status"] = f"same plan as {same['name']}: not run again"
            for key in (
                "measured_step_time_s",
                "time_ratio",
                "max_memory_allocated_bytes",
                "max_memory_reserved_bytes",
            ):
                if key in same:
                    row[key] = same[key]
        elif row["status"] == "planned":
            v.train(row, model, estimate)
        v.write()


def run_peers(v: Validation, best: dict, model: dict, estimate_s: float) -> None:
    """FSDP2 and DeepSpeed on the best plan's model, batch, sequence and checkpointing."""
    if v.dry:
        missing = "dry run on the CPU: DeepSpeed ZeRO-3 offload needs CUDA"
        if importlib.util.find_spec("deepspeed") is None:
            missing += " (and deepspeed is not installed here)"
    elif importlib.util.find_spec("deepspeed") is None:
        missing = "deepspeed is not installed (no wheels/, or their install failed: see the steps)"
    else:
        missing = None
    for name, script, reason in (("fsdp2", "fsdp2_step.py", None), ("deepspeed", "deepspeed_step.py", missing)):
        if reason is None and v.left_s() < estimate_s:
            reason = f"not run: {v.left_s():.0f} s of the budget left, a run takes ~{estimate_s:.0f} s"
        v.peer(name, str(REPO / "scripts" / "peers" / script), best, model, reason)


def main() -> int:
    args = parse_args()
    v = Validation(args)
    v.environment()
    v.install_wheels()
    hardware = v.hardware()
    v.pytest_gpu()
    model = v.size_model(hardware)
    wanted = set(args.shapes.split(",")) if args.shapes else None
    run_world(v, 1, hardware, model, wanted, 4 if args.quick else 8, peers=True)
    gpus = v.record["machine"].get("gpus", 0)
    if v.dry or gpus >= 2:
        run_world(v, 2, hardware, model, set(args.world2_shapes.split(",")), 3, peers=False)
    else:
        v.record["world2"] = f"not run: {gpus} GPU(s)"
    v.write()
    print(summary(v.record))
    return 0 if any(r.get("status") == "measured" for r in v.record["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
