"""The fine-tune of the README as one command, timed: `elixir-tune train MODEL --data FILE ...`, then the result
loaded by plain transformers.

    python scripts/bench_train_command.py [--gpus N] [--lora]

No model can be downloaded here, so the model is the tests' tiny Llama directory (tests/fixtures/tiny_hf.py:
config, safetensors weights and a tokenizer with a chat template) and the data 12 short chats. The command runs
twice in a fresh cache: cold (profile, search, then training) and warm (the cached profile and plan reused),
each one epoch with ``--save-pretrained``; then ``AutoModelForCausalLM.from_pretrained`` (or PEFT's loader with
``--lora``) loads the output and generates. Prints the wall time of each and the load average (a loaded machine
is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_DIR))  # tests.fixtures

BIN_DIR = Path(sys.executable).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1, help="workers (default 1)")
    parser.add_argument("--lora", action="store_true", help="LoRA rank 4 on q_proj,v_proj instead of full fine-tuning")
    args = parser.parse_args()
    from tests.fixtures.tiny_hf import CONVERSATIONS, make_llama_dir

    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        model_dir = make_llama_dir(work / "tiny-llama")
        chat = work / "chat.jsonl"
        chat.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in CONVERSATIONS * 3))
        env = {**os.environ, "ELIXIR_TUNE_CACHE": str(work / "cache")}
        lora = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj"] if args.lora else []
        for run in ("cold", "warm"):
            out = work / f"tuned-{run}"
            command = [str(BIN_DIR / "elixir-tune"), "train", str(model_dir), "--data", str(chat), "--gpus"]
            command += [str(args.gpus), "--seq-len", "128", *lora, "--epochs", "1", "--save-pretrained", str(out)]
            started = time.perf_counter()
            result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
            wall_s = time.perf_counter() - started
            if result.returncode:
                print(result.stdout[-3000:] + result.stderr[-3000:])
                return 1
            done = next(line for line in result.stdout.splitlines() if line.startswith("done: "))
            print(f"{run}: {wall_s:.1f} s wall ({done})")
        started = time.perf_counter()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = AutoModelForCausalLM.from_pretrained(model_dir if args.lora else out)
        if args.lora:
            from peft import PeftModel

            base = PeftModel.from_pretrained(base, out)
        tokenizer = AutoTokenizer.from_pretrained(out)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say hello."}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        generated = base.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        print(
            f"loaded {out.name} with plain transformers and generated {generated.shape[1]} tokens "
            f"({time.perf_counter() - started:.1f} s)"
        )
    print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; {os.cpu_count()} CPU(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
