"""The published training-throughput measurements scripts/bench_published.py compares with.

Each ``Setup`` is one measurement: its source (repository, path, commit, table), the row as quoted,
the configuration it ran and the figure in tokens per second per GPU. Sources:

* ``llm-foundry``: MosaicML's MPT throughput tables (FSDP FULL_SHARD, bf16, flash attention);
* ``torchtitan``: Llama 3.1 8B on H100 (FSDP2, selective activation checkpointing);
* ``megatron``: Megatron-LM's weak-scaling table of GPT 1.7B..1T on Selene (A100 80GB, fp16, tensor
  and pipeline parallelism, full recomputation), Narayanan et al. 2021; the configuration of every
  row from the repository's examples/sc21/run_table_1.sh;
* ``zero-offload``: DeepSpeed's ZeRO-Offload tutorial, a 10B GPT-2 on one V100-SXM3 32GB (optimizer
  on the host), the step time read from the tutorial's training-log screenshot.
* ``colossalai-pl``: hpcaitech's GPT-2 benchmark of Colossal-AI Gemini (the chunk manager Elixir
  grew from) and DeepSpeed ZeRO-3 (with and without offload) on 1, 4 and 8 A100 40GB, fp16, seq 1024,
  every block checkpointed: the setting of the Elixir paper's GPT-2 tables, whose figures are not
  reachable here (``LEFT_OUT``);
* ``colossalai-gemini``: Colossal-AI's GPT-2 Gemini example (0.1.13) on 1, 2 and 4 A100 80GB over PCIe,
  host offload policies 'cpu', 'auto' and 'const', published as TFLOPS per GPU with Elixir's own
  metric (batch x params x seq x 8 / step time).
* ``llm-foundry-40gb``: llm-foundry's A100 40GB table (scripts/published_foundry40.py), added by issue 38
  and held out: no preset rate is fitted to it.

The presets' compute rates were fitted to other rows of the llm-foundry tables only; the
torchtitan, Megatron-LM, ZeRO-Offload and Colossal-AI rows are held out (``Setup.fitted_source``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from published_colossalai import (
    BATCH_TABLE,
    COLOSSAL_GEMINI,
    COLOSSAL_GEMINI_MISMATCHES,
    COLOSSAL_GEMINI_MODELS,
    COLOSSAL_GEMINI_POLICY,
    COLOSSAL_PL,
    COLOSSAL_PL_MISMATCHES,
    COLOSSAL_PL_MODELS,
    COLOSSAL_PL_STRATEGY,
    COLOSSAL_PL_WINDOW,
    GEMINI_20B_FIGURE,
    GEMINI_CUDA_MEMORY,
    GEMINI_HOST_ADAM,
    GEMINI_SYNCHRONOUS,
    POLICY_TABLE,
    SCALING,
    SMALL,
    TP_TABLE,
    gpt2_params,
)
from published_foundry40 import A100_40_MISMATCH, A100_40_ROWS, A100_40_TABLE

LLM_FOUNDRY = (
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 8c8dd48f72168c5d51e2f7b151595892a8fba43d "
    "(2025-07-21), table '{table}'"
)
# torchtitan's H100s: "96GB HBM2e" (TORCHTITAN's 'Hardware' section) read as 96e9 bytes (89.4 GiB), the smaller of
# its two readings, so the usable memory compared with is a lower bound.
H100_96GB_BYTES = 96 * 10**9
TORCHTITAN = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ b5bcd76c66d0acb1a08b176d9639425bc55e0b2a "
    "(torchtitan 9dec370, 2024-12-26), {table}"
)
MEGATRON = (
    "NVIDIA/Megatron-LM README.md and images/cases_april2021.png @ fd5cfec0ba60c5bc14a9667aa9cab10cf9682f40 "
    "(2024-07-12; the table of arXiv 2104.04473, Narayanan et al. 2021), row '{size}'; configuration from "
    "examples/sc21/run_table_1.sh and CONFIG.sh at the same commit"
)
ZERO_OFFLOAD = (
    "microsoft/DeepSpeed docs/_tutorials/zero-offload.md and docs/assets/images/zero_offload_dp1_10B_log.png "
    "@ 38327e07f6cd39b63418f60cedd1651b0be3e7c3 (image of 2020-09-10); launch flags of "
    "microsoft/DeepSpeedExamples Megatron-LM/scripts/ds_zero-offload_10B_pretrain_gpt2_model_parallel.sh "
    "@ 19624a6fa66f35c9e8cc0e8b8f3324911c23bb65"
)
H100_TABLE = "H100 80GB BF16"
A100_TABLE = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
# The rows whose MFU the presets' best_mfu quotes (the plausibility bound): none since issue 38 (the H100
# bound is Megatron-LM's H100 model table, the A100 one FlashAttention-2's run; neither is a row here).
BEST_MFU_ROWS: set[tuple[str, str, int, int]] = set()
# MPT sizes (d_model, n_layers, n_heads) from llm-foundry scripts/train/yamls/pretrain/mpt-<size>.yaml,
# vocabulary 50368, flash attention, expansion ratio 4.
MPT = {
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 12),
    "1b": (2048, 24, 16),
    "3b": (2560, 32, 20),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 48, 56),
    "70b": (8192, 80, 64),
}
MPT_VOCAB = 50368
MPT_MISMATCHES = (
    "MPT modelled as a GPT-2 of its width/depth/heads (learned positions and biases instead of ALiBi and no bias: "
    "<0.1% of parameters), with MPT's activations: no dropout masks, the fused cross-entropy's bf16 logits only",
    "FSDP's per-block units modelled by chunks the search sizes (chunk size and prefetch free), 2 gathered at once: "
    "FULL_SHARD with one unit prefetched gathers every unit again in each micro-batch's forward and backward",
    "llm-foundry's amp_bf16 keeps fp32 master weights like the engine",
)
TITAN_MISMATCHES = (
    "torchtitan's H100s are 96 GB HBM2e SXM at 500 W (2.4 TB/s): h100-80gb-sxm's rates (700 W), its memory 96 GB",
    "selective (per-op) activation checkpointing pinned as the plan's selective mode, torchtitan's op-level policy "
    "(every other matmul and the attention output kept: elixir_tune/selective_checkpoint.py)",
    "FSDP2's per-block units modelled by chunks the search sizes, 2 gathered at once: reshard_after_forward "
    "gathers every block again in backward",
)
MEGATRON_MISMATCHES = (
    "published as TFLOP/s per GPU counting the recomputed forward (arXiv 2104.04473 eq. 3: "
    "96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step): tokens/s/GPU = TFLOP/s / (96 l h^2 (1 + s/6h + V/16lh))",
    "Megatron's data parallelism replicates weights and optimizer (torch/local DDP, one all-reduce per step); "
    "the plan's data parallelism shards them in chunks (all-gather + reduce-scatter, the same bytes per step)",
    "GPT with learned positions, biases and a tied head as in the GPT-2 profile; vocabulary 51200 as run",
    "no fused/flash attention in 2021: the seq x seq scores are kept (modelled so)",
)
# Under tensor parallelism only.
MEGATRON_VOCAB_LOSS = (
    "Megatron's vocabulary-parallel cross-entropy gathers no logits; the engine gathers the vocabulary-split "
    "logits whole before the model's loss (one all-gather of micro-batch x seq x vocab per micro-batch on the "
    "last stage, priced): a cost Megatron does not pay"
)
MEGATRON_PIPELINE = (
    "Megatron's 1F1B pipeline schedule (one run of {per_stage} consecutive layers per stage) pinned as the plan's "
    "contiguous assignment with schedule 1f1b: GPipe's bubble, (P - 1) / (N + P - 1) of the step, stage s holding "
    "at most P - s micro-batches' activations"
)
MEGATRON_INTERLEAVED = (
    "Megatron's interleaved 1F1B ({virtual} layers per virtual stage, {runs} per rank: bubble (P - 1) / (v N + P - 1) "
    "= {bubble:.1%} of the step) has no plan form: the plan's modular assignment runs one block per virtual stage "
    "({modular:.1%}), its contiguous one a run per stage ({contiguous:.1%}); pinned contiguous with schedule 1f1b: "
    "its memory is 1F1B's (stage s holds at most P - s micro-batches' activations, about what interleaving holds), "
    "where the modular plan's looped schedule holds all {micro_batches} (predicted 173 GiB, refused though it ran); "
    "its bubble is the larger, so the pinned time errs slow"
)
# The H100 and A100 80GB tables' 'MP Mode' DEFAULT (the A100 40GB table ran PURE).
MPT_DEFAULT_GATHER = (
    "MP Mode DEFAULT: Composer's FSDP mixed precision of the tables' time (mosaicml/composer "
    "composer/trainer/dist_strategy.py get_mixed_precision, Composer 0.12-0.14: param_dtype float32, reduce_dtype bf16, buffer_dtype "
    "float32) gathers the parameters in fp32: the pinned plan's all-gathers move twice its bf16 bytes "
    "(bench_published.peer_links)"
)
ZERO_OFFLOAD_MISMATCHES = (
    "the micro-batch per step from the log itself: SamplesPerSec 0.386 x 25.8 s per iteration = 10 samples, "
    "the tutorial's --batch-size 10 (no accumulation)",
    "ZeRO-2 Offload keeps the fp16 weights on the GPU and offloads gradients and optimizer (Adam on the host); "
    "the pinned plan offloads every chunk's shards and caches them back (cache blocks free)",
    "DeepSpeed's activation checkpoints are partitioned and kept in host memory (cpu_checkpointing); "
    "the plan keeps them on the GPU",
    "vocabulary 50257 (GPT-2 BPE; Megatron pads it to a multiple of 128)",
)


@dataclass(frozen=True)
class Setup:
    """One published measurement and the configuration it ran.

    Attributes:
        name: short label.
        source: where the figure is (repository, path, commit, table).
        source_key: which source family the setup belongs to (the ``--sources`` filter).
        row: the published row as quoted (the columns that matter).
        model: a model YAML under configs/models, or a label when ``gpt`` is given.
        hardware: the preset the setup is compared on.
        gpus_per_node: GPUs per node.
        nodes: nodes.
        seq_len: tokens per sample.
        micro_batch_size: samples per micro-batch per GPU.
        grad_accum_steps: micro-batches per step (per pipeline: the pipeline's micro-batches).
        checkpointing: "all", "none", "every:<k>" or "selective" (torchtitan's op-level policy, every block).
        tokens_per_s_per_gpu: the published figure (tokens per second per GPU).
        gpt: (hidden, layers, heads, vocab, flash attention) of a GPT-2-shaped model, None when
            ``model`` names a YAML.
        transformers: the peer ran transformers' ``GPT2LMHeadModel`` of the ``gpt`` shape (config
            defaults otherwise: its GELU written op by op, dropout 0.1, eager attention): the model
            is profiled from it as a user's would be, its pointwise ops counted, not analytically.
        dtype: compute dtype.
        tensor: tensor-parallel degree the peer ran.
        pipeline: pipeline stages the peer ran.
        assignment: the plan's assignment of blocks to stages that matches the peer's schedule best
            (``contiguous``: one run of layers per stage, as 1F1B; ``modular``: one block per virtual stage).
        schedule: the plan's pipeline schedule (``1f1b`` where the peer ran plain 1F1B).
        offload: share of the shards on the host in the pinned plan (None: the search picks).
        prefetch: chunks fetched ahead in the pinned plan (None: the search picks; 0: each fetch is
            issued at its own step, so the compute waits for it, as in a runtime that fetches
            synchronously).
        cache_blocks: gathered chunks held at once in the pinned plan (None: the search picks; "all":
            every gathered chunk stays on the device).
        first_step_in_window: the published figure averages a window that includes the run's first
            training step (its one-time costs), so it is not a steady-state step, which is what the
            model predicts: reported in a separate class (``bench_published.summary``).
        printed_twice: the source prints the same figure for this run and for a different one, so it
            cannot be told which run it measured: out of scope like ``first_step_in_window`` (issue 38).
        mismatches: what the pinned plan cannot express.
        defines_bound: the row is the best MFU published for its hardware, which the preset's
            ``best_mfu`` (the plausibility bound) quotes: its prediction is not independent.
        fitted_source: the preset's rates were fitted to other rows of the same table.
        mpt: the model is llm-foundry's MPT: no dropout (``MPTConfig``'s pdrops default to 0) and
            flash-attn's fused cross-entropy (``loss_fn`` default ``fused_crossentropy``), which the
            GPT-2 stand-in profile counts (``gpt2_profile(dropout=False, fused_loss=True)``).
        card_memory_bytes: the memory of the peer's cards where the preset's differs (its rates borrowed:
            ``published_peer_models.card_memory``); None: the preset's.
        gather_width: the peer's all-gather bytes per parameter over the plan's (2: llm-foundry's MP Mode
            DEFAULT gathers fp32 parameters where the plan gathers bf16); the pinned plan moves them
            (``bench_published.peer_links``).
    """

    name: str
    source: str
    source_key: str
    row: str
    model: str
    hardware: str
    gpus_per_node: int
    nodes: int
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    checkpointing: str
    tokens_per_s_per_gpu: float
    gpt: tuple[int, int, int, int, bool] | None = None
    dtype: str = "bf16"
    tensor: int = 1
    pipeline: int = 1
    assignment: str = "modular"
    schedule: str = "looped_bfs"
    offload: float | None = 0.0
    prefetch: int | None = None
    cache_blocks: int | str | None = None
    first_step_in_window: bool = False
    printed_twice: bool = False
    mismatches: tuple[str, ...] = ()
    defines_bound: bool = False
    fitted_source: bool = False
    transformers: bool = False
    mpt: bool = False
    card_memory_bytes: int | None = None
    gather_width: float = 1.0

    @property
    def gpus(self) -> int:
        """All GPUs of the setup."""
        return self.gpus_per_node * self.nodes

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all GPUs."""
        return self.micro_batch_size * self.grad_accum_steps * self.gpus // (self.tensor * self.pipeline)


