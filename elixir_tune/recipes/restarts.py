"""What a recipe does when torchrun restarts its workers (``elixir-run --max-restarts N``).

torchrun restarts the whole worker group after a worker fails, and each new worker starts the recipe again
from its command line. Started again as it was, a run would train from step 0 and save over the checkpoints it
had written before the failure. A restarted worker whose ``--save`` directory holds a complete checkpoint
resumes from it instead: that is the newest state of this job. Every rank must decide alike (one that started
over while another resumed would wait for each other's collectives for ever): the restart number is agreed over
the ranks, and the ranks see the same ``--save`` directory.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from elixir_tune.engine.io.checkpoint_files import LATEST_NAME

# Set by torchrun's agent in every worker: 0 on the first start, n on the n-th restart.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


def restart_count() -> int:
    """This worker's restart number as its node's torchrun agent counts it (0: the first start).

    On several nodes only the agent whose worker failed counts a restart; the others restart their workers
    for the new rendezvous round with the count unchanged, so the recipe takes the largest over the ranks.
    """
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def resume_after_restart(args: argparse.Namespace, restart: int) -> str | None:
    """Points ``args.resume`` at ``args.save`` on a restarted job when a checkpoint is there.

    Args:
        args: the recipe's options (``save``, ``resume``); ``resume`` may be changed.
        restart: the job's restart number, the same on every rank (the largest ``restart_count`` of them).

    Returns:
        A line for rank 0 to print when this is a restart (resuming or starting over), else None.
    """
    if restart <= 0:
        return None
    of = os.environ.get(MAX_RESTARTS_ENV, "?")
    if args.save and (Path(args.save) / LATEST_NAME).exists():
        args.resume = args.save
        return f"restart {restart} of {of}: resuming from {args.save}, the latest checkpoint this job saved"
    start = f"from --resume {args.resume}" if args.resume else "from step 0"
    return f"restart {restart} of {of}: no checkpoint in --save yet, starting again {start}"


# What gloo's errors say when the other end of a connection went away (the peer process died or was killed),
# and what the engine's forward agreement says when its control channel found a rank gone (engine/uneven.py):
# whichever collective a step was in when the peer died reports it.
_LOST_PEER_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "they left (a rank stopped)",
)


def lost_peer_line(error: BaseException, rank: int, step: int) -> str | None:
    """One line for a collective that failed because another worker is gone, or None for any other error.

    Args:
        error: what the step raised.
        rank: this worker's rank.
        step: the step it was in, counted from 1.

    Returns:
        The line to print instead of gloo's traceback, or None (the error is not a lost peer: re-raise it).
    """
    text = str(error)
    found = next((words for words in _LOST_PEER_WORDS if words in text), None)
    if found is None:
        return None
    return (
        f"rank {rank}: another worker went away during step {step} ({_source(found)}); this rank stops too, "
        "and elixir-run's summary names the worker that failed first"
    )


def _source(words: str) -> str:
    """Who noticed: gloo's words, or the engine's forward agreement."""
    return "the forward agreement: it left" if words.startswith("they left") else f"gloo: {words.lower()}"
