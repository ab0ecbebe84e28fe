"""Run numbers that tell the truth: which tokens a step learned from, and the plan's promise against the run.

A step computes over ``rows x seq_len`` token positions, but padding (the end of short rows) is no data, and
positions whose label is -100 (a prompt under completion-only training, the user's turns of a chat, each row's
first token, which nothing predicts) teach the model nothing. Tokens/s and MFU count the tokens with a loss, the
ones the model learns from; padding and the no-loss tokens are reported apart, so that chat samples of 35 tokens
padded to 128 no longer read as 3.6x the throughput.

At the end of a run the measured step time and peak memory are set beside the plan's prediction; a gap beyond
``GAP_LIMIT`` says what to do (a plan made for other hardware: probe this machine and search again).
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100  # the label transformers' losses leave out (as elixir_tune.data writes it)
GAP_LIMIT = 1.5  # measured / predicted (or its inverse) beyond which the run's end says what to do
# On the CPU the measured peak is the process's resident memory above its start (recipes/loop.py
# mark_process_start): the interpreter, torch and transformers (0.4-0.5 GiB) are left out, as the plan leaves
# them out. What still grows beside the plan's tensors: malloc's arenas, the data set, gloo's buffers; the
# search keeps 256 MiB free for them on a CPU (costmodel/memory.py CPU_MARGIN_MIN_BYTES). Below that excess
# over the prediction the gap is theirs, and no advice is given.
CPU_GROWTH_ALLOWANCE_BYTES = 256 << 20
COUNT_NAMES = ("computed", "padding", "learned")  # the order of token_counts' entries


def token_counts(batch: dict[str, Any], pad_id: int | None = None) -> torch.Tensor:
    """How a batch's token positions divide: all of them, padding, and those with a loss.

    Padding is ``attention_mask == 0`` for padded rows; for packed rows (``position_ids``, no mask) it is the
    tail after the last sample: the row's last run of positions from 0 when every token there is ``pad_id``
    and no label counts. Learned tokens are a causal LM's shifted labels that are not -100, every position
    when the batch has no 2D ``labels``.

    Args:
        batch: a rank's rows (``input_ids``, and ``labels``, ``attention_mask`` or ``position_ids`` as given).
        pad_id: the padding token of packed rows (None: packed rows count no padding).

    Returns:
        float64 tensor ``[computed, padding, learned]`` (``COUNT_NAMES``), on the CPU.
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return torch.zeros(3, dtype=torch.float64)
    rows, length = ids.shape
    computed = rows * length
    mask, labels, positions = batch.get("attention_mask"), batch.get("labels"), batch.get("position_ids")
    labelled = isinstance(labels, torch.Tensor) and labels.shape == ids.shape
    padding = 0
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        padding = int((mask == 0).sum())
    elif isinstance(positions, torch.Tensor) and positions.shape == ids.shape and pad_id is not None and labelled:
        starts = positions == 0
        # the index of each row's last position 0 (argmax finds the first True of the flipped row)
        last_start = length - 1 - starts.flip(1).to(torch.int8).argmax(dim=1)
        tail = torch.arange(length).unsqueeze(0) >= last_start.unsqueeze(1)
        blank = ((ids == pad_id) & (labels == IGNORE_INDEX)) | ~tail
        padding = int(tail[blank.all(dim=1)].sum())
    learned = int((labels[:, 1:] != IGNORE_INDEX).sum()) if labelled and labels is not None else computed - padding
    return torch.tensor([computed, padding, learned], dtype=torch.float64)


def peak_tflops(plan) -> float | None:
    """The dense rate per worker the plan's MFU was measured against (its TFLOP/s over its MFU), or None."""
    prediction = getattr(plan, "prediction", None)
    if prediction is None or not prediction.mfu or not prediction.tflops_per_gpu:
        return None
    return prediction.tflops_per_gpu / prediction.mfu


def promise(plan, rank: int = 0) -> dict[str, Any]:
    """What the plan predicts for a run on this machine, for the run's log header (empty without a prediction).

    Args:
        plan: the plan the job runs.
        rank: the rank whose memory is compared (its pipeline stage's figure).

    Returns:
        ``predicted_step_time_s``, ``predicted_peak_memory_bytes``, ``hardware`` and ``peak_tflops_per_worker``.
    """
    if getattr(plan, "prediction", None) is None:
        return {}
    return {
        "predicted_step_time_s": plan.prediction.step_time_s,
        "predicted_peak_memory_bytes": plan.rank_memory(rank).peak_gpu_bytes,
        "hardware": plan.cluster.hardware,
        "peak_tflops_per_worker": peak_tflops(plan),
    }


