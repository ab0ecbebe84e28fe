"""llm-foundry's A100 40GB throughput table: rows added by issue 38, held out (no preset rate is fitted to them).

mosaicml/llm-foundry scripts/train/benchmarking/README.md, table 'A100 40GB with 1600 Gbps node-node
interconnect (RoCE)': MPT in Composer with FSDP FULL_SHARD, precision 'bf16' and FSDP mixed precision
PURE (parameters gathered and gradients reduced in bf16). The a100-40gb-sxm preset takes its rates from
the a100-80gb-sxm preset (fitted to the A100 80GB table) and only its best MFU from this table (the 3b
512 row, not compared), so these rows were not looked at by any fit. Their first predictions were taken
on the model as it stood when they were added (``published_first.py``).
"""

from __future__ import annotations

A100_40_TABLE = "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"
# The source at the commit the other llm-foundry rows quote (the table is the same at 061f2c7c).
A100_40_MISMATCH = (
    "precision 'bf16' with FSDP mixed precision PURE: parameters gathered and gradients reduced in bf16 as the "
    "plan does; the plan keeps an fp32 master copy and Adam state, which the table does not state"
)
# (size, seq, gpus, MFU as printed, micro-batch, accumulation, tokens/s/GPU, activation checkpointing)
A100_40_ROWS: tuple[tuple[str, int, int, str, int, int, int, bool], ...] = (
    ("125m", 2048, 8, "42.75", 26, 3, 136334, False),
    ("350m", 2048, 8, "49.17", 16, 4, 55995, False),
    ("760m", 2048, 8, "52.89", 12, 4, 30173, False),
    ("1b", 2048, 8, "56.23", 8, 8, 19271, False),
    ("1b", 16384, 8, "55.23", 1, 8, 9715, False),
    ("3b", 2048, 8, "57.82", 5, 8, 10065, False),
    ("3b", 8192, 8, "55.13", 1, 8, 7149, False),
    ("7b", 2048, 8, "50.92", 12, 4, 3679, True),
    ("7b", 4096, 8, "50.11", 6, 4, 3366, True),
    ("13b", 2048, 8, "43.94", 4, 16, 1668, True),
    ("13b", 2048, 16, "52.5", 10, 1, 1993, True),
    ("30b", 2048, 32, "51.74", 4, 1, 857, True),
)
