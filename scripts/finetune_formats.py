"""The whole fine-tuning user path for each data format, run from a directory outside the repository.

    python scripts/finetune_formats.py            # -> benchmarks/results/finetune-formats.md

In a fresh temporary directory: a tiny Llama-style Hugging Face directory (tests/fixtures/tiny_hf.py: weights and a
tokenizer trained here with ``tokenizers``, with a chat template) and one small data file per format; then, as a
user types them, ``elixir-tune profile model`` -> ``elixir-tune search --loop plain --gpus 2 --hardware cpu`` ->
``elixir-run plan.yaml finetune ...`` at world 2 (CPU, gloo) for each format: a .txt file packed into windows, a
JSONL file of ``text``, JSONL ``prompt``/``completion``, JSONL ``messages``, Parquet ``text`` (one sample per
paragraph), CSV ``prompt``/``completion``, a saved ``datasets`` directory of ``messages`` (with ``--packing``); and
LoRA (its own ``profile --lora-rank``, search and run) writing the adapter, and once more merged. Each run holds
out a share of its samples for evaluation; the table gives the detected format, the steps, the first and last
evaluation loss, and whether the output loads with ``AutoModelForCausalLM`` + ``AutoTokenizer`` (the adapter with
``PeftModel.from_pretrained``) and generates. The script exits 1 when a run fails or its evaluation loss does not
fall.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report_meta import generated, load_average, with_header, write_pair

REPO_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_DIR))  # the test fixture that writes the model directory and the data files

SEQ_LEN, GLOBAL_BATCH, STEPS, EVAL_EVERY = 64, 4, 20, 10
LORA = ["--lora-rank", "8", "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]

# (label, data file key, the recipe's extra options, LoRA output: None, "adapter" or "merged")
RUNS: list[tuple[str, str, list[str], str | None]] = [
    ("txt, packed windows", "txt", ["--eval-fraction", "0.2"], None),
    ("JSONL text", "text_jsonl", ["--eval-fraction", "0.2"], None),
    ("JSONL prompt/completion", "prompt_completion_jsonl", ["--eval-fraction", "0.34"], None),
    ("JSONL messages", "messages_jsonl", ["--eval-fraction", "0.25"], None),
    ("Parquet text, one per paragraph", "text_parquet", ["--text-mode", "paragraph", "--eval-fraction", "0.2"], None),
    ("CSV prompt/completion", "prompt_completion_csv", ["--eval-fraction", "0.34"], None),
    ("saved datasets dir (messages), packed", "messages_dataset", ["--packing", "--eval-fraction", "0.25"], None),
    ("LoRA, JSONL prompt/completion -> adapter", "prompt_completion_jsonl", ["--eval-fraction", "0.34"], "adapter"),
    ("LoRA, JSONL prompt/completion -> merged", "prompt_completion_jsonl", ["--eval-fraction", "0.34"], "merged"),
]


def run(command: list, cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """A console script of the installed package, from ``cwd``; raises with its output when it fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR), "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(map(str, command))}` failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def search_command(work: Path, profile_args: list[str], plan: str) -> list[str]:
    """Profile and search; the finetune command search prints, as arguments (``--data FILE`` left in)."""
    run(["elixir-tune", "profile", "model", "--batch-size", "2", "--seq-len", SEQ_LEN, *profile_args], work)
    searched = run(
        ["elixir-tune", "search", "--loop", "plain", "--gpus", "2", "--hardware", "cpu"]
        + ["--global-batch-size", GLOBAL_BATCH, "--out", plan],
        work,
    )
    printed = re.search(rf"run it with `elixir-run {re.escape(plan)} (finetune [^`]+)`", searched.stdout)
    if not printed:
        raise RuntimeError(f"search printed no finetune command:\n{searched.stdout[-2000:]}")
    return printed.group(1).split()


