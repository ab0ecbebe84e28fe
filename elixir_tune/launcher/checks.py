"""Pre-flight checks: does this plan fit this launch on this machine?

`check_launch` is a pure function over the plan, the launch settings and the machine facts that
`observe_machine` gathers, so every rule is testable with made-up machines. Each check says what
it looked at; the fatal ones that fail stop elixir-run before any worker starts. The model
fingerprint is not checked here: the worker checks it when it builds the model (engine setup).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from elixir_tune.plan import Plan
from elixir_tune.units import gib

MIN_TORCH = (2, 4)


@dataclass
class MachineFacts:
    """What elixir-run observed about this node.

    Attributes:
        torch_version: ``torch.__version__``.
        cuda_available: whether torch sees a usable CUDA runtime.
        gpu_memory_bytes: total memory of each visible GPU, in device order.
        gpu_names: name of each visible GPU.
        cpu_cores: cores this process may run on.
        host_memory_bytes: physical memory of the node (0 when unknown).
    """

    torch_version: str
    cuda_available: bool
    gpu_memory_bytes: list[int] = field(default_factory=list)
    gpu_names: list[str] = field(default_factory=list)
    cpu_cores: int = 1
    host_memory_bytes: int = 0

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_memory_bytes)


@dataclass
class Check:
    """One pre-flight check.

    Attributes:
        name: what was checked (``torch``, ``world size``, ``gpus``, ...).
        ok: whether it passed.
        detail: what was found, in words.
        hint: what to do when it failed.
        fatal: a failed fatal check stops the launch; others are warnings.
    """

    name: str
    ok: bool
    detail: str
    hint: str = ""
    fatal: bool = True


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def observe_machine() -> MachineFacts:
    """Gathers the facts the checks need (imports torch; initialises CUDA only to count GPUs)."""
    import torch

    from elixir_tune.device import cuda_available, cuda_device_count, cuda_properties

    memory, names = [], []
    available = cuda_available()
    if available:
        for index in range(cuda_device_count()):
            properties = cuda_properties(index)
            memory.append(int(properties.total_memory))
            names.append(properties.name)
    try:
        host_memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host_memory_bytes = 0
    return MachineFacts(
        torch_version=torch.__version__,
        cuda_available=available,
        gpu_memory_bytes=memory,
        gpu_names=names,
        cpu_cores=cpu_cores(),
        host_memory_bytes=host_memory_bytes,
    )


def _version_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def parse_endpoint(endpoint: str) -> tuple[str, int] | None:
    """``HOST:PORT`` -> (host, port), or None when it is not of that form."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def check_launch(
    plan: Plan,
    facts: MachineFacts,
    nnodes: int,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    force: bool = False,
) -> list[Check]:
    """Checks a plan against the launch settings and this machine.

    Args:
        plan: the loaded (valid) plan.
        facts: what `observe_machine` found on this node.
        nnodes: nodes in this launch.
        node_rank: this node's rank.
        rdzv_endpoint: HOST:PORT of the rendezvous, or None on one node.
        force: a plan whose predicted memory exceeds this node's (host or GPU) only warns instead
            of stopping the launch.

    Returns:
        Every check in order, passed or not.
    """
    cluster = plan.cluster
    procs = cluster.gpus_per_node
    checks = []

    ok = _version_tuple(facts.torch_version) >= MIN_TORCH
    checks.append(
        Check(
            "torch",
            ok,
            f"torch {facts.torch_version}" + ("" if ok else f", older than {MIN_TORCH[0]}.{MIN_TORCH[1]}"),
            hint="install torch>=2.4",
        )
    )

    launch_world = nnodes * procs
    ok = nnodes == cluster.nodes
    checks.append(
        Check(
            "world size",
            ok,
            f"plan: {cluster.nodes} node(s) x {procs} process(es) = {plan.world_size}; "
            f"launch: {nnodes} node(s) x {procs} = {launch_world}",
            hint=f"pass --nnodes {cluster.nodes}, or search a plan for {nnodes} node(s) "
            f"(elixir-tune search --nodes {nnodes} --gpus {procs})",
        )
    )

    ok = 0 <= node_rank < nnodes
    checks.append(
        Check(
            "node rank",
            ok,
            f"node rank {node_rank} of {nnodes}",
            hint=f"--node-rank must be in 0..{nnodes - 1}, a different one on each node",
        )
    )

    if nnodes > 1 or rdzv_endpoint:
        if not rdzv_endpoint:
            checks.append(
                Check(
                    "rendezvous",
                    False,
                    f"{nnodes} nodes need a rendezvous endpoint",
                    hint="pass --rdzv-endpoint HOST:PORT naming node 0, the same on every node",
                )
            )
        else:
            ok = parse_endpoint(rdzv_endpoint) is not None
            checks.append(
                Check(
                    "rendezvous",
                    ok,
                    f"c10d at {rdzv_endpoint}" if ok else f"{rdzv_endpoint!r} is not HOST:PORT",
                    hint="e.g. --rdzv-endpoint 10.0.0.1:29400",
                )
            )
    else:
        checks.append(Check("rendezvous", True, "this node only (torchrun --standalone)"))

    if cluster.device == "cuda":
        checks += _cuda_checks(plan, facts, force)
    else:
        ok = procs <= facts.cpu_cores
        checks.append(
            Check(
                "cpu workers",
                ok,
                f"{procs} worker process(es) on {facts.cpu_cores} core(s)"
                + ("" if ok else "; they will share cores and run slower"),
                hint="fine for testing; search a plan with fewer --gpus for speed",
                fatal=False,
            )
        )

    prediction = plan.prediction
    # A cpu plan's "device" is host memory: its per-worker peak is in peak_gpu_bytes and its host peak is 0,
    # so the node needs each of its workers' device peak on top of the host peak.
    worker_bytes = prediction.peak_gpu_bytes * procs if prediction and cluster.device == "cpu" else 0
    node_bytes = prediction.peak_host_bytes + worker_bytes if prediction else 0
    if prediction and facts.host_memory_bytes and node_bytes:
        ok = node_bytes <= facts.host_memory_bytes
        workers = f" ({procs} worker(s) x {gib(prediction.peak_gpu_bytes)})" if worker_bytes else ""
        checks.append(
            Check(
                "host memory",
                ok,
                f"plan needs {gib(node_bytes)} per node{workers}, node has {gib(facts.host_memory_bytes)}",
                hint="search with this machine's hardware (elixir-tune probe, then elixir-tune search "
                "--hardware hardware.yaml), or pass --force to run anyway (the job may then be killed "
                "when host memory runs out)",
                fatal=not force,
            )
        )
    return checks


