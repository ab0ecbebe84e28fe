"""Peak host memory of ``elixir_tune.setup`` for GPT-2 large (774M parameters, 3.1 GB in fp32) at
world 2 (gloo, CPU): a model built on the meta device with its weights read from a safetensors file,
beside the old path (the model materialized on every rank, rank 0's weights broadcast).

    python scripts/bench_setup.py                      # both paths, world 2
    python scripts/bench_setup.py --modes meta-weights # the new path only
    python scripts/bench_setup.py --model gpt2-tiny --results /tmp/setup-memory  # a quick check of the script
    (modes: meta-weights, meta-init: a meta model initialized by its own initializer, materialized)

The weights file (random initialization, ``save_pretrained`` of transformers) is written once into
``--weights-dir`` (default /tmp/elixir-bench-gpt2-large, about 3.1 GB) and reused.

Each rank reports ``ru_maxrss`` after ``setup`` returns: the peak of the whole process, which
starts small (the interpreter, torch and transformers: "RSS at start"), compared with the bound
half the fp32 model + 1 GiB. The optimizer is AdamW: ``setup`` allocates the fp32 gradient shard
and Adam's two moments (3 x the master shard) in host memory here, because the device is the CPU;
they read as zeros and become resident when training first writes them
(``engine/chunks/host_memory.py``), so the peak is the weights' way in: the master shard plus what
materializing it costs (for the old path, the whole model built before setup, too).

Results go to benchmarks/results/setup-memory.json and .md, with the machine's load.

Tensor parallelism (``--tensor 2``): a Llama of 349M parameters (1.30 GiB fp32; hidden 1024, 24
layers, 16 heads with 8 key/value heads, vocabulary 32000, untied head), written once into
``--weights-dir`` (default /tmp/elixir-bench-llama-349m), on a tensor-2 plan at world 2: the model
is split on the meta device and each rank reads only its pieces of the file (``meta-weights``) or
initializes only them (``meta-init``). The section is appended to setup-memory.md (results in
setup-memory-tensor.json):

    python scripts/bench_setup.py --tensor 2 --modes meta-weights,meta-init
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from report_meta import generated, with_header, write_pair

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MODEL = "gpt2-774m"
GIB = 2**30


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


TP_MODEL = "llama-349m"
TP_DEFAULT_DIR = "/tmp/elixir-bench-llama-349m"


def build_model(name: str):
    """The benchmark's model (real weights from the default initializer; ``torch.device`` picks meta)."""
    if name == TP_MODEL:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            use_cache=False,
        )
        return LlamaForCausalLM(config)
    from elixir_tune.profiler import load_model_source

    return load_model_source(name).build_model()


def make_weights(directory: Path, name: str = MODEL) -> None:
    """Random weights in Hugging Face layout (run in a child process: it holds the model)."""
    import torch

    torch.manual_seed(0)
    model = build_model(name)
    model.save_pretrained(directory, max_shard_size="10GB")


