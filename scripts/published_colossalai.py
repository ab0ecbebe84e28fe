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

SCALING = "Model scaling"  # batch size 1 per GPU, seq 1024; figure: step time (sec)
SMALL = "Small model comparison"  # GPT2-XL on 4x A100 (40G); figure: global throughput (samples/sec)

COLOSSAL_PL_MISMATCHES = (
    "'A100 (40G)': form factor and interconnect not stated; compared on the a100-40gb-sxm preset (8 on NVSwitch, "
    "rates assumed those of the 80GB SXM part); a PCIe machine would have slower collectives and host links",
    "transformers' GPT-2 of 2022: eager attention (the seq x seq scores kept), learned positions, tied head, "
    "vocabulary 50257, random tokens; Lightning's precision 16 modelled as fp16 compute with fp32 master weights",
    "gradient_checkpointing_enable(): every block checkpointed",
)

COLOSSAL_PL_STRATEGY = {
    "ddp": "torch DDP with Lightning's precision 16 (native AMP), DDPStrategy(static_graph=True) and torch.optim."
    "Adam: fp32 weights, gradients and Adam states replicated on every GPU, the fp32 gradients all-reduced (twice "
    "the bytes of the plan's fp16 reduce-scatter and all-gather; hidden under the backward on NVSwitch), autocast "
    "casting the weights at every matmul; the plan shards fp16 chunks with an fp32 master (a replicated optimizer "
    "and autocast are no plan form). Priced by bytes at the preset's 1340 GB/s (a diagnosis, not in the model): "
    "the replicated unfused Adam and the gradient unscale, about 92 B per element x 1.56e9 = 0.107 s against the "
    "plan's 0.011 s; transformers' GPT2Model casts the attention mask to the parameters' dtype (fp32 under AMP), so "
    "the scores are fp32 from the mask add to the cast back to fp16 before the dropout: about +42 B per score "
    "element (forward, recomputation, backward) x 1.26e9 per sample = 0.039 s per sample, 0.24 s per step of 6; "
    "the weight casts about 0.02 s. Together about 0.35 s of the 0.84 s between the predicted 1.20 s step and "
    "the published 2.04 s (1.31x with them); the rest is not explained here",
    "zero3": "DeepSpeed ZeRO-3 (FusedAdam) shards per parameter; the plan shards in chunks the search sizes",
    "zero3-offload": "DeepSpeed ZeRO-3 with offload_parameters and offload_optimizer (DeepSpeedCPUAdam): all model "
    "states on the host, modelled as every chunk offloaded (offload 1.0, cache blocks free)",
    "gemini-cuda": "Colossal-AI Gemini, placement_policy 'cuda': every chunk on the GPU (offload 0); Gemini 0.1.9 "
    "(Aug 2022) scatters a chunk again at the op after its use (ChunkManager.exec_lazy_release), so it gathers "
    "each chunk at every use; the plan's cache is the search's (a larger one gathers less)",
    "gemini-auto": "Colossal-AI Gemini, placement_policy 'auto' with gpu_margin_mem_ratio 0.9: the fp32 chunks "
    "start on the host and ZeroOptimizer moves them to the GPU only into 90% of the memory the warm-up iteration "
    "left spare (none here: the fp16 weights alone, 48 GB, exceed the 40 GB card), the fp16 chunks move by its "
    "runtime tracer; the pinned plan leaves the offload share to the search (the best share)",
}

# Gemini at the versions used (colossalai/zero/utils/zero_hook_v2.py @ bbc58d88, 2022-08-18, 0.1.9, for the
# Lightning rows; colossalai/zero/utils/gemini_hook.py @ d96cc37e for the example's rows): GeminiZeROHook.pre_op
# calls adjust_layout and access_chunk (host->device move and all-gather) for an op's chunks when the op
# starts, on the compute stream, and ZeroDDP.grad_handle reduces a chunk and moves it to its gradient
# device as the gradient arrives: no prefetch, nothing overlapped.
GEMINI_SYNCHRONOUS = (
    "Gemini fetches each op's chunks when the op starts, on the compute stream, with no prefetch (GeminiZeROHook."
    "pre_op: adjust_layout, access_chunk): pinned as prefetch 0 (each fetch waits for nothing ahead of it and the "
    "compute waits for it); its reduce-scatters and gradient copies to the host (ZeroDDP.grad_handle) are also "
    "synchronous, which a plan cannot pin: the model overlaps them with the backward"
)

# colossalai/nn/parallel/data_parallel.py @ d96cc37e: ZeroDDP registers fp16 and fp32 chunks with
# cpu_offload = (placement policy != 'cuda'), so the fp32 chunks (master) are closed on the host, and
# nn/optimizer/zero_optimizer.py moves them to the GPU only when gpu_margin_mem_ratio > 0 with 'auto';
# train_gpt_demo.py builds GeminiAdamOptimizer(model, lr=1e-3, initial_scale=2**5): the ratio's default 0.0.
GEMINI_HOST_ADAM = (
    "with every placement policy but 'cuda' Gemini keeps the fp32 master and Adam states on the host and runs "
    "HybridAdam there for every parameter (ZeroDDP: cpu_offload = policy != 'cuda'; ZeroOptimizer moves fp32 "
    "chunks to the GPU only with gpu_margin_mem_ratio > 0, which train_gpt_demo.py leaves at 0.0): pinned as "
    "offload 1.0; the policies differ in where the fp16 weights stay between uses"
)