def ratio(measured: float, predicted: float | None) -> float | None:
    """measured / predicted, or None when there is nothing to compare."""
    return measured / predicted if predicted and measured > 0 else None


def compare(header: dict[str, Any], step_time_s: float, peak_memory_bytes: int, device: str) -> dict[str, Any]:
    """The run's measured step time and peak memory beside the plan's prediction, with advice for a gap.

    Args:
        header: the run's log header (``promise``'s keys, when the plan has a prediction).
        step_time_s: the measured mean step time (the first step, which warms up, left out).
        peak_memory_bytes: the measured peak (device memory on a GPU; on the CPU the process's resident memory
            above its start, before the model was built).
        device: ``cuda`` or ``cpu``.

    Returns:
        ``step_time_ratio`` and ``memory_ratio`` (measured / predicted, None without a prediction), the figures
        compared, and ``advice``: one line per gap beyond ``GAP_LIMIT`` (empty when the plan held).
    """
    predicted_time = header.get("predicted_step_time_s")
    predicted_memory = header.get("predicted_peak_memory_bytes")
    result: dict[str, Any] = {
        "predicted_step_time_s": predicted_time,
        "measured_step_time_s": step_time_s,
        "step_time_ratio": ratio(step_time_s, predicted_time),
        "predicted_peak_memory_bytes": predicted_memory,
        "measured_peak_memory_bytes": peak_memory_bytes,
        "memory_ratio": ratio(peak_memory_bytes, predicted_memory),
        "advice": [],
    }
    hardware = header.get("hardware") or "its hardware"
    research = (
        f"the plan was made for {hardware}: run `elixir-tune probe` on this machine, then `elixir-tune search "
        "--hardware hardware.yaml` for a plan priced on it"
    )
    time_ratio = result["step_time_ratio"]
    if time_ratio is not None and not 1 / GAP_LIMIT <= time_ratio <= GAP_LIMIT:
        slower = "slower" if time_ratio > 1 else "faster"
        result["advice"].append(
            f"steps ran {max(time_ratio, 1 / time_ratio):.1f}x {slower} than predicted; {research} (a machine busy "
            "with other work also slows steps: compare on an idle one)"
        )
    memory_ratio = result["memory_ratio"]
    excess_bytes = peak_memory_bytes - (predicted_memory or 0)
    if device == "cpu" and excess_bytes < CPU_GROWTH_ALLOWANCE_BYTES:
        memory_ratio = None  # the interpreter's own memory, not the plan's miss
    if memory_ratio is not None and memory_ratio > GAP_LIMIT:
        where = (
            "the process grew by more than the plan's tensors and the 256 MiB kept free beside them; " + research
            if device == "cpu"
            else "the plan may not fit where it was promised to; " + research
        )
        result["advice"].append(f"peak memory was {memory_ratio:.1f}x the prediction; {where}")
    return result


def step_figures(
    counts: torch.Tensor, step_time_s: float, num_params: int, world: int, peak_tflops_per_worker: float | None
) -> dict[str, Any]:
    """A step's token counts and rates for the log: tokens/s and model TFLOP/s from the learned tokens.

    Args:
        counts: the step's ``token_counts`` summed over its whole global batch.
        step_time_s: the step's wall time.
        num_params: the model's parameters (6 FLOPs each per token: forward and backward).
        world: the workers sharing the step.
        peak_tflops_per_worker: the rate MFU is measured against (``peak_tflops``), or None.

    Returns:
        ``tokens`` (learned), ``tokens_padding``, ``tokens_no_loss``, ``tokens_computed``, ``tokens_per_s``,
        ``computed_tokens_per_s`` (padding and no-loss included: what the old figure counted),
        ``tflops_per_gpu`` and ``mfu`` (None without a peak).
    """
    computed, padding, learned = (int(value) for value in counts.tolist())
    tflops = 6 * num_params * learned / step_time_s / world / 1e12
    return {
        "tokens": learned,
        "tokens_padding": padding,
        "tokens_no_loss": computed - padding - learned,
        "tokens_computed": computed,
        "tokens_per_s": learned / step_time_s,
        "computed_tokens_per_s": computed / step_time_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops_per_worker if peak_tflops_per_worker else None,
    }