def make_plan(model, world: int, chunk_size: int, tensor: int = 1, name: str = MODEL):
    """Every trainable parameter packed in order into chunks of ``chunk_size`` elements, all cached.

    With ``tensor`` > 1: a 1d tensor plan, the chunks holding each tensor rank's local pieces
    (``plan/tensor_layout.py`` ``local_shape``), sharded over the data degree world / tensor.
    """
    import math

    from elixir_tune.engine import model_fingerprint
    from elixir_tune.models.tensor_table import model_tensor_table
    from elixir_tune.plan import (
        ChunkPlan,
        ClusterInfo,
        MemoryPlan,
        ModelInfo,
        ParallelPlan,
        Plan,
        TensorParallel,
        TrainingInfo,
    )
    from elixir_tune.plan.memory import align_up, chunk_size_multiple, padded_offsets
    from elixir_tune.plan.tensor_layout import local_shape

    data = world // tensor
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", "") or "")
    table = model_tensor_table(model)[0] if tensor > 1 else {}

    def numel(param_name: str, param) -> int:
        if tensor == 1:
            return param.numel()
        return math.prod(local_shape(param_name, list(param.shape), model_type, tensor, "1d", table))

    chunk_size = align_up(chunk_size, chunk_size_multiple(data))
    chunks, current, used = [], [], 0
    for param_name, param in model.named_parameters():
        size = numel(param_name, param)
        if align_up(used) + size > chunk_size and current:
            chunks.append(current)
            current, used = [], 0
        current.append((param_name, size))
        used = align_up(used) + size
    chunks.append(current)
    tensor_info = {}
    if tensor > 1:
        tensor_info = dict(
            model_type=model_type,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            tensor_layout=table,
        )
    return Plan(
        model=ModelInfo(
            source=name,
            fingerprint=model_fingerprint(model),
            num_params=sum(p.numel() for p in model.parameters()),
            name=name,
            **tensor_info,
        ),
        cluster=ClusterInfo(hardware="cpu", nodes=1, gpus_per_node=world, device="cpu", backend="gloo"),
        training=TrainingInfo(
            dtype="fp32",
            global_batch_size=data,
            micro_batch_size=1,
            grad_accum_steps=1,
            seq_len=128,
            loop="forward_backward" if tensor > 1 else None,
        ),
        parallel=ParallelPlan(tensor=TensorParallel(degree=tensor)),
        memory=MemoryPlan(
            chunk_size=chunk_size,
            cache_blocks=len(chunks),
            prefetch=0,
            chunks=[
                ChunkPlan(
                    id=i,
                    params=[n for n, _ in c],
                    numel=padded_offsets([k for _, k in c])[1],
                    resident=False,
                    offload=False,
                )
                for i, c in enumerate(chunks)
            ],
        ),
    )


def worker(mode: str, weights_dir: Path, chunk_size: int, out: Path, tensor: int = 1, name: str = MODEL) -> None:
    """One rank: build the model ``name`` as ``mode`` says, run setup, report memory."""
    import torch

    import elixir_tune

    torch.set_num_threads(1)
    start = rss_bytes()  # the interpreter, torch and transformers: the same for both paths
    world = int(os.environ["WORLD_SIZE"])
    with torch.device("meta"):
        shapes = build_model(name)
    plan = make_plan(shapes, world, chunk_size, tensor, name)
    if mode == "meta-weights":
        model, weights = shapes, weights_dir
    elif mode == "meta-init":  # no weights: the model's own initializer, unit by unit, this rank's shards only
        model, weights = shapes, None
    else:  # the old path: every rank materializes the model (its initializer), rank 0's weights win
        torch.manual_seed(0)
        model, weights = build_model(name), None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = rss_bytes()
    peak_before = peak_rss_bytes()
    started = time.perf_counter()
    model, optimizer = elixir_tune.setup(model, optimizer, plan=plan, weights=weights)
    setup_s = time.perf_counter() - started
    peak = peak_rss_bytes()
    engine = model.engine
    grad_bytes = sum(chunk.grad.nbytes for chunk in engine.chunks)
    optimizer_bytes = sum(getattr(chunk, "optimizer_state_bytes", 0) for chunk in engine.chunks)
    master_bytes = sum(chunk.master.nbytes for chunk in engine.chunks)
    # A spot check that the weights are the file's: one row of the embedding, read by safetensors.
    check = None
    if mode == "meta-weights":
        from safetensors import safe_open

        embedding = "model.embed_tokens.weight" if tensor > 1 else "transformer.wte.weight"
        state = model.state_dict()  # rank 0 (the tensor pieces gathered), after the peak was read
        if state:
            file = next(weights_dir.glob("*.safetensors"))
            with safe_open(str(file), framework="pt") as handle:
                row = handle.get_slice(embedding)[7:8]
            check = bool(torch.equal(state[embedding][7:8], row.float()))
    out.write_text(
        json.dumps(
            {
                "mode": mode,
                "model": name,
                "tensor": tensor,
                "rank": int(os.environ["RANK"]),
                "world": world,
                "num_params": plan.model.num_params,
                "chunks": len(plan.memory.chunks),
                "chunk_size": plan.memory.chunk_size,
                "rss_start_bytes": start,
                "rss_before_setup_bytes": before,
                "peak_rss_before_setup_bytes": peak_before,
                "peak_rss_bytes": peak,
                "master_shard_bytes": master_bytes,
                "grad_shard_bytes": grad_bytes,
                "optimizer_state_bytes": optimizer_bytes,
                "setup_s": setup_s,
                "weights_match_file": check,
            }
        )
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    mode: str, world: int, weights_dir: Path, chunk_size: int, tmp: Path, tensor: int = 1, name: str = MODEL
) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TRANSFORMERS_VERBOSITY="error",
            PYTHONPATH=str(REPO),
        )
        out = tmp / f"{mode}-{rank}.json"
        command = [sys.executable, __file__, "--worker", mode, "--weights-dir", str(weights_dir)]
        command += ["--chunk-size", str(chunk_size), "--out", str(out), "--tensor", str(tensor), "--model", name]
        procs.append((subprocess.Popen(command, env=env), out))
    for proc, _ in procs:
        if proc.wait(timeout=1800):
            raise SystemExit(f"{mode}: a rank failed (exit {proc.returncode})")
    return [json.loads(out.read_text()) for _, out in procs]


