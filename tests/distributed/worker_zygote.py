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

import gc
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
    Never returns: exits with the script's exit code as a fresh ``python script ...`` would (uncaught
    exception: traceback and 1; ``sys.exit(code)``: that code), after its atexit handlers (``finish``)."""
    import random
    import runpy
    import traceback

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
    gc.enable()
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


def exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives: None 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def finish(code: int) -> None:
    """Ends the child as the interpreter's exit does, less its teardown: shuts down the thread pools
    the script left (``concurrent.futures`` workers wait for work until then) and joins its threads,
    runs the atexit handlers, flushes stdout and stderr, then ``os._exit``.

    Why: tearing the interpreter down frees every object of torch and transformers, and in a forked child
    each free writes to a page the zygote shares, so the kernel copies nearly its whole heap first: some
    3 s of CPU per rank and launch (the work itself often takes less). Files the script closed, and its
    process groups (``worker_main`` destroys them after a barrier), are unaffected. The package's
    workers end the same way (``elixir_tune/worker_exit.py``), against gloo's teardown abort.
    """
    from elixir_tune.worker_exit import exit_worker

    exit_worker(code)


def main() -> None:
    gc.disable()  # no collection leaves holes in the pages the children share (re-enabled in each child)
    preload()
    gc.freeze()  # a child's collector skips the preloaded objects: scanning them would copy their pages
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