def _cuda_checks(plan: Plan, facts: MachineFacts, force: bool) -> list[Check]:
    procs = plan.cluster.gpus_per_node
    if not facts.cuda_available:
        return [
            Check(
                "gpus",
                False,
                "the plan is for cuda but torch sees no GPU on this machine",
                hint="run on a machine with GPUs, check CUDA_VISIBLE_DEVICES and the torch build, "
                "or search a cpu plan (elixir-tune search --hardware cpu)",
            )
        ]
    checks = [
        Check(
            "gpus",
            facts.gpu_count >= procs,
            f"plan needs {procs} GPU(s) per node, this node has {facts.gpu_count}",
            hint=f"search a plan for {facts.gpu_count} GPU(s) (elixir-tune search --gpus "
            f"{facts.gpu_count}) or run on a node with {procs}",
        )
    ]
    if plan.prediction and plan.prediction.peak_gpu_bytes and facts.gpu_count:
        used = facts.gpu_memory_bytes[:procs]
        smallest = min(used)
        need = plan.prediction.peak_gpu_bytes
        checks.append(
            Check(
                "gpu memory",
                need <= smallest,
                f"plan needs {gib(need)} per GPU, the smallest of this node's GPUs has {gib(smallest)}",
                hint="search with this machine's hardware: elixir-tune probe, then "
                "elixir-tune search --hardware hardware.yaml; or pass --force to run anyway",
                fatal=not force,
            )
        )
    return checks


def failed(checks: list[Check], fatal: bool = True) -> list[Check]:
    """The checks that failed (fatal ones, or the warnings with fatal=False)."""
    return [check for check in checks if not check.ok and check.fatal == fatal]