def write_weights(directory: Path, name: str) -> None:
    """Random weights of ``name`` into ``directory``, in a child process (it holds the whole model)."""
    print(f"writing random {name} weights to {directory} (once)", flush=True)
    code = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "]
    code[-1] += (
        "from scripts.bench_setup import make_weights; from pathlib import Path; "
        f"make_weights(Path({str(directory)!r}), {name!r})"
    )
    subprocess.run(code, check=True, env=dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(REPO)))


def run_modes(args, name: str) -> tuple[dict[str, list[dict]], int, tuple[float, float]]:
    """Writes the weights file once, runs ``setup`` for every mode of ``args.modes`` on ``args.world`` ranks.

    Returns:
        Each mode's per-rank records, the weights file's bytes, and the load average before and after.
    """
    if not any(args.weights_dir.glob("*.safetensors")):
        write_weights(args.weights_dir, name)
    file_bytes = sum(p.stat().st_size for p in args.weights_dir.glob("*.safetensors"))
    load_before = os.getloadavg()
    tmp = Path(args.results).parent / ".bench-setup-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    runs = {}
    for mode in args.modes.split(","):
        on = f"{args.world} ranks" + (f", tensor {args.tensor}" if args.tensor > 1 else "")
        print(f"{mode}: setup on {on} ...", flush=True)
        runs[mode] = launch(mode, args.world, args.weights_dir, args.chunk_size, tmp, args.tensor, name)
    for path in tmp.iterdir():
        path.unlink()
    tmp.rmdir()
    return runs, file_bytes, (load_before[0], os.getloadavg()[0])


