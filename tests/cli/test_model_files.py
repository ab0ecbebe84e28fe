"""Model files as people write them: a .py that imports a module beside it, and torchtitan's blocks in a
ModuleDict (``model.layers["0"]``, ...), found as the block list so that checkpointing is offered and runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from click.testing import CliRunner

import elixir_tune
from elixir_tune.cli.main import cli
from elixir_tune.profiler.blocks import find_block_list
from tests.distributed.engine_plans import make_plan

BIN_DIR = Path(sys.executable).parent

# The blocks live in a module beside the model file (as torchtitan keeps its model in several files).
SIBLING = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))
"""

MODEL = '''
import torch
from torch import nn

from {sibling} import Block


class Titan(nn.Module):
    """torchtitan's layout: the blocks in a ModuleDict keyed by their index."""

    def __init__(self, vocab=64, width=16, blocks=3):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleDict({{str(index): Block(width) for index in range(blocks)}})
        self.output = nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        x = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            x = layer(x)
        logits = self.output(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_model():
    return Titan()


def example_batch(batch_size, seq_len):
    ids = torch.randint(0, 64, (batch_size, seq_len))
    return {{"input_ids": ids, "labels": ids}}
'''


def write_model(folder: Path, sibling: str) -> Path:
    """model.py and the module it imports, in ``folder``; ``sibling`` is the module's (unique) name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{sibling}.py").write_text(textwrap.dedent(SIBLING))
    path = folder / "model.py"
    path.write_text(textwrap.dedent(MODEL.format(sibling=sibling)))
    return path


def test_profiling_a_file_that_imports_a_module_beside_it_needs_no_pythonpath(tmp_path: Path):
    """The real console script, from another folder, with PYTHONPATH unset: the file's folder is on the path."""
    model = write_model(tmp_path / "src", "titan_blocks_a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [str(BIN_DIR / "elixir-tune"), "profile", str(model), "-b", "2", "-s", "8", "--json", "--out", "p.yaml"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["block_list"] == "layers" and summary["num_blocks"] == 3


def test_a_module_dict_of_blocks_is_the_block_list_and_checkpointing_runs_on_it(tmp_path: Path):
    """Found by the profiler, offered by the search (--fix checkpointing=all), and run by the engine with
    every block checkpointed: the same loss and gradients' effect as plain PyTorch over 3 steps."""
    model_file = write_model(tmp_path, "titan_blocks_b")
    runner = CliRunner()
    profile = tmp_path / "profile.yaml"
    result = runner.invoke(cli, ["profile", str(model_file), "-b", "2", "-s", "8", "--out", str(profile)])
    assert result.exit_code == 0, result.output
    assert "3 in layers" in result.output
    plan_file = tmp_path / "plan.yaml"
    result = runner.invoke(
        cli,
        ["search", "--gpus", "1", "--hardware", "cpu", "--profile", str(profile), "--global-batch-size", "2"]
        + ["--fix", "checkpointing=all", "--out", str(plan_file)],
    )
    assert result.exit_code == 0, result.output
    assert elixir_tune.load_plan(str(plan_file)).training.activation_checkpointing.every == 1

    sys.path.insert(0, str(tmp_path))
    try:
        namespace: dict = {}
        exec(compile(model_file.read_text(), str(model_file), "exec"), namespace)
    finally:
        sys.path.remove(str(tmp_path))
    torch.manual_seed(0)
    reference = namespace["build_model"]()
    name, blocks = find_block_list(reference)
    assert name == "layers" and len(blocks) == 3
    model = namespace["build_model"]()
    model.load_state_dict(reference.state_dict())
    plan = make_plan(model, 1, 1024, checkpoint_every=1, block_list="layers", seq_len=8)
    model, optimizer = elixir_tune.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)
    assert len(model.engine.blocks()) == 3
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        plain = reference(input_ids=ids, labels=ids)
        plain.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        torch.testing.assert_close(loss.detach(), plain.detach(), rtol=1e-6, atol=1e-6)


def _searched(tmp_path: Path, model: str) -> str:
    """``elixir-tune profile MODEL`` and ``search`` in ``tmp_path``; the command line search says to run."""
    runner = CliRunner()
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        result = runner.invoke(cli, ["profile", model, "-b", "2", "-s", "8"])
        assert result.exit_code == 0, result.output
        result = runner.invoke(cli, ["search", "--gpus", "1", "--hardware", "cpu", "--global-batch-size", "2"])
        assert result.exit_code == 0, result.output
    finally:
        os.chdir(previous)
    printed = " ".join(result.output.split())  # rich wraps long lines
    return printed[printed.index("run it with `") + len("run it with `") :]


def test_search_prints_a_command_that_runs_for_this_model(tmp_path: Path):
    """A model whose forward takes other inputs than input_ids and labels is run by the user's own script; a
    token model with a vocabulary under 256 (bytes) by pretrain --synthetic, which then trains for real."""
    mlp = Path(__file__).resolve().parent.parent / "unit" / "models" / "tiny_mlp.py"
    (tmp_path / "mlp").mkdir()
    printed = _searched(tmp_path / "mlp", str(mlp))
    assert printed.startswith("elixir-run plan.yaml train.py` (your own training script: the model takes tokens, ")
    assert "pretrain recipe feeds input_ids and labels only" in printed

    titan = write_model(tmp_path / "titan", "titan_blocks_c")
    printed = _searched(tmp_path / "titan", str(titan))
    assert printed.startswith(
        "elixir-run plan.yaml pretrain --synthetic --steps 100` (random tokens: the model's vocabulary of 64"
    ), printed
    command = printed[: printed.index("`")].split()[1:]
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    result = subprocess.run(
        [str(BIN_DIR / "elixir-run"), *command, "--steps", "2"],
        cwd=tmp_path / "titan",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "done: loss" in result.stdout
