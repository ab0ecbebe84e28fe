"""Reading a SLURM allocation, so that `srun elixir-run plan.yaml train.py` needs no flags.

Under SLURM every node runs one elixir-run (one task per node); each starts the plan's workers
for its node with torchrun. Everything a multi-node launch needs is in the environment SLURM
gives each task: the node count, this node's index, the node list (whose first host serves the
c10d rendezvous) and the job id (the rendezvous id, shared by all nodes of the job).

Pure functions over an environment mapping, so a faked allocation is testable anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# torchrun's own default for a c10d rendezvous endpoint given without a port.
DEFAULT_RDZV_PORT = 29400
# Lets a job pick another port (two jobs sharing a first node, a firewall rule).
RDZV_PORT_ENV_VAR = "ELIXIR_TUNE_RDZV_PORT"


class SlurmError(ValueError):
    """The SLURM environment is inconsistent or cannot be read."""


@dataclass(frozen=True)
class SlurmAllocation:
    """What a multi-node launch takes from SLURM.

    Attributes:
        nnodes: nodes in the allocation (SLURM_NNODES).
        node_rank: this node's index in it (SLURM_NODEID).
        rdzv_endpoint: HOST:PORT on the allocation's first node.
        rdzv_id: the job id.
    """

    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    rdzv_id: str


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list in its compressed form.

    Args:
        nodelist: e.g. ``gpu[07-09,12],login1`` or ``node001``.

    Returns:
        The first host name, e.g. ``gpu07`` (leading zeros of a range are kept).

    Raises:
        SlurmError: the list is empty or its brackets do not parse.
    """
    text = nodelist.strip()
    match = re.match(r"([^,\[\]]+)(?:\[([^\]]*)\])?([^,\[\]]*)", text)
    if not text or match is None:
        raise SlurmError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",", 1)[0].split("-", 1)[0].strip()
    if not first:
        raise SlurmError(f"cannot read the SLURM node list {nodelist!r}: empty range in brackets")
    return f"{prefix}{first}{suffix}"


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise SlurmError(f"${name}={env[name]!r} is not an integer") from None


def read_allocation(env: Mapping[str, str]) -> SlurmAllocation | None:
    """The allocation this process runs in, or None outside SLURM.

    Only a job step (``srun``) counts: a batch script itself runs on the first node only, so
    reading the allocation there would make one node wait for all the others.

    Args:
        env: the process environment.

    Returns:
        The allocation, or None when not inside a SLURM job step.

    Raises:
        SlurmError: a job step with several tasks on one node (elixir-run must run once per
            node: it starts the node's workers itself), or unreadable variables.
    """
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return None
    nnodes = _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else _int(env, "SLURM_JOB_NUM_NODES")
    node_rank = _int(env, "SLURM_NODEID")
    if "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS") != nnodes:
        raise SlurmError(
            f"this job step runs {env['SLURM_NTASKS']} tasks on {nnodes} node(s); elixir-run starts the workers "
            "of its node itself and must run once per node: `srun --ntasks-per-node=1 elixir-run ...`"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("SLURM_JOB_NODELIST is not set: cannot tell which node serves the rendezvous")
    port = _int(env, RDZV_PORT_ENV_VAR) if RDZV_PORT_ENV_VAR in env else DEFAULT_RDZV_PORT
    return SlurmAllocation(
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=f"{first_host(nodelist)}:{port}",
        rdzv_id=f"slurm-{env['SLURM_JOB_ID']}",
    )