def report(args, name: str) -> int:
    """Runs the modes and writes the report: for data parallelism ``RESULTS.md`` and ``RESULTS.json``;
    for tensor parallelism ``RESULTS-tensor.md`` and ``RESULTS-tensor.json``."""
    runs, file_bytes, (load_before, load_after) = run_modes(args, name)
    tensor = args.tensor > 1
    num_params = next(iter(runs.values()))[0]["num_params"]
    model_bytes = num_params * 4
    bound = model_bytes / 2 + GIB
    size = f"{name} ({num_params:,} params, {model_bytes / GIB:.2f} GiB fp32)"
    machine = f"load average before/after {load_before:.2f}/{load_after:.2f} on {os.cpu_count()} cores; torch gloo CPU."
    if tensor:
        lines = [
            f"# setup host memory, tensor parallelism: {size}, tensor {args.tensor} at world {args.world}",
            "",
            f"Command: `python scripts/bench_setup.py --tensor {args.tensor} --world {args.world} --modes {args.modes}`; "
            f"weights file {file_bytes / GIB:.2f} GiB (transformers' save_pretrained, fp32) on local disk; chunk size "
            f"{args.chunk_size:,} elements; the model built on the meta device, split there, each rank reading "
            f"(meta-weights) or initializing (meta-init) only its tensor pieces; {machine}",
        ]
    else:
        model_option = f" --model {name}" if name != MODEL else ""
        lines = [
            f"# setup host memory: {size}, world {args.world}",
            "",
            f"Command: `python scripts/bench_setup.py --world {args.world}{model_option}`; weights file "
            f"{file_bytes / GIB:.2f} GiB on local disk; chunk size {args.chunk_size:,} elements; {machine}",
        ]
    lines += [
        "",
        "| path | rank | peak RSS GiB | bound GiB | RSS at start GiB | RSS before setup GiB | master shard GiB "
        "| grad + Adam allocated GiB | setup s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, results in runs.items():
        for r in results:
            lines.append(
                f"| {mode} | {r['rank']} | {r['peak_rss_bytes'] / GIB:.2f} | {bound / GIB:.2f} | "
                f"{r['rss_start_bytes'] / GIB:.2f} | {r['rss_before_setup_bytes'] / GIB:.2f} | "
                f"{r['master_shard_bytes'] / GIB:.2f} | {(r['grad_shard_bytes'] + r['optimizer_state_bytes']) / GIB:.2f} | "
                f"{r['setup_s']:.1f} |"
            )
    lines.append("")
    if not tensor:
        lines.append(
            "peak RSS: ru_maxrss after setup (the whole process). bound: half the fp32 model + 1 GiB. RSS at start: "
            "after importing torch, before building the model. grad + Adam allocated: the gradient shard and AdamW's "
            "moments that setup allocates (host memory on a CPU device); zero until training writes them, not yet "
            "resident."
        )
    for mode, results in runs.items():
        worst = max(r["peak_rss_bytes"] for r in results)
        checks = [r["weights_match_file"] for r in results if r["weights_match_file"] is not None]
        match = f"; rank 0's embedding row equals the file's: {all(checks)}" if checks else ""
        lines.append(
            f"{mode}: worst rank {worst / GIB:.2f} GiB, {'under' if worst < bound else 'OVER'} the bound "
            f"(half the fp32 model + 1 GiB){match}"
        )
    command = " ".join(["python scripts/bench_setup.py"] + sys.argv[1:])
    record: dict = {
        "generated": generated(load_before, command),
        "model": name,
        "world": args.world,
        "tensor": args.tensor,
        "chunk_size": args.chunk_size,
        "num_params": num_params,
        "weights_file_bytes": file_bytes,
        "bound_bytes": bound,
        "load_average_before_after": [load_before, load_after],
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "runs": runs,
    }
    text = with_header("\n".join(lines) + "\n", record["generated"])
    print(text)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    write_pair(Path(args.results + ("-tensor" if tensor else "")), record, text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights-dir", default=None, type=Path, help="default: a directory per model in /tmp")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tensor", type=int, default=1, help="tensor degree (> 1: the Llama, a tensor plan)")
    parser.add_argument(
        "--model", default=MODEL, help=f"a config name of configs/models (data parallelism; default {MODEL})"
    )
    parser.add_argument("--chunk-size", type=int, default=1 << 26, help="elements per chunk (default 64M)")
    parser.add_argument("--modes", default="meta-weights,meta-init,materialized")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--results", default=str(RESULTS / "setup-memory"), help="results path without suffix")
    args = parser.parse_args()
    name = TP_MODEL if args.tensor > 1 else args.model
    if args.weights_dir is None:
        args.weights_dir = Path(
            TP_DEFAULT_DIR
            if args.tensor > 1
            else "/tmp/elixir-bench-gpt2-large"
            if name == MODEL
            else f"/tmp/elixir-bench-{name}"
        )
    if args.worker:
        worker(args.worker, args.weights_dir, args.chunk_size, args.out, args.tensor, name)
        return 0
    return report(args, name)


if __name__ == "__main__":
    sys.exit(main())
