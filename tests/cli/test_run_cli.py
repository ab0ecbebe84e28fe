"""`elixir-run`: help, --dry-run, and every pre-flight error, each before any worker starts.

The workers named here would write into an output folder as soon as they start; every error
case asserts that folder stays empty.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from elixir_tune.cli.run import run_command
from elixir_tune.paths import REPO_DIR
from elixir_tune.plan import PLAN_ENV_VAR

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"
WORKER = REPO_DIR / "tests" / "e2e" / "workers" / "allreduce_worker.py"


def _script(name: str) -> str:
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else (shutil.which(name) or pytest.fail(f"{name} is not installed"))


def _plan(tmp_path: Path, changes: dict) -> Path:
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = raw
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _invoke(args: list) -> tuple[int, str]:
    result = CliRunner().invoke(run_command, [str(arg) for arg in args])
    return result.exit_code, result.output


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


def test_help_lists_options_and_example():
    code, output = _invoke(["--help"])
    assert code == 0
    for option in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--max-restarts", "--dry-run"):
        assert option in output
    for option in ("--rdzv-timeout", "--collective-timeout", "--force"):
        assert option in output
    assert "elixir-run plan.yaml pretrain --steps 20" in output
    assert "elixir-run --rdzv-timeout 120 --collective-timeout 600 plan.yaml train.py" in output


def test_dry_run_prints_checks_and_the_exact_command(out_dir):
    code, output = _invoke(
        ["--max-restarts", "1", "--dry-run", "--monitor-interval=0.5", EXAMPLE_PLAN, WORKER, "--out", out_dir]
    )
    assert code == 0, output
    assert "ok world size" in output and "ok torch" in output
    command = next(line for line in output.splitlines() if "torchrun" in line and PLAN_ENV_VAR in line)
    words = shlex.split(command)
    assert words[0] == f"{PLAN_ENV_VAR}={EXAMPLE_PLAN}"
    at = words.index("torchrun")
    assert words[at + 1 :] == [
        "--nproc-per-node=2",
        "--standalone",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        # the bootstrap that ties each worker to elixir-run, then runs the script
        "-m",
        "elixir_tune.launcher.worker_main",
        str(WORKER),
        "--out",
        str(out_dir),
    ]
    assert not list(out_dir.iterdir()), "--dry-run started workers"


def test_dry_run_json_for_two_nodes(tmp_path, out_dir):
    plan = _plan(tmp_path, {"cluster.nodes": 2, "training.global_batch_size": 32})
    code, output = _invoke(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "127.0.0.1:29555",
            "--rdzv-id",
            "job9",
            "--dry-run",
            "--json",
            plan,
            WORKER,
            "--out",
            out_dir,
        ]
    )
    assert code == 0, output
    report = json.loads(output)
    assert report["ok"] is True
    assert report["torchrun_argv"][:5] == [
        "--nproc-per-node=2",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29555",
        "--rdzv-id=job9",
    ]
    assert report["env"][PLAN_ENV_VAR] == str(plan)
    assert {check["name"] for check in report["checks"]} >= {"world size", "rendezvous", "node rank"}


def test_malformed_plan_lists_every_problem(tmp_path, out_dir):
    plan = _plan(tmp_path, {"training.micro_batch_size": 3, "cluster.device": "tpu"})
    code, output = _invoke([plan, WORKER, "--out", out_dir])
    assert code == 1
    assert "is not a usable plan" in output
    assert "training.global_batch_size" in output and "cluster.device" in output
    assert "elixir-tune validate" in output
    assert not list(out_dir.iterdir())


def test_yaml_syntax_error_and_missing_plan(tmp_path, out_dir):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {source: [unclosed\n")
    code, output = _invoke([broken, WORKER, "--out", out_dir])
    assert code == 1 and "YAML syntax error at line" in output
    code, output = _invoke([tmp_path / "nowhere.yaml", WORKER, "--out", out_dir])
    assert code == 1 and "file not found" in output
    assert not list(out_dir.iterdir())


def test_missing_script(out_dir):
    code, output = _invoke([EXAMPLE_PLAN, "scripts/no_such_train.py", "--out", out_dir])
    assert code == 1 and "training script not found: scripts/no_such_train.py" in output


def test_cuda_plan_without_enough_gpus(tmp_path, out_dir):
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = _plan(
        tmp_path,
        {
            "cluster.device": "cuda",
            "cluster.backend": "nccl",
            "cluster.gpus_per_node": gpus + 1,
            "training.global_batch_size": 4 * 2 * (gpus + 1),
            "memory.chunk_size": 65536 * (gpus + 1),
        },
    )
    code, output = _invoke([plan, WORKER, "--out", out_dir])
    assert code == 1, output
    assert "cannot run here" in output and "gpus:" in output
    assert not list(out_dir.iterdir())


def test_world_size_mismatch(out_dir):
    code, output = _invoke(
        ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29555", EXAMPLE_PLAN, WORKER, "--out", out_dir]
    )
    assert code == 1
    assert "world size" in output and "pass --nnodes 1" in output
    assert not list(out_dir.iterdir())


@pytest.mark.parametrize(
    "args, words",
    [
        ([], "missing PLAN"),
        ([EXAMPLE_PLAN], "missing SCRIPT"),
        (["--nproc-per-node=8", EXAMPLE_PLAN, WORKER], "--nproc-per-node is set by elixir-run"),
    ],
)
def test_usage_errors(args, words):
    code, output = _invoke(args)
    assert code == 2 and words in output


@pytest.mark.slow  # a fresh interpreter imports torch: seconds
def test_preflight_error_through_the_console_script(tmp_path, out_dir):
    plan = _plan(tmp_path, {"cluster.gpus_per_node": 3})  # 4 x 2 x 3 != 16
    out = subprocess.run(
        [_script("elixir-run"), str(plan), str(WORKER), "--out", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "error:" in out.stderr and "training.global_batch_size" in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(out_dir.iterdir())
