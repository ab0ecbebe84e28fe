"""A pre-imported parent for test workers: imports torch, transformers and elixir_tune once, then forks
one worker process per request (tests/distributed/engine_launch.py starts one zygote per rank).

Why: a fresh worker spends about 6 s of CPU importing torch and a transformers model before its first
case, and the suite starts some 80 workers on 2 cores. A forked child starts with those modules loaded;
it is still a separate process that runs the worker script as ``__main__`` with its own environment
(RANK, MASTER_PORT, ...) and talks to the other ranks over real gloo. Each rank comes from its own
zygote, so the ranks keep different string-hash seeds, as torchrun's fresh processes have: code that
iterates a set in hash order and disagrees across ranks still fails here.

Protocol (one JSON object per line): the parent writes ``{"argv": [...], "env": {...}, "log": PATH, "cwd": DIR}``;
the zygote forks, answers ``{"pid": PID}``, waits for the child and answers ``{"exit": CODE}`` (negative:
killed by that signal, as ``subprocess`` reports it). It exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: the zygote starts no thread pool to fork


def preload() -> None:
    """What nearly every worker imports (no tensor is computed: the zygote stays single-threaded)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers
    import transformers.modeling_utils  # noqa: F401  (the bulk: generation, DTensor, dynamo)

    import elixir_tune  # noqa: F401
    import elixir_tune.engine  # noqa: F401
    import tests.distributed.engine_plans  # noqa: F401
    import tests.distributed.engine_worker  # noqa: F401

    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"):  # the tests' common models
        getattr(transformers, name)


def run_child(request: dict) -> None:
    """In the forked child: the request's stdout/stderr, environment and argv, then its script as __main__.
    Never returns: the interpreter exits as a fresh ``python script ...`` would (atexit handlers run)."""
    import random
    import runpy

    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh process seeds from the OS; forked siblings must not share the sequence
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main() -> None:
    preload()
    reply = sys.stdout
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    reply.flush()
    while line := sys.stdin.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
