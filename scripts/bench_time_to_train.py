"""Benchmark of time-to-train planning (issue 40): how fast can GPT-3-shaped models be trained at all?

For GPT-3-shaped models (1.3B, 13B, 175B: Brown et al. 2020 table 2.1; 1T: Narayanan et al. 2021
table 1) at Chinchilla's compute-optimal 20 tokens per parameter (Hoffmann et al. 2022), on the
a100-80gb-sxm and h100-80gb-sxm presets, with the preset's InfiniBand and with one 25 Gb/s Ethernet
card per node (``--network eth-25``), each with and without layered accumulation and modular
pipelines (``time_to_train(methods=False)``: standard accumulation, or contiguous 1F1B/GPipe
stages): the shortest training time over whole-node clusters up to --max-gpus, its GPU-hours, and
the ratio without / with the methods (the seed's "cuts the shortest training time by half").
Beside it: Megatron-LM's published end-to-end estimates (Narayanan et al. 2021, section 5.1) for
their clusters and batches, the frontier (every cluster size up to 4096 H100s, InfiniBand and
eth-25) for 175B, and the CLI's answer for 175B over up to 4096 GPUs, timed.

Profiles are the analytic GPT-2 builder's (``costmodel/synthetic.py``) with GPT-3's vocabulary of
50257 and sequence 2048; the search then has no tensor parallelism for them (the vocabulary does not
split), so the layouts are data parallelism (ZeRO-style sharding, offload), context parallelism and
pipelines.

    .venv/bin/python scripts/bench_time_to_train.py      # writes benchmarks/results/time-to-train.{json,md}
    .venv/bin/python scripts/bench_time_to_train.py --models 1.3b --out-prefix /tmp/ttt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report_meta import generated, load_average, with_header, write_pair

from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.hardware import load_hardware
from elixir_tune.hardware.networks import with_network
from elixir_tune.profiler.schema import save_profile
from elixir_tune.search.scaling import compute_optimal_tokens
from elixir_tune.search.time_to_train import time_to_train

# name: (hidden, layers, heads). GPT-3 XL, 13B and 175B: Brown et al. 2020 (arXiv 2005.14165) table
# 2.1 (their 13B lists d_model 5140 with 40 heads); 1T: Narayanan et al. 2021 (arXiv 2104.04473)
# table 1, the 1008B row (hidden 25600, 128 layers, 160 heads).
MODELS = {
    "1.3b": (2048, 24, 24),
    "13b": (5140, 40, 40),
    "175b": (12288, 96, 96),
    "1t": (25600, 128, 160),
}
HARDWARE = {"a100-80gb-sxm": "ib-hdr", "h100-80gb-sxm": "ib-ndr"}  # each preset's own InfiniBand
SLOW = "eth-25"
SEQ_LEN = 2048
VOCAB = 50257  # GPT-3's BPE vocabulary (Brown et al. 2020, as GPT-2's)
# Megatron-LM's end-to-end estimates, Narayanan et al. 2021 section 5.1: time ~ 8 T P / (n X).
MEGATRON = [
    {"model": "175b", "tokens": 300e9, "gpus": 1024, "batch": 1536, "tflops": 140, "days": 34},
    {"model": "1t", "tokens": 450e9, "gpus": 3072, "batch": 3072, "tflops": 163, "days": 84},
]


def profile_of(name: str):
    hidden, layers, heads = MODELS[name]
    return gpt2_profile(
        f"gpt3-{name}", hidden=hidden, layers=layers, heads=heads, vocab=VOCAB, positions=SEQ_LEN, seq_len=SEQ_LEN
    )


def shortest(name: str, hardware_id: str, network: str, methods: bool, max_gpus: int) -> dict:
    profile = profile_of(name)
    hardware = with_network(load_hardware(hardware_id), network)
    tokens = int(compute_optimal_tokens(profile.num_params))
    answer = time_to_train(profile, hardware, tokens, max_gpus=max_gpus, methods=methods, loop="forward_backward")
    row = {
        "model": name,
        "params": profile.num_params,
        "train_tokens": tokens,
        "hardware": hardware_id,
        "network": network,
        "methods": methods,
        "max_gpus": max_gpus,
        "batch_limit_tokens": round(answer.limit.tokens),
        "loss_nats": round(answer.limit.loss_nats or 0.0, 4),
        "search_s": round(answer.elapsed_s, 1),
        "sizes_searched": sum(1 for a in answer.frontier if a.ok),
    }
    if answer.best is None:
        row["problem"] = "; ".join(sorted({a.problem for a in answer.frontier if a.problem}))
        return row
    row.update(answer.best.row())
    return row


def frontier_rows() -> list[dict]:
    """175B on H100s up to 4096 GPUs, every size searched, with InfiniBand and with eth-25."""
    profile = profile_of("175b")
    tokens = int(compute_optimal_tokens(profile.num_params))
    out = []
    for network in (HARDWARE["h100-80gb-sxm"], SLOW):
        hardware = with_network(load_hardware("h100-80gb-sxm"), network)
        answer = time_to_train(profile, hardware, tokens, max_gpus=4096, full_frontier=True, loop="forward_backward")
        out += [{"network": network, "search_total_s": round(answer.elapsed_s, 1), **a.row()} for a in answer.frontier]
    return out


def megatron_rows() -> list[dict]:
    out = []
    for ref in MEGATRON:
        profile = profile_of(str(ref["model"]))
        answer = time_to_train(
            profile,
            load_hardware("a100-80gb-sxm"),
            int(ref["tokens"]),
            nodes=int(ref["gpus"]) // 8,
            gpus_per_node=8,
            global_batch_size=int(ref["batch"]),
            loop="forward_backward",
        )
        best = answer.best
        out.append({**ref, "ours": best.row() if best else {"problem": answer.frontier[0].problem}})
    return out


def cli_175b() -> dict:
    """The CLI's answer for 175B over up to 4096 H100s, timed as a user runs it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt3-175b.yaml"
        save_profile(profile_of("175b"), path)
        tokens = int(compute_optimal_tokens(profile_of("175b").num_params))
        args = [sys.executable, "-m", "elixir_tune.cli.main", "search", "--profile", str(path)]
        args += ["--hardware", "h100-80gb-sxm", "--train-tokens", str(tokens), "--max-gpus", "4096"]
        args += ["--loop", "forward_backward", "--out", str(Path(tmp) / "plan.yaml"), "--json"]
        started = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        wall_s = time.perf_counter() - started
    result = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-400:]}
    command = f"elixir-tune search --profile gpt3-175b.yaml --hardware h100-80gb-sxm --train-tokens {tokens} "
    return {"wall_s": round(wall_s, 1), "command": command + "--max-gpus 4096 --loop forward_backward", **result}


