"""The user's whole path on the CPU: profile the tiny GPT-2 -> hardware preset -> search -> elixir-run PLAN
pretrain with 2 worker processes, started as two nodes on loopback (one worker each): the loss falls and
both nodes exit 0. Then the same plan started on another model: the worker's engine refuses it
(fingerprint); and a layered-accumulation plan trains through the pretrain recipe.

A single-node start of a searched plan is every other job here and in test_parallel_user_path.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from elixir_tune.paths import REPO_DIR
from tests.e2e.launch_helpers import console_script, free_port, job_env, run_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun with several worker processes

TRAIN = "pretrain"  # the recipe name: elixir-run runs elixir_tune/recipes/pretrain.py
STEPS = 20  # of the two-node run: enough for the loss to fall by 1.5 from ~ln(256)


@pytest.fixture(scope="module")
def cpu_plan(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("pipeline")
    tune(
        [
            "profile",
            "configs/models/gpt2-tiny.yaml",
            "--batch-size",
            "8",
            "--seq-len",
            "128",
            "--out",
            work / "profile.yaml",
        ]
    )
    tune(
        [
            "search",
            "--gpus",
            "2",
            "--profile",
            work / "profile.yaml",
            "--hardware",
            "cpu",
            # data parallelism only: this path checks the chunk engine
            "--fix",
            "pipeline=1",
            "--fix",
            "tensor=1",
            "--global-batch-size",
            "16",
            "--out",
            work / "plan.yaml",
        ]
    )
    return work / "plan.yaml"


def test_two_nodes_on_loopback_train_one_plan(cpu_plan, tmp_path):
    plan = tmp_path / "plan-2nodes.yaml"
    tune(
        [
            "search",
            "--nodes",
            "2",
            "--gpus",
            "1",
            "--profile",
            cpu_plan.parent / "profile.yaml",
            "--hardware",
            "cpu",
            # data parallelism only: this path checks the chunk engine
            "--fix",
            "pipeline=1",
            "--fix",
            "tensor=1",
            "--global-batch-size",
            "16",
            "--out",
            plan,
        ]
    )
    endpoint = f"127.0.0.1:{free_port()}"
    log = tmp_path / "train.json"  # written by global rank 0, on whichever node the rendezvous put it
    env = {**job_env(), "OMP_NUM_THREADS": "1"}  # both "nodes" share this machine's cores
    nodes = [
        subprocess.Popen(
            [
                console_script("elixir-run"),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                endpoint,
                str(plan),
                str(TRAIN),
                "--steps",
                str(STEPS),
                "--log",
                str(log),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO_DIR,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=240)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n\n".join(out[-3000:] for out in outputs)
    record = json.loads(log.read_text())
    assert record["world_size"] == 2 and record["summary"]["status"] == "finished"
    losses = [step["loss"] for step in record["steps"]]
    assert len(losses) == STEPS
    assert losses[0] > 5.0  # ~ln(256): an untrained byte model
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    assert record["summary"]["last_loss"] < record["summary"]["first_loss"] - 1.0
    assert all(step["tokens_per_s"] > 0 and step["memory_bytes"] > 0 for step in record["steps"])
    assert all("job finished" in out for out in outputs)
    assert "node 0 of 2" in outputs[0] and "node 1 of 2" in outputs[1]


def test_a_plan_for_another_model_is_refused_by_the_workers(cpu_plan, tmp_path):
    other = tmp_path / "gpt2-other.yaml"
    other.write_text(
        (REPO_DIR / "configs" / "models" / "gpt2-tiny.yaml").read_text().replace("n_layer: 2", "n_layer: 1")
    )
    started = time.monotonic()
    result = run_elixir(
        [cpu_plan, TRAIN, "--model", other, "--steps", "2", "--log", tmp_path / "t.json"], timeout_s=120
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "another model" in output and "fingerprint" in output
    assert "the job failed: worker rank" in output
    assert time.monotonic() - started < 120
    assert not (tmp_path / "t.json").exists()


def test_a_layered_plan_trains_through_the_pretrain_recipe(cpu_plan, tmp_path):
    """search --fix accumulation=layered -> show names it -> elixir-run pretrain (the shared
    training loop steps through model.forward_backward) -> the loss falls."""
    plan = tmp_path / "plan-layered.yaml"
    work = cpu_plan.parent
    args = ["search", "--gpus", "2", "--profile", work / "profile.yaml", "--hardware", "cpu"]
    args += ["--global-batch-size", "16", "--fix", "accumulation=layered", "--fix", "micro_batch_size=2"]
    args += ["--fix", "pipeline=1", "--fix", "tensor=1"]  # the chunk engine's layered path
    args += ["--loop", "forward_backward"]  # the pretrain recipe runs model.forward_backward
    tune([*args, "--out", plan])
    assert "accumulation: layered" in plan.read_text()
    shown = tune(["show", plan])
    assert "accumulation 4 (layered)" in " ".join(shown.stdout.split())
    log = tmp_path / "train.json"
    result = run_elixir([plan, TRAIN, "--steps", "12", "--log", log], timeout_s=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    record = json.loads(log.read_text())
    losses = [step["loss"] for step in record["steps"]]
    assert len(losses) == 12 and record["summary"]["status"] == "finished"
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
