"""Plain PyTorch references for scripts/bench_prediction.py: the same model without the engine."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


PLAIN_RSS = """\
import json, os, resource, sys
import torch
from elixir_tune.profiler import load_model_source
torch.set_num_threads(1)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
micro, seq, vocab = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = load_model_source(sys.argv[1]).build_model()
before = rss()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, vocab, (micro, seq))
for _ in range(3):
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(json.dumps({"rss_before_bytes": before, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def plain_rss_reference(model_path: Path, profile, args, micro: int) -> dict:
    """Peak RSS growth of plain PyTorch training (fresh process, 1 thread, micro-batch 8, AdamW) next to
    what the profile predicts for it: activations at micro-batch 8 + fp32 weights, gradients, Adam m, v."""
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_RSS, str(model_path), str(micro), str(args.seq), str(args.vocab)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"},
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-1000:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    activations = int(profile.activation.at(micro))
    states = profile.num_params * 16
    out.update(
        {
            "growth_bytes": out["peak_rss_bytes"] - out["rss_before_bytes"],
            "micro_batch_size": micro,
            "profile_activation_bytes": activations,
            "param_grad_adam_bytes": states,
            "predicted_bytes": activations + states,
        }
    )
    return out


def plain_reference(source, profile, args) -> dict:
    """Plain PyTorch (no engine), 1 thread, in this process: forward+backward and an AdamW step."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = source.build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        out = {}
        for micro, accum in ((8, 1), (2, 4)):
            ids = torch.randint(0, args.vocab, (micro, args.seq))
            samples = []
            for step in range(5):
                started = time.perf_counter()
                for _ in range(accum):
                    model(input_ids=ids, labels=ids).loss.backward()
                if step:  # the first includes one-off work
                    samples.append(time.perf_counter() - started)
            out[f"fwd_bwd_{micro}x{accum}_s"] = statistics.median(samples)
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            optimizer.step()
            samples.append(time.perf_counter() - started)
        out["adamw_step_s"] = statistics.median(samples[1:])
        # Hook count: what the engine pays per-module Python overhead on (forward and backward).
        out["num_modules"] = sum(1 for _ in model.modules())
        out["num_param_tensors"] = sum(1 for _ in model.parameters())
        return out
    finally:
        torch.set_num_threads(threads)


def plain_step_s(model, args, repeats: int = 4) -> float:
    """Plain PyTorch forward+backward of micro-batch 8 (1 thread, in this process), the median of ``repeats``
    after one untimed: the machine's speed at this moment, timed before each run of the bench. A VM's speed
    drifts over minutes (the idle runs' own reference took 225-356 ms from run to run) and a drift between
    the probe and the runs, or between rounds, moves measured/predicted with no error of the model."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = torch.randint(0, args.vocab, (8, args.seq))
        samples = []
        for step in range(repeats + 1):
            started = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if step:
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)
    finally:
        torch.set_num_threads(threads)
