"""How a run ends, as a user reads it (issue 36): Ctrl-C saves and says one step number everywhere (the save line,
the interrupted line, the JSON log counted from 1, the checkpoint's name), torchrun's per-worker warnings stay out
of the output, and the run ends with the plan's predicted step time beside the measured one."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.e2e.launch_helpers import finish_elixir, run_elixir, start_elixir, tune

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _logged_steps(log) -> int:
    try:
        return len(json.loads(log.read_text())["steps"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def test_ctrl_c_names_the_saved_step_once_and_torchrun_stays_quiet(tmp_path):
    tune(["profile", "gpt2-tiny", "-b", 2, "-s", 64], tmp_path)
    tune(["search", "--gpus", 2, "--hardware", "cpu", "--global-batch-size", 4], tmp_path)
    checkpoint, log = tmp_path / "ckpt", tmp_path / "train.json"
    process = start_elixir(
        [tmp_path / "plan.yaml", "pretrain", "--steps", 500, "--save", checkpoint, "--log", log, "--print-every", 1000]
    )
    deadline = time.monotonic() + 300
    while _logged_steps(log) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    output = finish_elixir(process, timeout_s=120)
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]

    steps = json.loads(log.read_text())["steps"]
    saved = (checkpoint / "latest").read_text().strip()
    done = steps[-1]["step"]
    assert [step["step"] for step in steps] == list(range(1, done + 1))
    assert saved == f"step-{done:06d}"
    assert f"saved checkpoint {checkpoint / saved} at step {done}\n" in output
    assert f"interrupted after step {done}; log so far: {log}" in output
    assert "closing signal" not in output and "death signal" not in output and "Traceback" not in output
    assert "  predicted for cpu: " in output and "plan vs run: step time" in output


def test_sigterm_saves_and_exits_143_as_both_helps_say(tmp_path):
    """A scheduler's SIGTERM saves as Ctrl-C does and the job exits 128 + SIGTERM, as elixir-run's help says; the
    recipe's help said 130. After a signal torchrun leaves its rendezvous keep-alive thread running; its finalizer,
    run by a collection in that thread, printed "Exception ignored ... cannot join current thread" after the end."""
    tune(["profile", "gpt2-tiny", "-b", 2, "-s", 64], tmp_path)
    tune(["search", "--gpus", 2, "--hardware", "cpu", "--global-batch-size", 4], tmp_path)
    checkpoint, log = tmp_path / "ckpt", tmp_path / "train.json"
    process = start_elixir(
        [tmp_path / "plan.yaml", "pretrain", "--synthetic", "--steps", 500, "--save", checkpoint, "--log", log]
        + ["--print-every", 1000]
    )
    deadline = time.monotonic() + 300
    while _logged_steps(log) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = finish_elixir(process, timeout_s=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    saved = (checkpoint / "latest").read_text().strip()
    assert f"saved checkpoint {checkpoint / saved} at step " in output
    assert output.rstrip().endswith("error: interrupted by SIGTERM; the workers were stopped"), output[-3000:]
    assert "Exception ignored" not in output and "Traceback" not in output, output[-3000:]

    recipe_help = run_elixir([tmp_path / "plan.yaml", "pretrain", "--help"]).stdout
    launcher_help = " ".join(run_elixir(["--help"]).stdout.split())
    assert "Ctrl-C or SIGTERM to elixir-run saves, then it exits 128 + the signal: 130 or 143" in recipe_help
    assert "or 128 + the signal that ended it (130 for Ctrl-C, 143 for SIGTERM," in launcher_help
