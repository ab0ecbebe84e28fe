"""Runs scripts/train_gpt2.py unchanged (runpy) and records, per rank, what its log does not have.

Written to $VALIDATE_MEM_DIR/rank<R>.json at exit: the engine's ``memory_report()`` right after
``elixir_tune.setup``, the CUDA allocator's peaks (``max_memory_allocated``, ``max_memory_reserved``)
and the process's peak RSS. gpu_validate.py starts it through elixir-run in place of the script:

    elixir-run plan.yaml scripts/peers/engine_wrapper.py --synthetic --steps 4 --log train.json
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
from pathlib import Path

import torch

import elixir_tune
import elixir_tune.profiler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fast_init  # noqa: E402

_load_model_source = elixir_tune.profiler.load_model_source

SCRIPT = Path(__file__).resolve().parents[1] / "train_gpt2.py"
_record: dict = {}
_setup = elixir_tune.setup


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def setup(*args, **kwargs):
    _record["rss_before_setup_bytes"] = _rss_bytes()
    model, optimizer = _setup(*args, **kwargs)
    _record["rss_after_setup_bytes"] = _rss_bytes()
    report = getattr(model, "memory_report", None)  # the chunk engine's; a peer engine's run has none
    _record["memory_report"] = report() if report is not None else None
    return model, optimizer


@atexit.register
def _write() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        _record["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        _record["max_memory_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    _record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = Path(os.environ["VALIDATE_MEM_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps(_record))


class _FastInitSource:
    """A model source whose build_model runs under common.fast_init ($VALIDATE_FAST_INIT)."""

    def __init__(self, source):
        self._source = source

    def __getattr__(self, name):
        return getattr(self._source, name)

    def build_model(self, *args, **kwargs):
        with fast_init():
            return self._source.build_model(*args, **kwargs)


def load_model_source(*args, **kwargs):
    return _FastInitSource(_load_model_source(*args, **kwargs))


elixir_tune.setup = setup
elixir_tune.profiler.load_model_source = load_model_source
sys.argv = [str(SCRIPT)] + sys.argv[1:]
runpy.run_path(str(SCRIPT), run_name="__main__")
