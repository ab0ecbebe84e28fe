"""Runs a DDP training script as written (torchrun) and ported to elixir-run, and plans for it.

The port is what the README's "Your own training script" asks of a user: the DDP import becomes
``import elixir_tune`` and ``model = DDP(model)`` becomes ``model, optimizer = elixir_tune.setup(model,
optimizer)``; nothing else changes. The three plans each loop runs under: the search's default, one
that releases chunks (small chunks, one cache block above the minimum) and one that offloads half.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.e2e.launch_helpers import REPO_DIR, job_env, run_elixir, tune

HERE = Path(__file__).resolve().parent
DDP_IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP"
WRAP = re.compile(r"^(\s*)model = DDP\(model\)$", re.MULTILINE)


def port(script: Path, out: Path) -> Path:
    """Writes the elixir-tune port of a DDP script beside its model file; returns its path."""
    text = script.read_text()
    assert text.count(DDP_IMPORT) == 1 and len(WRAP.findall(text)) == 1, f"{script.name} is not a DDP script"
    text = text.replace(DDP_IMPORT, "import elixir_tune")
    text = WRAP.sub(r"\1model, optimizer = elixir_tune.setup(model, optimizer)", text)
    out.write_text(text)
    return out


def changed_lines(before: Path, after: Path) -> int:
    old, new = before.read_text().splitlines(), after.read_text().splitlines()
    assert len(old) == len(new)
    return sum(a != b for a, b in zip(old, new, strict=True))


def plans(model_source: Path, work: Path, seq_len: int, global_batch: int, small_chunk: int) -> dict[str, Path]:
    """Profiles the model and searches the three plans; name -> plan path."""
    tune(["profile", model_source, "--batch-size", 4, "--seq-len", seq_len, "--out", work / "profile.yaml"])
    common = ["search", "--gpus", 2, "--hardware", "cpu", "--profile", work / "profile.yaml"]
    common += ["--global-batch-size", global_batch, "--fix", "micro_batch_size=4"]
    fixes = {
        "default": [],
        "released": ["--fix", f"chunk_size={small_chunk}", "--fix", "cache_blocks=2"],
        "offload": ["--fix", "offload=0.5"],
    }
    found = {}
    for name, fix in fixes.items():
        found[name] = work / f"plan-{name}.yaml"
        tune([*common, *fix, "--out", found[name]])
    return found


def run_ddp(script: Path, args: list[str], cwd: Path, out: str) -> dict:
    """The script as written, under torchrun (2 processes, gloo); rank 0's ``out/record.json``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(script), *args], cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((cwd / out / "record.json").read_text())


def run_port(plan: Path, script: Path, args: list[str], cwd: Path, out: str) -> dict:
    """The ported script under elixir-run with ``plan``; rank 0's ``out/record.json``."""
    done = run_elixir([plan, script, *args], timeout_s=300, cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "never called elixir_tune.setup" not in done.stderr
    return json.loads((cwd / out / "record.json").read_text())


def script_env() -> dict[str, str]:
    env = job_env()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO_DIR)
    return env


def relative_gap(found: list[float], expected: list[float]) -> float:
    assert len(found) == len(expected) and expected
    return max(abs(a - b) / abs(b) for a, b in zip(found, expected, strict=True))