def _foundry(table: str, size: str, seq: int, gpus: int, mfu: str, micro: int, accum: int, tps: int, ckpt: bool):
    hardware = {H100_TABLE: "h100-80gb-sxm", A100_40_TABLE: "a100-40gb-sxm"}.get(table, "a100-80gb-sxm")
    card = "_".join(hardware.split("-")[:2])
    row = (
        f"| {size} | {seq} | {gpus} | {card} | MFU {mfu} | "
        f"micro {micro} | accum {accum} | {tps} T/s/GPU | FULL_SHARD | checkpointing {ckpt} |"
    )
    hidden, layers, heads = MPT[size]
    held_out = table == A100_40_TABLE
    return Setup(
        name=f"MPT-{size} s{seq} {gpus}x{hardware.split('-')[0].upper()}" + ("-40G" if held_out else ""),
        source=LLM_FOUNDRY.format(table=table),
        source_key="llm-foundry-40gb" if held_out else "llm-foundry",
        row=row,
        model=f"mpt-{size}",
        gpt=(hidden, layers, heads, MPT_VOCAB, True),
        hardware=hardware,
        gpus_per_node=min(gpus, 8),
        nodes=max(1, gpus // 8),
        seq_len=seq,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        checkpointing="all" if ckpt else "none",
        tokens_per_s_per_gpu=float(tps),
        mismatches=MPT_MISMATCHES[:2] + (A100_40_MISMATCH,) if held_out else MPT_MISMATCHES + (MPT_DEFAULT_GATHER,),
        defines_bound=(table, size, seq, gpus) in BEST_MFU_ROWS,
        fitted_source=not held_out,
        mpt=True,
        gather_width=1.0 if held_out else 2.0,
        cache_blocks=2,
    )


def megatron_tokens_per_s(
    tflops_per_gpu: float, layers: int, hidden: int, seq: int = 2048, vocab: int = 51200
) -> float:
    """Tokens/s per GPU from Megatron-LM's TFLOP/s per GPU (arXiv 2104.04473 eq. 3, recomputation counted)."""
    flops_per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return tflops_per_gpu * 1e12 / flops_per_token


def _megatron(size: str, hidden: int, layers: int, heads: int, tp: int, pp: int, micro: int, batch: int,
              gpus: int, tflops: int, percent: int, virtual: int = 0) -> Setup:  # fmt: skip
    data = gpus // (tp * pp)
    micro_batches = batch // (micro * data)
    pipeline: tuple[str, ...] = ()
    if pp > 1 and virtual:
        runs = layers // (pp * virtual)
        pipeline = (
            MEGATRON_INTERLEAVED.format(
                virtual=virtual,
                runs=runs,
                bubble=(pp - 1) / (runs * micro_batches + pp - 1),
                modular=(pp - 1) / (layers // pp * micro_batches + pp - 1),
                contiguous=(pp - 1) / (micro_batches + pp - 1),
                micro_batches=micro_batches,
            ),
        )
    elif pp > 1:
        pipeline = (MEGATRON_PIPELINE.format(per_stage=layers // pp),)
    return Setup(
        name=f"Megatron GPT-{size} {gpus}xA100 (t{tp} p{pp})",
        source=MEGATRON.format(size=size),
        source_key="megatron",
        row=(
            f"| {size} | hidden {hidden} | layers {layers} | model-parallel {tp * pp} | {gpus} GPUs | batch {batch} | "
            f"{tflops} TFLOP/s per GPU | {percent}% of peak |; run_table_1.sh: TP={tp} PP={pp} MBS={micro} "
            f"GBS={batch} NAH={heads}, --activations-checkpoint-method uniform, --fp16, --seq-length 2048"
        ),
        model=f"megatron-gpt-{size.lower()}",
        gpt=(hidden, layers, heads, 51200, False),
        hardware="a100-80gb-sxm",
        gpus_per_node=8,
        nodes=gpus // 8,
        seq_len=2048,
        micro_batch_size=micro,
        grad_accum_steps=micro_batches,
        checkpointing="all",
        tokens_per_s_per_gpu=megatron_tokens_per_s(tflops, layers, hidden),
        dtype="fp16",
        tensor=tp,
        pipeline=pp,
        # A pipeline, interleaved or not, is pinned as 1F1B over contiguous runs (MEGATRON_INTERLEAVED says why).
        assignment="contiguous" if pp > 1 else "modular",
        schedule="1f1b" if pp > 1 else "looped_bfs",
        mismatches=MEGATRON_MISMATCHES + ((MEGATRON_VOCAB_LOSS,) if tp > 1 else ()) + pipeline,
    )


def _colossal_pl(model: str, gpus: int, strategy: str, micro: int, tokens_per_s_per_gpu: float, table: str,
                 row: str) -> Setup:  # fmt: skip
    hidden, layers, heads = COLOSSAL_PL_MODELS[model]
    label = {"ddp": "DDP", "zero3": "ZeRO-3", "zero3-offload": "ZeRO-3 offload", "gemini-cuda": "Gemini cuda",
             "gemini-auto": "Gemini auto"}[strategy]  # fmt: skip
    offload = {"zero3-offload": 1.0, "gemini-auto": None}.get(strategy, 0.0)
    gemini = strategy.startswith("gemini")
    return Setup(
        name=f"GPT-2 {model.removeprefix('gpt2_').upper()} {gpus}xA100-40G ({label})",
        source=COLOSSAL_PL.format(table=table),
        source_key="colossalai-pl",
        row=row,
        model=f"colossalai-pl-{model.replace('_', '-').lower()}",
        gpt=(hidden, layers, heads, 50257, False),
        transformers=True,
        hardware="a100-40gb-sxm",
        gpus_per_node=gpus,
        nodes=1,
        seq_len=1024,
        micro_batch_size=micro,
        grad_accum_steps=1,
        checkpointing="all",
        tokens_per_s_per_gpu=tokens_per_s_per_gpu,
        dtype="fp16",
        offload=offload,
        prefetch=0 if gemini else None,
        first_step_in_window=table == SCALING,
        mismatches=COLOSSAL_PL_MISMATCHES
        + (COLOSSAL_PL_WINDOW[table], COLOSSAL_PL_STRATEGY[strategy])
        + ((GEMINI_SYNCHRONOUS,) if gemini else ()),
    )


def _colossal_gemini(model: str, gpus: int, policy: str, batch: int, tflops: str, table: str) -> Setup:
    hidden, layers, heads = COLOSSAL_GEMINI_MODELS[model]
    return Setup(
        name=f"GPT-2 {model.removeprefix('gpt2_').upper()} {gpus}xA100-80G-PCIe (Gemini {policy}, batch {batch})",
        source=COLOSSAL_GEMINI.format(table=table),
        source_key="colossalai-gemini",
        row=f"| {model} | {gpus} | {policy} | 1 | {batch} | {tflops} | (model, #GPU, policy, TP, batch per DP, Tflops); "
        f"torchrun --nproc_per_node={gpus} train_gpt_demo.py --tp_degree=1 --model_type={model} --batch_size={batch} "
        f"--placement {policy} --distplan colossalai",
        model=f"colossalai-gemini-{model.replace('_', '-')}",
        gpt=(hidden, layers, heads, 50257, False),
        transformers=True,
        hardware="a100-80gb-pcie",
        gpus_per_node=gpus,
        nodes=1,
        seq_len=1024,
        micro_batch_size=batch,
        grad_accum_steps=1,
        checkpointing="all",
        tokens_per_s_per_gpu=float(tflops) * 1e12 / (8 * gpt2_params(hidden, layers)),
        dtype="fp16",
        offload=1.0,  # every policy but 'cuda' keeps the fp32 chunks and Adam on the host (GEMINI_HOST_ADAM)
        prefetch=0,
        cache_blocks="all" if policy == "auto" else None,
        printed_twice=model == "gpt2_20b",  # GEMINI_20B_FIGURE: the README prints 43.102 for two runs
        mismatches=COLOSSAL_GEMINI_MISMATCHES
        + (GEMINI_HOST_ADAM, GEMINI_SYNCHRONOUS, COLOSSAL_GEMINI_POLICY[policy])
        + ((GEMINI_20B_FIGURE,) if model == "gpt2_20b" else ()),
    )


PUBLISHED: tuple[Setup, ...] = (
    _foundry(H100_TABLE, "760m", 2048, 8, "34.9", 24, 2, 63147, False),
    _foundry(H100_TABLE, "1b", 2048, 8, "41.82", 14, 1, 45455, False),
    _foundry(H100_TABLE, "1b", 32768, 8, "33.54", 1, 4, 12025, False),
    _foundry(H100_TABLE, "3b", 2048, 16, "43.73", 10, 3, 24142, False),
    _foundry(H100_TABLE, "3b", 8192, 8, "40.31", 3, 6, 16578, False),
    _foundry(H100_TABLE, "7b", 2048, 8, "46.44", 6, 1, 10643, False),
    _foundry(H100_TABLE, "7b", 4096, 8, "40.42", 16, 2, 8611, True),
    _foundry(H100_TABLE, "13b", 2048, 8, "39.79", 2, 1, 4792, False),
    _foundry(H100_TABLE, "13b", 4096, 8, "41.6", 10, 3, 4717, True),
    _foundry(H100_TABLE, "30b", 2048, 8, "38.11", 3, 21, 2002, True),
    _foundry(H100_TABLE, "70b", 2048, 64, "42.57", 8, 4, 1039, True),
    _foundry(A100_TABLE, "125m", 2048, 8, "44.79", 40, 2, 142830, False),
    _foundry(A100_TABLE, "350m", 2048, 8, "51.62", 32, 2, 58782, False),
    _foundry(A100_TABLE, "1b", 2048, 8, "59.86", 14, 4, 20513, False),
    _foundry(A100_TABLE, "3b", 2048, 8, "62.11", 10, 2, 10811, False),
    _foundry(A100_TABLE, "7b", 2048, 8, "64.23", 6, 2, 4641, False),
    _foundry(A100_TABLE, "7b", 16384, 8, "51.96", 4, 2, 2453, True),
    _foundry(A100_TABLE, "13b", 4096, 8, "57.62", 10, 3, 2060, True),
    Setup(
        name="Llama-3.1-8B s8192 8xH100 (torchtitan FSDP)",
        source=TORCHTITAN.format(table="Table 1, row 'FSDP'"),
        source_key="torchtitan",
        row="| FSDP | 5,762 | 82.4 | (TPS/GPU, Memory GiB); 8 GPUs, local batch 2, global 16, selective AC",
        model="llama3-8b",
        hardware="h100-80gb-sxm",
        gpus_per_node=8,
        nodes=1,
        seq_len=8192,
        micro_batch_size=2,
        grad_accum_steps=1,
        checkpointing="selective",
        tokens_per_s_per_gpu=5762.0,
        mismatches=TITAN_MISMATCHES,
        card_memory_bytes=H100_96GB_BYTES,
        cache_blocks=2,
    ),
    Setup(
        name="Llama-3.1-8B s8192 128xH100 (torchtitan FSDP)",
        source=TORCHTITAN.format(table="Table 3, row 'FSDP'"),
        source_key="torchtitan",
        row="| FSDP | 5,605 | 67.0 | (TPS/GPU, Memory GiB); 128 GPUs, local batch 2, global 256, selective AC",
        model="llama3-8b",
        hardware="h100-80gb-sxm",
        gpus_per_node=8,
        nodes=16,
        seq_len=8192,
        micro_batch_size=2,
        grad_accum_steps=1,
        checkpointing="selective",
        tokens_per_s_per_gpu=5605.0,
        mismatches=TITAN_MISMATCHES,
        card_memory_bytes=H100_96GB_BYTES,
        cache_blocks=2,
    ),
    # Megatron-LM, the 2021 table (images/cases_april2021.png): size, hidden, layers, heads (NAH), TP, PP,
    # MBS, GBS, GPUs, TFLOP/s per GPU, % of peak; the 145B..1T rows (1536-3072 GPUs) are left out (LEFT_OUT).
    _megatron("1.7B", 2304, 24, 24, 1, 1, 16, 512, 32, 137, 44),
    _megatron("3.6B", 3072, 30, 32, 2, 1, 16, 512, 64, 138, 44),
    _megatron("7.5B", 4096, 36, 32, 4, 1, 16, 512, 128, 142, 46),
    _megatron("18B", 6144, 40, 48, 8, 1, 8, 1024, 256, 135, 43),
    _megatron("39B", 8192, 48, 64, 8, 2, 4, 1536, 512, 138, 44),
    _megatron("76B", 10240, 60, 80, 8, 4, 2, 1792, 1024, 140, 45, virtual=5),
    Setup(
        name="GPT-2 10B 1xV100 (ZeRO-Offload)",
        source=ZERO_OFFLOAD,
        source_key="zero-offload",
        row=(
            "iteration 9/100000 | elapsed time per iteration (ms): 26756.4 | ... SamplesPerSec=0.3864251749565585; "
            "--num-layers 50 --hidden-size 4096 --num-attention-heads 32 --batch-size 10 --seq-length 1024 "
            "--checkpoint-activations --fp16 --cpu-optimizer, ZeRO stage 2 cpu_offload, one V100-SXM3 32GB"
        ),
        model="gpt2-10b-zero-offload",
        gpt=(4096, 50, 32, 50257, False),
        hardware="v100-32gb-sxm3",
        gpus_per_node=1,
        nodes=1,
        seq_len=1024,
        micro_batch_size=10,
        grad_accum_steps=1,
        checkpointing="all",
        tokens_per_s_per_gpu=0.3864251749565585 * 1024,
        dtype="fp16",
        offload=1.0,
        mismatches=ZERO_OFFLOAD_MISMATCHES,
    ),
    # ColossalAI-Pytorch-lightning: tokens/s per GPU = 1024 tokens per GPU / step time (model scaling), or
    # samples/s x 1024 / 4 GPUs (small model comparison).
    _colossal_pl(
        "gpt2_18B",
        1,
        "zero3-offload",
        1,
        1024 / 39.32,
        SCALING,
        row="| deepspeed (zero3 offload) | 1 | 18 | 5699.500 | 39.32 | (GPUs, max model size (B), max CUDA MB, step "
        "time (sec)); python train.py --epochs 1 --steps_per_epoch 3 --model gpt2_18B --strategy deepspeed --offload",
    ),
    _colossal_pl(
        "gpt2_24B",
        1,
        "gemini-auto",
        1,
        1024 / 69.54,
        SCALING,
        row="| colssalai (auto) | 1 | 24 | 36483.311 | 69.54 |; python train.py --epochs 1 --steps_per_epoch 3 "
        "--model gpt2_24B --strategy colossal --placement_policy auto --opt_gpu_margin_rat 0.9",
    ),
    _colossal_pl(
        "gpt2_12B",
        8,
        "zero3",
        1,
        1024 / 9.06,
        SCALING,
        row="| deepspeed (zero3) | 8 | 12 | 29751.203 | 9.06 |; python train.py --epochs 1 --steps_per_epoch 3 "
        "--model gpt2_12B --strategy deepspeed --np 8",
    ),
    _colossal_pl(
        "gpt2_12B",
        8,
        "gemini-cuda",
        1,
        1024 / 7.07,
        SCALING,
        row="| colssalai (cuda) | 8 | 12 | 24504.032 | 7.07 |; python train.py --epochs 1 --steps_per_epoch 3 "
        "--model gpt2_12B --strategy colossal --np 8",
    ),
    _colossal_pl(
        "gpt2_xl",
        4,
        "ddp",
        6,
        11.76 * 1024 / 4,
        SMALL,
        row="| ddp (AMP) | 24 | 11.76 | 37905.422 | (global batch, samples/sec, max CUDA MB); python train.py --np 4 "
        "--batch_size 6",
    ),
    _colossal_pl(
        "gpt2_xl",
        4,
        "zero3",
        40,
        18.18 * 1024 / 4,
        SMALL,
        row="| deepspeed (zero3) | 160 | 18.18 | 25360.968 |; python train.py --np 4 --strategy deepspeed --batch_size 40",
    ),
    _colossal_pl(
        "gpt2_xl",
        4,
        "gemini-cuda",
        40,
        19.36 * 1024 / 4,
        SMALL,
        row="| colssalai (cuda) | 160 | 19.36 | 24003.394 |; python train.py --np 4 --strategy colossal --batch_size 40",
    ),
    # Colossal-AI's Gemini GPT-2 example, the rows without tensor parallelism (TP 1), figures as printed.
    _colossal_gemini("gpt2_10b", 2, "cpu", 32, "122.046", BATCH_TABLE),
    _colossal_gemini("gpt2_10b", 2, "cpu", 16, "82.649", BATCH_TABLE),
    _colossal_gemini("gpt2_10b", 2, "cpu", 8, "61.354", BATCH_TABLE),
    _colossal_gemini("gpt2_10b", 4, "auto", 8, "88.657", POLICY_TABLE),
    _colossal_gemini("gpt2_10b", 4, "cpu", 8, "61.354", POLICY_TABLE),
    _colossal_gemini("gpt2_10b", 4, "const", 8, "82.137", POLICY_TABLE),
    _colossal_gemini("gpt2_20b", 1, "cpu", 8, "43.102", TP_TABLE),
    # Issue 38's new rows: llm-foundry's A100 40GB table (scripts/published_foundry40.py), held out.
    *(_foundry(A100_40_TABLE, *row) for row in A100_40_ROWS),
)
SOURCE_KEYS = tuple(dict.fromkeys(setup.source_key for setup in PUBLISHED))
# Published configurations that ran out of memory: a plan pinned to them must be refused (issue 38).
# Colossal-AI's Gemini example, 'How dose the Placement Policy affect the efficency.': gpt2_10b, 4 GPUs,
# policy cuda, TP 1, batch 8: "OOM". 'cuda' keeps the fp32 master and Adam on the GPU (offload 0) and every
# fp16 chunk gathered from its first use to its reduction (cache all).
_GEMINI_CUDA = _colossal_gemini("gpt2_10b", 4, "cuda", 8, "0", POLICY_TABLE)
_GEMINI_20B_64 = _colossal_gemini("gpt2_20b", 4, "cpu", 64, "0", "Touch the bar of model scale and batch size.")
FAILED: tuple[Setup, ...] = (
    dataclasses.replace(
        _GEMINI_CUDA,
        row="| gpt2_10b | 4 | cuda | 1 | 8 | OOM |",
        mismatches=(*(text for text in _GEMINI_CUDA.mismatches if text != GEMINI_HOST_ADAM), GEMINI_CUDA_MEMORY),
        tokens_per_s_per_gpu=0.0,
        offload=0.0,
        cache_blocks="all",
    ),
    # The same README, 'Touch the bar of model scale and batch size.': gpt2_20b, 4 GPUs, policy cpu, TP 1, batch 64:
    # "CUDA OOM" (added by issue 38 and predicted before any change looked at it: refused, 112.5 GiB).
    dataclasses.replace(
        _GEMINI_20B_64,
        row="| gpt2_20b | 4 | cpu | 1 | 64 | CUDA OOM |",
        tokens_per_s_per_gpu=0.0,
        printed_twice=False,
        mismatches=tuple(text for text in _GEMINI_20B_64.mismatches if text != GEMINI_20B_FIGURE),
    ),
)
