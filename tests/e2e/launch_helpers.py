"""Helpers for launcher and end-to-end tests: plans made from the example, ports, processes, and the setup of
the LoRA fine-tunes of chat data."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import click.testing
import pytest
import yaml

from elixir_tune.paths import REPO_DIR

EXAMPLE_PLAN = REPO_DIR / "configs" / "plans" / "example.yaml"
WORKERS_DIR = Path(__file__).parent / "workers"
ALLREDUCE_WORKER = WORKERS_DIR / "allreduce_worker.py"


def console_script(name: str) -> str:
    """The installed console script beside the interpreter running the tests (.venv/bin)."""
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else (shutil.which(name) or pytest.fail(f"{name} is not installed"))


def write_plan(path: Path, changes: dict | None = None) -> Path:
    """Writes the example plan (a valid 2-process cpu plan) with dotted-path changes applied."""
    raw = yaml.safe_load(EXAMPLE_PLAN.read_text())
    for dotted, value in (changes or {}).items():
        *parents, leaf = dotted.split(".")
        node = raw
        for key in parents:
            node = node[key]
        node[leaf] = value
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def runnable_example_plan(path: Path) -> Path:
    """The example plan (tiny GPT-2, an offloaded chunk, 2 micro-batches, recomputation) with the real
    fingerprint of the model the pretrain recipe builds from it, so that elixir-run can train it."""
    import torch

    from elixir_tune.engine import model_fingerprint
    from elixir_tune.profiler import load_model_source

    model_yaml = REPO_DIR / "configs" / "models" / "gpt2-tiny.yaml"
    torch.manual_seed(0)
    model = load_model_source(str(model_yaml)).build_model()
    return write_plan(path, {"model.fingerprint": model_fingerprint(model), "model.source": str(model_yaml)})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env() -> dict[str, str]:
    """The environment for launched jobs: no inherited thread count, unbuffered output."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (psutil-free: reads /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_for_ranks(out_dir: Path, ranks: int, timeout_s: float) -> list[dict]:
    """Waits until every rank wrote its start-up record; returns the records by rank."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = [out_dir / f"rank{rank}.json" for rank in range(ranks)]
        if all(file.exists() and file.stat().st_size for file in files):
            try:
                return [json.loads(file.read_text()) for file in files]
            except json.JSONDecodeError:
                pass  # a worker is still writing
        time.sleep(0.1)
    raise AssertionError(f"workers did not start within {timeout_s} s: {sorted(p.name for p in out_dir.iterdir())}")


def kill_leftovers(pids: list[int]) -> list[int]:
    """SIGKILLs (only) the given pids still alive, so a failed test leaves nothing behind."""
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return left


def run_elixir(args: list[str], timeout_s: float = 120, cwd: Path = REPO_DIR) -> subprocess.CompletedProcess:
    return subprocess.run(
        [console_script("elixir-run"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=job_env(),
        cwd=cwd,
    )


def tune(args: list, cwd: Path = REPO_DIR) -> click.testing.Result:
    """Runs ``elixir-tune ARGS`` in this process from ``cwd`` and asserts it succeeded (its output in the
    message when not). In-process: a fresh interpreter would spend seconds importing torch for each call, and
    the console script itself is tested by tests/cli/test_help.py and test_profile_cli.py."""
    from click.testing import CliRunner

    from elixir_tune.cli.main import cli

    previous = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(cli, [str(arg) for arg in args])
    finally:
        os.chdir(previous)
    assert result.exit_code == 0, f"elixir-tune {args[0]} failed:\n{result.output}\n{result.exception!r}"
    return result


def start_elixir(args: list) -> subprocess.Popen:
    """``elixir-run ARGS`` in its own session (a test can signal its whole process group), output piped."""
    return subprocess.Popen(
        [console_script("elixir-run"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env(),
        start_new_session=True,
    )


def finish_elixir(process: subprocess.Popen, timeout_s: float) -> str:
    """The output of an ``elixir-run`` started by ``start_elixir``; fails the test if it outlives ``timeout_s``."""
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"elixir-run did not end within {timeout_s} s:\n{output}")
    return output


def finish_all(processes: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """The outputs of several ``elixir-run`` processes (one per node); any still running after a failure
    is killed, so no test leaves a node behind."""
    try:
        return [finish_elixir(process, timeout_s) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


# --- LoRA fine-tunes of chat data (test_finetune_chat_lora.py, test_finetune_lora_mesh.py) --------------------


@dataclasses.dataclass
class ChatLoraRun:
    """What a LoRA fine-tune of chat data starts from: a tiny Llama-style directory (tokenizer with a chat
    template), a ``messages`` JSONL file to train on, and a saved ``datasets`` directory of chats to evaluate."""

    model_dir: Path
    chat: Path
    eval_dir: Path


def profiled_chat_lora(tmp_path: Path, seq_len: int, batch_size: int, lora: list[str]) -> ChatLoraRun:
    """Writes the model directory and the data under ``tmp_path`` and runs ``elixir-tune profile DIR
    --batch-size B --seq-len S LORA...`` there (profile.yaml in ``tmp_path``)."""
    from tests.fixtures.tiny_hf import CONVERSATIONS, make_llama_dir, write_formats

    model_dir = make_llama_dir(tmp_path / "tiny-llama")
    files = write_formats(tmp_path / "data")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 3))
    tune(["profile", model_dir, "--batch-size", batch_size, "--seq-len", seq_len, *lora], tmp_path)
    return ChatLoraRun(model_dir, chat, files["messages_dataset"])


def printed_finetune(search_output: str) -> str:
    """The ``finetune ...`` command that ``elixir-tune search`` printed for ``elixir-run plan.yaml``."""
    printed = re.search(r"run it with `elixir-run plan\.yaml (finetune [^`]+)`", search_output)
    assert printed, search_output[-1500:]
    return printed.group(1)


def packed_eval_loss(model, tokenizer, run: ChatLoraRun, seq_len: int, batch_size: int) -> tuple[float, int]:
    """(token-weighted mean loss over ``run``'s eval chats, their loss tokens) of ``model`` on one process, the
    eval rows packed as the finetune recipe's ``--packing`` packs them, ``batch_size`` rows per batch."""
    import torch

    from elixir_tune.data import load_data
    from elixir_tune.recipes.finetune import build_parser
    from elixir_tune.recipes.finetune_options import data_spec

    args = build_parser().parse_args(["--data", str(run.chat), "--eval-data", str(run.eval_dir), "--packing"])
    split = load_data(data_spec(args), tokenizer, seq_len)
    weighted, tokens = 0.0, 0
    with torch.no_grad():
        for batch in split.eval_batches(batch_size):
            count = int((batch["labels"][:, 1:] != -100).sum())
            if count:
                weighted += float(model(**batch).loss) * count
                tokens += count
    return weighted / tokens, tokens
