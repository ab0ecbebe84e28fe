"""scripts/gpu_validate.py --dry-run-cpu: the GPU validation's steps at toy size on the CPU, so the
script that runs first time on a lent GPU cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# heavy: 48 s in CI since it also runs the FSDP2 and DeepSpeed rows; `scripts/test.sh --all` runs it.
@pytest.mark.slow
@pytest.mark.heavy
def test_dry_run_plans_trains_and_compares_with_peers(tmp_path):
    # Two shapes at world 1, one at world 2, and the peers (the full dry run: the probe, 8 + 3 shapes).
    command = [sys.executable, "scripts/gpu_validate.py", "--dry-run-cpu", "--hardware", "cpu", "--skip-pytest"]
    command += ["--shapes", "search-best,full-offload", "--world2-shapes", "search-best", "--out-dir", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [json_path] = tmp_path.glob("gpu-cpu-dry-run-*.json")
    record = json.loads(json_path.read_text())
    rows = {(row["world"], row["name"]): row for row in record["rows"]}
    assert set(rows) == {(1, "search-best"), (1, "full-offload"), (2, "search-best")}
    for row in rows.values():
        assert row["status"] == "measured" or row["status"].startswith("same plan as"), row["status"]
        assert row["predicted_step_time_s"] > 0 and row["measured_step_time_s"] > 0
    best = rows[(1, "search-best")]
    assert best["shape"]["offloaded_chunks"] == 0 and rows[(1, "full-offload")]["shape"]["offloaded_chunks"] > 0
    assert best["peak_rss_bytes"] > 0 and best["memory_report"], "host memory and the engine's report recorded"
    assert best["tflops_per_gpu"] > 0 and 0 < best["mfu"] < 1
    peers = {peer["name"]: peer for peer in record["peers"]}
    assert peers["deepspeed"]["status"].startswith("skipped: dry run on the CPU")
    assert peers["fsdp2"]["status"] == "measured", peers["fsdp2"]["status"]
    assert peers["fsdp2"]["micro_batch_size"] == best["shape"]["micro_batch_size"]
    assert len(peers["fsdp2"]["step_times_s"]) == 3 and all(t > 0 for t in peers["fsdp2"]["step_times_s"])
    # The search's best plan on the peer engines through elixir-run (engine/peers/), the same script.
    engines = {row["engine"]: row for row in record["engines"]}
    assert engines["fsdp2"]["status"] == "measured", engines["fsdp2"]["status"]
    assert engines["fsdp2"]["engine_settings"]["name"] == "fsdp2" and engines["fsdp2"]["vs_elixir"] > 0
    if importlib.util.find_spec("deepspeed") is None:
        assert engines["deepspeed"]["status"].startswith("skipped"), engines["deepspeed"]["status"]
    else:
        assert engines["deepspeed"]["status"] == "measured", engines["deepspeed"]["status"]
    commands = [step.get("command", "") for step in record["steps"]]
    assert any("elixir_tune.cli.run" in c for c in commands) and any("fsdp2_step.py" in c for c in commands)
    # The dry run plans inside its own interpreter (profile and search only plan); training gets processes.
    in_process = {step["name"].split()[0] for step in record["steps"] if step.get("in_process")}
    assert in_process == {"profile", "search"}, in_process
    markdown = json_path.with_suffix(".md").read_text()
    assert "| fsdp2 |" in markdown and "skipped: dry run on the CPU" in markdown
    assert "gpu_validate:" in proc.stdout  # the summary


# heavy: about 130 s (the quick probe waits once for the load to pass, then measures under it).
@pytest.mark.slow
@pytest.mark.heavy
def test_dry_run_goes_on_past_a_loaded_probe_and_marks_the_figures(tmp_path):
    # Busy loops on every core: the probe finds the machine loaded before and after it measures.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        command = [sys.executable, "scripts/gpu_validate.py", "--dry-run-cpu", "--skip-pytest", "--steps", "2"]
        command += ["--shapes", "search-best", "--world2-shapes", "", "--out-dir", str(tmp_path)]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    finally:
        for loop in busy:
            loop.kill()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [json_path] = tmp_path.glob("gpu-cpu-dry-run-*.json")
    record = json.loads(json_path.read_text())
    assert record["probe_load"]["loaded"] == 1.0 and record["probe_load"]["busy_cores_before"] > 0.5
    assert any(row["status"] == "measured" for row in record["rows"]), record["rows"]
    assert "measured under load" in json_path.with_suffix(".md").read_text()
    assert "MEASURED UNDER LOAD" in proc.stdout
