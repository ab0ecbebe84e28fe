"""The Colossal-AI sources of scripts/published_setups.py: where their figures are, what they ran.

Two benchmarks by hpcaitech, the authors of Colossal-AI and Elixir, on transformers' GPT-2 at seq 1024
in fp16 with every block checkpointed (the setting of the Elixir paper's GPT-2 tables):

* ``colossalai-pl``: ColossalAI-Pytorch-lightning's benchmark of Gemini and DeepSpeed ZeRO-3 on A100 40GB;
* ``colossalai-gemini``: Colossal-AI's own GPT-2 Gemini example on A100 80GB over PCIe, published in
  TFLOPS per GPU with Elixir's metric (batch x params x seq x 8 / step time).
"""

from __future__ import annotations

COLOSSAL_PL = (
    "hpcaitech/ColossalAI-Pytorch-lightning benchmark/gpt/README.md @ 6a82b8015e06288da507d43f17cd40cc644bff03 "
    "(2022-08-18), table '{table}'; models from benchmark/gpt/model.py, flags from benchmark/gpt/train.py at "
    "the same commit"
)

COLOSSAL_GEMINI = (
    "hpcaitech/ColossalAI examples/language/gpt/README.md @ d96cc37e32d69c7a45ad918fb59623b9fac96c26 (2022-12-28), "
    "'Performance', table '{table}'; models, flags and the TFLOPS formula from examples/language/gpt/model_zoo.py, "
    "run.sh and train_gpt_demo.py at the same commit (the 10B rows first published at 29868a9e, same code path)"
)

COLOSSAL_PL_MISMATCHES = (
    "'A100 (40G)': form factor and interconnect not stated; compared on the a100-40gb-sxm preset (8 on NVSwitch, "
    "rates assumed those of the 80GB SXM part); a PCIe machine would have slower collectives and host links",
    "the README does not say how its step time was taken (3 steps of one epoch; the first step may be counted)",
    "transformers' GPT-2 of 2022: eager attention (the seq x seq scores kept), learned positions, tied head, "
    "vocabulary 50257, random tokens; Lightning's precision 16 modelled as fp16 compute with fp32 master weights",
    "gradient_checkpointing_enable(): every block checkpointed",
)

COLOSSAL_PL_STRATEGY = {
    "ddp": "torch DDP replicates weights, gradients and Adam states (one all-reduce per step, torch.optim.Adam); "
    "the plan shards them in chunks (all-gather + reduce-scatter, the same bytes per step)",
    "zero3": "DeepSpeed ZeRO-3 (FusedAdam) shards per parameter; the plan shards in chunks the search sizes",
    "zero3-offload": "DeepSpeed ZeRO-3 with offload_parameters and offload_optimizer (DeepSpeedCPUAdam): all model "
    "states on the host, modelled as every chunk offloaded (offload 1.0, cache blocks free)",
    "gemini-cuda": "Colossal-AI Gemini, placement_policy 'cuda': every chunk on the GPU (offload 0)",
    "gemini-auto": "Colossal-AI Gemini, placement_policy 'auto' with gpu_margin_mem_ratio 0.9: its runtime memory "
    "tracer moves chunks between host and GPU and puts optimizer states on the GPU in 90% of the spare memory; "
    "the pinned plan leaves the offload share to the search (the best share, which Gemini's tracer need not find)",
}

COLOSSAL_GEMINI_MISMATCHES = (
    "published as TFLOPS per GPU = batch per GPU x params x 1024 x 8 / step time (train_gpt_demo.py get_tflops: "
    "8 = 6 + 2 for the recomputed forward, attention products not counted): tokens/s/GPU = TFLOPS / (8 x params)",
    "the script logs each of its 10 steps with its TFLOPS; which one the README reports is not stated (the "
    "2-GPU and 4-GPU 'cpu' rows at batch 8 show the same 61.354)",
    "testbed '8xA100 (80GB) and 1xAMD EPYC 7543 32-Core Processor (512 GB), GPUs connected via PCI-e': compared "
    "on the a100-80gb-pcie preset, whose compute rates are the a100-40gb-pcie preset's estimates (an assumption)",
    "transformers' GPT-2 of 2022: eager attention (the seq x seq scores kept), learned positions, tied head, "
    "vocabulary 50257, random tokens, fp16 (ColoInitContext dtype half, fp32 master in the optimizer)",
    "gradient_checkpointing_enable(): every block checkpointed",
    "Gemini's chunk size is its own search (hidden_dim 4096, search_range_mb 64); the plan's chunk size, cache "
    "blocks and prefetch are the search's",
)

COLOSSAL_GEMINI_POLICY = {
    "cpu": "placement_policy 'cpu': every chunk (fp16 weights, fp32 master, Adam states) on the host, Adam on the "
    "CPU (GeminiAdamOptimizer): pinned as offload 1.0",
    "auto": "placement_policy 'auto': the runtime memory tracer moves chunks between host and GPU and Adam runs "
    "where each chunk is: the pinned plan leaves the offload share to the search, so it predicts the best share, "
    "which Gemini's policy need not find",
    "const": "placement_policy 'const' with set_const_memory_boundary(10 * 1024): about 10 GiB of chunks stay on "
    "each GPU, the rest on the host: the pinned plan leaves the offload share to the search (the best share)",
}

# ColossalAI-Pytorch-lightning benchmark/gpt/model.py: (hidden, layers, heads) of the models the README ran.
COLOSSAL_PL_MODELS = {"gpt2_xl": (1600, 48, 25), "gpt2_12B": (4096, 60, 16), "gpt2_18B": (4096, 90, 16),
                      "gpt2_24B": (8192, 30, 16)}  # fmt: skip


def gpt2_params(hidden: int, layers: int, vocab: int = 50257, positions: int = 1024) -> int:
    """Parameters of transformers' GPT2LMHeadModel (tied head counted once), as ``model.parameters()`` sums them."""
    return layers * (12 * hidden**2 + 13 * hidden) + (vocab + positions) * hidden + 2 * hidden


# Colossal-AI examples/language/gpt/model_zoo.py: (hidden, layers, heads).
COLOSSAL_GEMINI_MODELS = {"gpt2_10b": (4096, 50, 16), "gpt2_20b": (8192, 25, 16)}

BATCH_TABLE = "How dose Batch Size affect the efficency."
POLICY_TABLE = "How dose the Placement Policy affect the efficency."
TP_TABLE = "How dose the Tensor Parallel Degree affect the efficency."

SCALING = "Model scaling"  # batch size 1 per GPU, seq 1024; figure: step time (sec)
SMALL = "Small model comparison"  # GPT2-XL on 4x A100 (40G); figure: global throughput (samples/sec)
