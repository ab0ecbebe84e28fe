"""The sources scripts/bench_published.py looked at and left out, with the reason (its report lists them)."""

from __future__ import annotations

# Sources looked at and left out, with the reason (the report lists them).
LEFT_OUT = (
    "Megatron-LM's current H100 table (NVIDIA/Megatron-LM images/model_table.png @ f2e5db40, read from the image: "
    "1.7B-462B on 48-6144 H100, MFU 41-49%, seq 4096, vocab 131072, heads, hidden, layers, TP, PP, batch and "
    "TFLOP/s per GPU): its 16B row (49%) is the H100 presets' best MFU; its rows are not compared because the "
    "README gives no micro-batch, recomputation, FFN width or attention groups to pin",
    "Megatron-LM's 145B, 310B, 530B and 1T rows (1536-3072 GPUs, 8-64 pipeline stages): left out for search time "
    "(the free search of the 76B row on 1024 GPUs took 13 min on the shared 2-core machine this ran on)",
    "ZeRO-Offload's headline 40 TFLOP/s for 10B on one V100 (arXiv 2101.06840 abstract): no batch size or "
    "sequence length with it; the tutorial's logged run above is used instead",
    "The Elixir paper's GPT-2 tables (arXiv 2212.05339v3, TFLOPS per GPU on 1, 2 and 4 A100): the stored copies "
    "reachable here (ar5iv.labs.arxiv.org/html/2212.05339 and summaries of it) give the abstract and introduction "
    "only, and no repository holds the paper's text; the paper's benchmark code (hpcaitech/Elixir @ e9ccbd9, "
    "example/benchmark: the GPT-2 4B-20B models and scripts) and colossalai/elixir/README.md of hpcaitech/ColossalAI "
    "have no results. The two Colossal-AI sources above (Gemini, the system Elixir grew from, on GPT-2 at seq 1024, "
    "fp16, checkpointed, 1-8 A100, the 'colossalai-gemini' rows in Elixir's own TFLOPS metric) stand in for them",
    "Colossal-AI's Gemini example rows with tensor parallelism (TP 2 and 4, examples/language/gpt/README.md @ "
    "d96cc37e): Colossal's 1D split of transformers' GPT-2 (attention c_attn and c_proj, mlp c_fc and the embeddings column-split, mlp c_proj row-split) "
    "is not a layout a plan can pin (transformers ships no tensor-parallel plan for GPT-2), and the script's "
    "TFLOPS counts the local shard's parameters",
    "ZeRO-Infinity (arXiv 2104.07857; its single-DGX-2 throughput by model size): the paper's text is not reachable "
    "here (abstract pages only); its SC21 slides (microsoft/DeepSpeed docs/assets/files/SC21-ZeRO-Infinity.pdf @ "
    "38327e07) draw the throughput as bar charts with no printed values and give no batch size or sequence "
    "length; a third-party reading note quotes '>40 TFlops/GPU up to 100B on one DGX-2' without a configuration. "
    "DeepSpeed's ZeRO-3 Offload post (docs/_posts/2021-03-08-zero3-offload.md) likewise gives '49 TFlops/GPU' for "
    "1T on 512 V100 with no configuration",
    "Issue 38's search for new rows (the search tool's docs, pages, code and issues corpora): NVIDIA's "
    "Megatron-Bridge and NeMo performance summaries (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @ "
    "00b7660b; NVIDIA/NeMo docs/source/performance/performance_summary.md) give full configurations but every "
    "dense-model row on DGX-H100 is FP8, which no plan computes in; torchtitan's newer tables "
    "(benchmarks/llama3_h100_202412_torchtitan.md tables 2, 4-6; asyncTP_llama3_h100_2025-06 and "
    "llama3_8b_h200_2025-06) run torch.compile, Float8 or context parallelism, or are images; Megatron-Core's "
    "'up to 47% MFU on H100' comes without a configuration; Colossal-AI's LLaMA benchmarks "
    "(examples/language/llama/README.md) are images. llm-foundry's A100 40GB table was the sourced, "
    "expressible set found",
    "ProTrain (arXiv 2406.08334v2, MLSys 2026; RTX 3090 and A100 throughput): only the abstract and introduction of "
    "arxiv.org/html/2406.08334v2 are reachable here (1.43-2.71x over DeepSpeed, Colossal-AI and FSDP; no table of "
    "throughput with configurations); no repository of its authors is in the index, and the third-party "
    "summaries found quote speed-up ranges only. No RTX 3090 preset was added: no row needs it",
)