COLOSSAL_GEMINI_MISMATCHES = (
    "published as TFLOPS per GPU = batch per GPU x params x 1024 x 8 / step time (train_gpt_demo.py get_tflops: "
    "8 = 6 + 2 for the recomputed forward, attention products not counted): tokens/s/GPU = TFLOPS / (8 x params)",
    "the script logs each of its 10 steps with its TFLOPS; which one the README reports is not stated (the "
    "2-GPU and 4-GPU 'cpu' rows at batch 8 show the same 61.354)",
    "testbed '8xA100 (80GB) and 1xAMD EPYC 7543 32-Core Processor (512 GB), GPUs connected via PCI-e': compared "
    "on the a100-80gb-pcie preset, whose compute rates are the a100-40gb-pcie preset's (the a100-80gb-sxm "
    "preset's block curves and attention rate x 200/230, the ratio of the boards' matmul estimates: an assumption)",
    "transformers' GPT-2 of 2022: eager attention (the seq x seq scores kept), learned positions, tied head, "
    "vocabulary 50257, random tokens, fp16 (ColoInitContext dtype half, fp32 master in the optimizer)",
    "gradient_checkpointing_enable(): every block checkpointed",
    "Gemini's chunk size is its own search (hidden_dim 4096, search_range_mb 64); the plan's chunk size, cache "
    "blocks and prefetch are the search's",
)

# What the host-Adam placement leaves of the published 'auto' and 'const' steps (a diagnosis, not in the
# model): the room left for HybridAdam on the host once the model's compute and synchronous fetches are
# taken away, against what the testbed's DRAM can move (AMD's EPYC 7543 datasheet: 8 channels DDR4-3200).
GEMINI_HOST_ROOM = (
    "With that placement the published step ({step} s) leaves {room} s for Adam over 10.28e9 elements on "
    "the host after the model's compute with recomputation (5.58 s) and its synchronous fetches (1.40 s): "
    "{rate} elements/s, above the preset's 1.8e9/s and the 7.3e9/s that 204.8 GB/s moves at 28 B per element "
    "(AMD's EPYC 7543 datasheet: at most 8 channels of DDR4-3200; the README names one such CPU with 512 GB, "
    "not how its memory is populated). Elixir's own search assumes host Adam at (1.66 ln n + 5.15)e9 elements/s "
    "with n ranks (colossalai/elixir/search/simulator.py @ 206280408; its machine and units are not stated): at "
    "that rate this row predicts {elixir}x, and the six 10B rows 0.83-1.11x when the 'cpu' rows also upload each "
    "chunk again at every use as that policy does (0.87-1.30x with the search's cache), but the 1-GPU 20B row "
    "1.76-1.96x (scripts/published_gemini_host.py --cpu-cache 2, in git at 4ecf109). A rate with no stated "
    "machine is not put in the preset: unchanged, nothing fitted"
)

COLOSSAL_GEMINI_POLICY = {
    "cpu": "placement_policy 'cpu': CPUPlacementPolicy.evict_tensors moves every fp16 chunk not in use back to "
    "the host, so each use (forward, recomputation, backward) uploads it again; the plan's cache is the search's "
    "(a larger one uploads each shard once per step)",
    "auto": "placement_policy 'auto': AutoPlacementPolicy evicts fp16 chunks only when the model data would "
    "exceed 0.9 x the GPU's memory less the traced non-model data; the fp16 weights are 20.6 GB of 80 GB, so after "
    "the warm-up step they all stay gathered on the GPU: pinned as cache_blocks all. "
    + GEMINI_HOST_ROOM.format(step=7.60, room=0.62, rate="1.7e10", elixir="0.90"),
    "cuda": "placement_policy 'cuda': the fp32 master, Adam states and fp16 chunks all on the GPU (offload 0, "
    "ZeroDDP's cpu_offload False), each fp16 chunk kept gathered from its first use to its reduction: pinned as "
    "cache_blocks all",
    "const": "placement_policy 'const' with set_const_memory_boundary(10 * 1024): ConstPlacementPolicy keeps "
    "gathered fp16 chunks on the GPU up to 10 GiB (about half of the 19.1 GiB) and moves the rest back to the host "
    "after use; the plan's cache is the search's (its chunks differ from Gemini's). "
    + GEMINI_HOST_ROOM.format(step=8.20, room=1.22, rate="8.4e9", elixir="0.97"),
}

