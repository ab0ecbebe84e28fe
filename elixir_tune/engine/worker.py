"""This worker process's device and how long its collectives may wait: what the engine's process
group needs from the environment (torchrun's LOCAL_RANK, CUDA_VISIBLE_DEVICES, elixir-run's
$ELIXIR_TUNE_COLLECTIVE_TIMEOUT_S), without any process group of its own (engine/comm/mesh.py joins it)."""

from __future__ import annotations

import os

import torch

from elixir_tune.device import cuda_device_count

COLLECTIVE_TIMEOUT_ENV = "ELIXIR_TUNE_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def collective_timeout_s() -> float:
    """How long a collective may wait for the other ranks before it fails: $ELIXIR_TUNE_COLLECTIVE_TIMEOUT_S
    (elixir-run's --collective-timeout sets it), else 300 s.

    Raises:
        ValueError: the variable is not a positive number.
    """
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"${COLLECTIVE_TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


def pick_device(device_type: str) -> torch.device:
    """This process's device, as torchrun and CUDA_VISIBLE_DEVICES intend.

    torchrun gives each process its LOCAL_RANK; a launcher (or a cluster scheduler) that also narrows
    CUDA_VISIBLE_DEVICES to one GPU per process leaves only device 0 visible to it.

    Raises:
        RuntimeError: a cuda plan with no GPU visible, or a LOCAL_RANK beyond the visible GPUs.
    """
    if device_type != "cuda":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = cuda_device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    if count == 0:
        raise RuntimeError(f"the plan is for cuda but no GPU is visible (CUDA_VISIBLE_DEVICES={visible})")
    index = 0 if count == 1 else local_rank
    if index >= count:
        raise RuntimeError(
            f"LOCAL_RANK is {local_rank} but this process sees {count} GPUs (CUDA_VISIBLE_DEVICES={visible}); "
            "start one process per GPU (elixir-run or torchrun --nproc-per-node) and leave CUDA_VISIBLE_DEVICES "
            "listing every GPU of the node, or exactly one per process"
        )
    return torch.device("cuda", index)
