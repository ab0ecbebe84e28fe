"""The first recorded prediction of each published setup, and where the history records it (issue 38).

A row's first prediction is the pinned ratio (predicted / published tokens/s per GPU) the project
recorded before any change looked at that row. Two kinds of record are used, the earliest one found:

* the notes of ``benchmarks/results/published.md`` at commit 9314fd9 (2026-11-25), which state
  before -> after figures for the changes made after the Megatron-LM, ZeRO-Offload and Colossal-AI
  rows were added (the Megatron-LM and ZeRO-Offload first predictions at commit 54c8fe0, before any
  change to the cost model; the Colossal-AI rows' before the pointwise-traffic change);
* for the rows issue 38 added (``FIRST_ISSUE38``), the run that added them, on the model as it stood;
* the first ``benchmarks/results/published.json`` in git that holds the row (``git log --reverse``);
  for the llm-foundry and torchtitan rows that is commit b5df80f. The llm-foundry rows' rates were
  fitted to other rows of the same tables in that session, so theirs is the fitted error, not a
  blind one; no per-row figure before the fit is recorded.

``scripts/bench_published.py`` reports the median error of first predictions for the rows the rates
were fitted to and for the held-out rows, beside the current one.
"""

from __future__ import annotations

NOTE_54C8FE0 = "first prediction before any cost-model change (commit 54c8fe0), stated in published.md @ 9314fd9"
NOTE_POINTWISE = "before the pointwise-traffic change, stated in published.md @ 9314fd9 (the rows' earliest figure)"
FIRST_JSON = "first published.json holding the row (commit b5df80f)"
FIRST_ISSUE38 = (
    "issue 38's new rows: the model as it stood at commit 4b25e61, before any change looked at them "
    "(python scripts/bench_published.py --sources llm-foundry-40gb)"
)

# setup name -> (first pinned ratio, where it is recorded)
FIRST_PREDICTIONS: dict[str, tuple[float, str]] = {
    "MPT-760m s2048 8xH100": (1.106, FIRST_JSON),
    "MPT-1b s2048 8xH100": (0.982, FIRST_JSON),
    "MPT-1b s32768 8xH100": (0.977, FIRST_JSON),
    "MPT-3b s2048 16xH100": (1.009, FIRST_JSON),
    "MPT-3b s8192 8xH100": (0.974, FIRST_JSON),
    "MPT-7b s2048 8xH100": (1.001, FIRST_JSON),
    "MPT-7b s4096 8xH100": (0.964, FIRST_JSON),
    "MPT-13b s2048 8xH100": (1.168, FIRST_JSON),
    "MPT-13b s4096 8xH100": (0.978, FIRST_JSON),
    "MPT-30b s2048 8xH100": (1.0, FIRST_JSON),
    "MPT-70b s2048 64xH100": (0.898, FIRST_JSON),
    "MPT-125m s2048 8xA100": (1.002, FIRST_JSON),
    "MPT-350m s2048 8xA100": (1.002, FIRST_JSON),
    "MPT-1b s2048 8xA100": (1.009, FIRST_JSON),
    "MPT-3b s2048 8xA100": (1.015, FIRST_JSON),
    "MPT-7b s2048 8xA100": (1.002, FIRST_JSON),
    "MPT-7b s16384 8xA100": (0.995, FIRST_JSON),
    "MPT-13b s4096 8xA100": (0.999, FIRST_JSON),
    "Llama-3.1-8B s8192 8xH100 (torchtitan FSDP)": (1.192, FIRST_JSON),
    "Llama-3.1-8B s8192 128xH100 (torchtitan FSDP)": (1.231, FIRST_JSON),
    "Megatron GPT-1.7B 32xA100 (t1 p1)": (1.40, NOTE_54C8FE0),
    "Megatron GPT-3.6B 64xA100 (t2 p1)": (1.30, NOTE_54C8FE0),
    "Megatron GPT-7.5B 128xA100 (t4 p1)": (1.16, NOTE_54C8FE0),
    "Megatron GPT-18B 256xA100 (t8 p1)": (1.15, NOTE_54C8FE0),
    "Megatron GPT-39B 512xA100 (t8 p2)": (1.25, NOTE_54C8FE0),
    "Megatron GPT-76B 1024xA100 (t8 p4)": (1.35, NOTE_54C8FE0),
    "GPT-2 10B 1xV100 (ZeRO-Offload)": (1.17, NOTE_54C8FE0),
    "GPT-2 18B 1xA100-40G (ZeRO-3 offload)": (2.00, NOTE_POINTWISE),
    "GPT-2 24B 1xA100-40G (Gemini auto)": (2.80, NOTE_POINTWISE),
    "GPT-2 12B 8xA100-40G (ZeRO-3)": (17.55, NOTE_POINTWISE),
    "GPT-2 12B 8xA100-40G (Gemini cuda)": (13.70, NOTE_POINTWISE),
    "GPT-2 XL 4xA100-40G (DDP)": (2.46, NOTE_POINTWISE),
    "GPT-2 XL 4xA100-40G (ZeRO-3)": (1.61, NOTE_POINTWISE),
    "GPT-2 XL 4xA100-40G (Gemini cuda)": (1.52, NOTE_POINTWISE),
    "GPT-2 10B 2xA100-80G-PCIe (Gemini cpu, batch 32)": (0.89, NOTE_POINTWISE),
    "GPT-2 10B 2xA100-80G-PCIe (Gemini cpu, batch 16)": (1.06, NOTE_POINTWISE),
    "GPT-2 10B 2xA100-80G-PCIe (Gemini cpu, batch 8)": (1.02, NOTE_POINTWISE),
    "GPT-2 10B 4xA100-80G-PCIe (Gemini auto, batch 8)": (1.57, NOTE_POINTWISE),
    "GPT-2 10B 4xA100-80G-PCIe (Gemini cpu, batch 8)": (1.01, NOTE_POINTWISE),
    "GPT-2 10B 4xA100-80G-PCIe (Gemini const, batch 8)": (1.70, NOTE_POINTWISE),
    "GPT-2 20B 1xA100-80G-PCIe (Gemini cpu, batch 8)": (1.26, NOTE_POINTWISE),
    "MPT-125m s2048 8xA100-40G": (1.044, FIRST_ISSUE38),
    "MPT-350m s2048 8xA100-40G": (1.052, FIRST_ISSUE38),
    "MPT-760m s2048 8xA100-40G": (0.869, FIRST_ISSUE38),
    "MPT-1b s2048 8xA100-40G": (1.074, FIRST_ISSUE38),
    "MPT-1b s16384 8xA100-40G": (1.078, FIRST_ISSUE38),
    "MPT-3b s2048 8xA100-40G": (1.085, FIRST_ISSUE38),
    "MPT-3b s8192 8xA100-40G": (1.116, FIRST_ISSUE38),
    "MPT-7b s2048 8xA100-40G": (1.124, FIRST_ISSUE38),
    "MPT-7b s4096 8xA100-40G": (1.117, FIRST_ISSUE38),
    "MPT-13b s2048 8xA100-40G": (1.331, FIRST_ISSUE38),
    "MPT-13b s2048 16xA100-40G": (1.111, FIRST_ISSUE38),
    "MPT-30b s2048 32xA100-40G": (1.066, FIRST_ISSUE38),
}