# How ColossalAI-Pytorch-lightning's figures were taken. benchmark/gpt/train.py and callback.py print no
# timing (the callback reports memory only), so "Step time (sec)" and "samples/sec" are what Lightning's
# default progress bar shows. In pytorch_lightning's TQDMProgressBar of August 2022 (src/pytorch_lightning/
# callbacks/progress/tqdm_progress.py @ 090bbc86, unchanged to 1.8.0, the first release with the
# ColossalAI strategy the script imports) the training bar is built with smoothing=0 and reset at every
# on_train_epoch_start; tqdm's reset (std.py @ v4.64.0) restarts start_t, and with smoothing 0 its rate is
# (n - initial) / (now - start_t). So the figure left on screen is the average over the last epoch's steps,
# counted from that epoch's start.
COLOSSAL_PL_WINDOW = {
    SCALING: "step time read off Lightning's progress bar: the average over the only epoch's 3 steps "
    "(--epochs 1 --steps_per_epoch 3; the bar's rate restarts at each epoch start, smoothing 0), so the run's "
    "first step is in it, with its one-time costs (lazy CUDA/cuBLAS/NCCL initialization and allocator growth, "
    "DeepSpeed ZeRO-3's first-iteration trace, Gemini's warm-up iteration): not a steady-state step, which is "
    "what the model predicts (a separate class in the summary, marked f)",
    SMALL: "throughput read off Lightning's progress bar: the average over the second epoch's 4 steps (defaults "
    "--epochs 2 --steps_per_epoch 4; the bar's rate restarts at each epoch start, smoothing 0), so the run's "
    "first step is not in it: a steady-state window",
}

# ColossalAI-Pytorch-lightning benchmark/gpt/model.py: (hidden, layers, heads) of the models the README ran.
COLOSSAL_PL_MODELS = {"gpt2_xl": (1600, 48, 25), "gpt2_12B": (4096, 60, 16), "gpt2_18B": (4096, 90, 16),
                      "gpt2_24B": (8192, 30, 16)}  # fmt: skip


def gpt2_params(hidden: int, layers: int, vocab: int = 50257, positions: int = 1024) -> int:
    """Parameters of transformers' GPT2LMHeadModel (tied head counted once), as ``model.parameters()`` sums them."""
    return layers * (12 * hidden**2 + 13 * hidden) + (vocab + positions) * hidden + 2 * hidden


# Colossal-AI examples/language/gpt/model_zoo.py: (hidden, layers, heads).
COLOSSAL_GEMINI_MODELS = {"gpt2_10b": (4096, 50, 16), "gpt2_20b": (8192, 25, 16)}

# examples/language/gpt/README.md @ d96cc37e prints 43.102 twice: in the tensor-parallel table for gpt2_20b on
# 1 GPU, TP 1, batch 8 (the row compared) and under "Touch the bar" for gpt2_20b on 4 GPUs, TP 2, batch 8.
GEMINI_20B_FIGURE = (
    "the README prints the same 43.102 TFLOPS for this run (1 GPU, TP 1, batch 8) and for gpt2_20b on 4 GPUs with "
    "TP 2 at batch 8 (its 'Touch the bar' table); different runs giving the same five digits suggests one is a "
    "copy, and the README does not say which: the figure is compared as printed"
)

BATCH_TABLE = "How dose Batch Size affect the efficency."
POLICY_TABLE = "How dose the Placement Policy affect the efficency."
TP_TABLE = "How dose the Tensor Parallel Degree affect the efficency."

# What Gemini's 'cuda' placement holds at its peak by its code (d96cc37e; v0.1.13, the version the README names,
# differs in chunk.py and data_parallel.py only by a state assertion), for the 10B row that ran out of memory:
# Chunk.__gather frees the shard it gathers (cuda_shard = None); ChunkManager.release_chunk is reached only
# through a policy's evict_tensors, which CUDAPlacementPolicy leaves empty, so every fp16 chunk stays gathered
# from its first use to ChunkManager.reduce_chunk; ZeroDDP.grad_handle writes each gradient into the gathered
# fp16 chunk and reduce-scatters it into a new fp16 shard; ZeroOptimizer._set_grad_ptr points the fp32 master's
# grad at that fp16 shard (no fp32 gradient). Per rank at the end of the forward: 10.28e9 x 2 B gathered
# (19.15 GiB) + the fp32 master and Adam's two states over 4 ranks (10.28e9 x 12 B / 4 = 28.7 GiB) = 47.9 GiB,
# with ~6.6 GiB of activations as profiled: ~55 GiB of 78.6 usable. The plan's prediction (67.74 GiB) counts
# more (an fp16 shard beside each gathered chunk and a gradient shard); the OOM is not explained by the code.
GEMINI_CUDA_MEMORY = (
    "by Colossal-AI's code Gemini 'cuda' holds ~47.9 GiB of model data at its peak (every fp16 chunk gathered, "
    "its shard freed; gradients in the fp16 chunks; fp32 master and Adam states over 4 ranks) and ~6.6 GiB of "
    "activations: the reported OOM is not explained by the code (scripts/published_colossalai.py)"
)
