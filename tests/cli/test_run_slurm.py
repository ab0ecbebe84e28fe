"""`elixir-run` inside a SLURM allocation: nodes, node rank, endpoint and job id from SLURM."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from click.testing import CliRunner

from elixir_tune.cli.run import run_command
from elixir_tune.launcher.slurm import SlurmError, first_host, read_allocation
from elixir_tune.paths import REPO_DIR

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"
WORKER = REPO_DIR / "tests" / "e2e" / "workers" / "allreduce_worker.py"
SBATCH_EXAMPLE = REPO_DIR / "scripts" / "slurm_example.sbatch"


def _step_env(nodes: int, node_id: int, nodelist: str, **extra: str) -> dict[str, str]:
    """The variables srun sets in one task of a job step with one task per node."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": str(nodes),
        "SLURM_NODEID": str(node_id),
        "SLURM_NTASKS": str(nodes),
        "SLURM_JOB_NODELIST": nodelist,
    }
    env.update(extra)
    return env


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node001", "node001"),
        ("gpu[07-09,12]", "gpu07"),
        ("gpu[3,5-6]-ib", "gpu3-ib"),
        ("a100-[002-004],login1", "a100-002"),
        ("login1,gpu[1-2]", "login1"),
    ],
)
def test_first_host_of_compressed_node_lists(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "gpu[]", "   "])
def test_unreadable_node_list_is_an_error(nodelist):
    with pytest.raises(SlurmError, match="node list"):
        first_host(nodelist)


def test_allocation_outside_a_job_step_is_none():
    assert read_allocation({}) is None
    # A batch script runs on the first node only: reading it there would make that node wait.
    batch_only = _step_env(2, 0, "n[1-2]")
    del batch_only["SLURM_STEP_ID"]
    assert read_allocation(batch_only) is None


def test_allocation_from_a_job_step():
    allocation = read_allocation(_step_env(4, 3, "gpu[10-13]", ELIXIR_TUNE_RDZV_PORT="29511"))
    assert (allocation.nnodes, allocation.node_rank) == (4, 3)
    assert allocation.rdzv_endpoint == "gpu10:29511"
    assert allocation.rdzv_id == "slurm-4242"


def test_several_tasks_per_node_is_an_error():
    with pytest.raises(SlurmError, match="--ntasks-per-node=1"):
        read_allocation(_step_env(2, 0, "n[1-2]", SLURM_NTASKS="8"))


def _dry_run(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        run_command, [*args, "--dry-run", "--json", str(EXAMPLE_PLAN), str(WORKER)], env=env, catch_exceptions=False
    )
    return result.exit_code, result.output


def test_dry_run_under_a_faked_two_node_allocation(tmp_path):
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    raw["cluster"]["nodes"] = 2
    raw["training"]["global_batch_size"] *= 2
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = CliRunner().invoke(
        run_command,
        ["--dry-run", "--json", str(plan), str(WORKER)],
        env=_step_env(2, 1, "hpc[017-018]"),
        catch_exceptions=False,
    )
    report = json.loads(result.output)
    assert result.exit_code == 0, result.output
    assert report["torchrun_argv"][:5] == [
        "--nproc-per-node=2",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=hpc017:29400",
        "--rdzv-id=slurm-4242",
    ]
    node_rank = next(check for check in report["checks"] if check["name"] == "node rank")
    assert node_rank["ok"] and node_rank["detail"] == "node rank 1 of 2"
    assert report["slurm"]["node_rank"] == 1


def test_explicit_flags_win_over_the_allocation(tmp_path):
    code, output = _dry_run(_step_env(2, 1, "hpc[017-018]"), "--nnodes", "1", "--node-rank", "0", "--rdzv-id", "mine")
    report = json.loads(output)
    assert code == 0, output
    # One node by the user's word: no rendezvous endpoint from SLURM, torchrun runs standalone.
    assert "--standalone" in report["torchrun_argv"]
    assert not any(arg.startswith("--rdzv-endpoint") for arg in report["torchrun_argv"])


def test_inconsistent_allocation_is_refused_before_any_worker():
    code, output = _dry_run(_step_env(2, 0, "n[1-2]", SLURM_NTASKS="16"))
    assert code == 1
    assert "once per node" in output


def test_sbatch_example_is_valid_bash_and_uses_one_task_per_node():
    text = SBATCH_EXAMPLE.read_text()
    assert "--ntasks-per-node=1" in text and "elixir-run" in text
    subprocess.run(["bash", "-n", str(SBATCH_EXAMPLE)], check=True)