def render(report: dict) -> str:
    lines = [
        "# Time to train: GPT-3-shaped models under the scaling laws' batch limit",
        "",
        f"Written by `python scripts/bench_time_to_train.py` on {report['date']} ({report['machine']}); "
        f"{report['elapsed_s']:.0f} s in all.",
        "",
        "Every figure is a prediction of the cost model (the presets' rates; no GPU was used). The batch limit is "
        "Kaplan et al. 2020's critical batch at the loss their L(N, D) predicts at the end of the run: an "
        "estimate, extrapolated far beyond the law's fitted range (<= 1.5B parameters, 23B tokens). Tokens: "
        "Chinchilla's 20 per parameter (Hoffmann et al. 2022). Time counts the training steps only (no data "
        "loading, evaluation, checkpoints, failures or restarts). Clusters: 1, 2, 4, ... nodes of 8 GPUs up to "
        "the max; a size whose best-MFU bound is already slower than the best found is not searched.",
        "",
        "Models: GPT-2 blocks at GPT-3's shapes, vocabulary 50257, sequence 2048. That vocabulary does not "
        "split for the tensor table, so the layouts are data parallelism (ZeRO-style sharding, offload), "
        "context parallelism and pipelines; tensor parallelism is not in these answers.",
        "",
        "## Shortest time, with and without layered accumulation and modular pipelines",
        "",
        "| model | tokens | hardware | network | methods | limit (tokens) | GPUs | batch | layout | accumulation "
        "| tokens/s | MFU | days | GPU-hours | search s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["shortest"]:
        if "days" not in row:
            lines.append(
                f"| {row['model']} | {row['train_tokens']:.3g} | {row['hardware']} | {row['network']} | "
                f"{'with' if row['methods'] else 'without'} | {row['batch_limit_tokens']:.3g} | "
                f"{row.get('problem', '')[:80]} |||||||||"
            )
            continue
        lines.append(
            f"| {row['model']} | {row['train_tokens']:.3g} | {row['hardware']} | {row['network']} | "
            f"{'with' if row['methods'] else 'without'} | {row['batch_limit_tokens']:.3g} | {row['gpus']} | "
            f"{row['global_batch_size']} | {row['layout']} | {row['micro_batch_size']} x {row['grad_accum_steps']} "
            f"{row['accumulation']} | {row['tokens_per_s']:,.0f} | {row['mfu']:.0%} | {row['days']:.3g} | "
            f"{row['gpu_hours']:,.0f} | {row['search_s']:.0f} |"
        )
    lines += [
        "",
        "## The methods' effect and the network's",
        "",
        "'with' is the better of the two searches above (the free search offers modular pipelines and layered "
        "accumulation, not contiguous stages; with the methods available both are on offer), 'without' the "
        "search without them. A ratio without / with of 2 would be the seed's halving.",
        "",
        "| model | hardware | without/with, InfiniBand | without/with, eth-25 | eth-25/IB with | eth-25/IB without |",
        "|---|---|---|---|---|---|",
    ]
    index = {(r["model"], r["hardware"], r["network"], r["methods"]): r.get("days") for r in report["shortest"]}

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "n/a"

    def days(model, hardware_id, network, methods):
        without = index.get((model, hardware_id, network, False))
        if not methods:
            return without
        found = [d for d in (without, index.get((model, hardware_id, network, True))) if d]
        return min(found) if found else None

    for model in report["models"]:
        for hardware_id, fast in HARDWARE.items():
            cells = [
                ratio(days(model, hardware_id, fast, False), days(model, hardware_id, fast, True)),
                ratio(days(model, hardware_id, SLOW, False), days(model, hardware_id, SLOW, True)),
                ratio(days(model, hardware_id, SLOW, True), days(model, hardware_id, fast, True)),
                ratio(days(model, hardware_id, SLOW, False), days(model, hardware_id, fast, False)),
            ]
            lines.append(f"| {model} | {hardware_id} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## The frontier: 175B on H100s, every cluster size up to 4096 GPUs (`--full-frontier`)",
        "",
        "| network | GPUs | batch | layout | accumulation | MFU | days | GPU-hours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report.get("frontier", []):
        if "days" in row:
            lines.append(
                f"| {row['network']} | {row['gpus']} | {row['global_batch_size']} | {row['layout']} | "
                f"{row['micro_batch_size']} x {row['grad_accum_steps']} {row['accumulation']} | {row['mfu']:.0%} | "
                f"{row['days']:.3g} | {row['gpu_hours']:,.0f} |"
            )
        else:
            lines.append(
                f"| {row['network']} | {row['gpus']} | {row['global_batch_size']} | {row['problem'][:70]} |||||"
            )
    lines += ["", "## Beside Megatron-LM's published estimates (Narayanan et al. 2021, section 5.1)", ""]
    lines += ["| model | tokens | A100 GPUs | batch | theirs: TFLOP/s per GPU, days | ours: layout, MFU, days |"]
    lines += ["|---|---|---|---|---|---|"]
    for ref in report["megatron"]:
        ours = ref["ours"]
        mine = f"{ours['layout']}, {ours['mfu']:.0%}, {ours['days']:.3g}" if "days" in ours else ours["problem"][:80]
        lines.append(
            f"| {ref['model']} | {ref['tokens']:.3g} | {ref['gpus']} | {ref['batch']} | {ref['tflops']}, "
            f"{ref['days']} | {mine} |"
        )
    lines += [
        "",
        "Their days are 8 x tokens x parameters / (GPUs x TFLOP/s): the 8 counts the recomputed forward, and "
        "their TFLOP/s counts it too; ours are the cost model's step time x steps for the same cluster and batch "
        "(a100-80gb-sxm preset, its InfiniBand). Their model is Megatron's GPT with tensor parallelism 8; ours "
        "has none (see above).",
        "",
        "## The CLI's answer for 175B over up to 4096 H100s",
        "",
    ]
    cli = report["cli_175b"]
    lines.append(f"`{cli['command']}`: {cli['wall_s']} s wall (the whole process, profile loading included).")
    if "best" in cli:
        best = cli["best"]
        lines.append(
            f"Answer: {best['days']:.3g} days on {best['gpus']} GPUs, {best['gpu_hours']:,.0f} GPU-hours, "
            f"{best['steps']:,} steps of {best['global_batch_size']} samples, {best['tokens_per_s']:,.0f} tokens/s, "
            f"layout {best['layout']}."
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--max-gpus", type=int, default=16384)
    parser.add_argument("--out-prefix", default="benchmarks/results/time-to-train")
    parser.add_argument("--frontier-only", action="store_true", help="Add the frontier section to the .json/.md.")
    parser.add_argument("--render-only", action="store_true", help="Rewrite the .md from the existing .json.")
    args = parser.parse_args()
    out = Path(args.out_prefix)
    if args.frontier_only:  # add the frontier to an existing report
        report = json.loads(out.with_suffix(".json").read_text())
        report["frontier"] = frontier_rows()
        report["generated"] = generated(load_average(), "python scripts/bench_time_to_train.py --frontier-only")
        write_pair(out, report, with_header(render(report), report["generated"]))
        return
    if args.render_only:
        report = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(with_header(render(report), report["generated"]))
        return
    started, load_before = time.perf_counter(), load_average()
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "models": args.models,
        "shortest": [],
    }
    for name in args.models:
        for hardware_id, fast in HARDWARE.items():
            for network in (fast, SLOW):
                for methods in (True, False):
                    row = shortest(name, hardware_id, network, methods, args.max_gpus)
                    report["shortest"].append(row)
                    print(json.dumps(row), flush=True)
                    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    report["frontier"] = frontier_rows()
    report["megatron"] = megatron_rows()
    report["cli_175b"] = cli_175b()
    report["elapsed_s"] = time.perf_counter() - started
    report["generated"] = generated(load_before)
    write_pair(out, report, with_header(render(report), report["generated"]))
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