def check_output(out: Path, model_dir: Path, lora: str | None) -> str:
    """Loads OUT as a user would and generates 5 tokens; a short note of what loaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    if lora == "adapter":
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
        loaded = "PeftModel.from_pretrained + AutoTokenizer"
    else:
        model = AutoModelForCausalLM.from_pretrained(out)
        loaded = "AutoModelForCausalLM + AutoTokenizer"
    prompt = tokenizer("Who wrote the letter?", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    new = generated.shape[1] - prompt["input_ids"].shape[1]
    return f"{loaded}: loads, generates {new} tokens"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        default=str(REPO_DIR / "benchmarks" / "results" / "finetune-formats"),
        help="writes PREFIX.md and PREFIX.json",
    )
    args = parser.parse_args()
    load_before = load_average()
    from tests.fixtures.tiny_hf import make_llama_dir, write_formats

    work = Path(tempfile.mkdtemp(prefix="elixir-formats-"))
    print(f"working in {work}", flush=True)
    model_dir = make_llama_dir(work / "model")
    files = write_formats(work / "data")
    plain = search_command(work, [], "plan.yaml")
    with_lora = search_command(work, LORA, "plan-lora.yaml")
    rows, records, failed = [], [], False
    for index, (label, key, extra, lora) in enumerate(RUNS):
        out, log = work / f"out-{index}", work / f"train-{index}.json"
        recipe, plan = (with_lora, "plan-lora.yaml") if lora else (plain, "plan.yaml")
        recipe = [str(files[key]) if arg == "FILE" else arg for arg in recipe]
        command = ["elixir-run", plan, *recipe, *extra, "--steps", STEPS, "--eval-every", EVAL_EVERY]
        command += ["--lr", "3e-2" if lora else "3e-3", "--log", log, "--save-pretrained", out]
        command += ["--merge-lora"] if lora == "merged" else []
        started = time.perf_counter()
        try:
            result = run(command, work)
            record = json.loads(log.read_text())
            evals = [e["loss"] for e in record["evals"]]
            loads = check_output(out, model_dir, lora)
            falls = evals[-1] < evals[0]
            failed |= not falls
            detected = record["data"].split(": ", 1)[1] if ": " in record["data"] else record["data"]
            rows.append(
                f"| {label} | {detected} | {len(record['steps'])} | {evals[0]:.4f} | {evals[-1]:.4f} | "
                f"{'yes' if falls else '**no**'} | {loads} | {time.perf_counter() - started:.0f} |"
            )
            print(f"{label}: eval {evals[0]:.4f} -> {evals[-1]:.4f}; {loads}", flush=True)
            shown = " ".join(str(c) for c in command).replace(str(work) + "/", "")
            rows[-1] += f" `{shown}` |"
            records.append(
                {
                    "run": label,
                    "data": detected,
                    "steps": len(record["steps"]),
                    "first_eval_loss": evals[0],
                    "last_eval_loss": evals[-1],
                    "falls": falls,
                    "output": loads,
                    "wall_s": round(time.perf_counter() - started, 1),
                    "command": shown,
                }
            )
            del result
        except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as error:
            failed = True
            rows.append(f"| {label} | failed: {str(error).splitlines()[0][:200]} | | | | **no** | | | |")
            records.append({"run": label, "error": str(error).splitlines()[0][:200]})
            print(f"{label}: FAILED\n{error}", flush=True)

    prefix = Path(args.out).with_suffix("")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    report = {"generated": generated(load_before, "python scripts/finetune_formats.py"), "runs": records}
    text = (
        "# Fine-tuning each data format at world 2 (CPU), from outside the repository\n\n"
        f"Working directory {work}, outside the repository. Model: a tiny Llama (hidden 32, 2 layers, "
        "vocabulary 400, random weights) with a BPE tokenizer trained on the bundled text and a chat template "
        "(tests/fixtures/tiny_hf.py). Each run: `elixir-tune profile model --batch-size 2 --seq-len 64` "
        f"(LoRA runs: with `{' '.join(LORA)}`), `elixir-tune search --loop plain --gpus 2 --hardware cpu "
        f"--global-batch-size {GLOBAL_BATCH}`, then the command below: {STEPS} steps, evaluation on the held-out "
        f"share every {EVAL_EVERY} steps and at the end (first and last evaluation shown). The data files are "
        "small (12 paragraphs, 6 prompt/completion pairs, 4 conversations), so the held-out shares are a few "
        "samples: the falling evaluation loss shows that the runs learn the data's token statistics from "
        "random weights, not generalisation. The output directory is loaded as a user would and generates "
        "5 tokens greedily.\n\n"
        "| run | data as the recipe read it | steps | first eval loss | last eval loss | falls | output | "
        "wall s | command |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    write_pair(prefix, report, with_header(text, report["generated"]))
    print(f"wrote {prefix}.md and {prefix}.json", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
