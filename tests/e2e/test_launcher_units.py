"""The launcher's pure parts: torchrun argv, command-line splitting, machine checks, worker env,
failure reports. Fast; nothing is started."""

from __future__ import annotations

import shlex

import pytest

from elixir_tune.launcher import (
    ArgvError,
    LaunchSpec,
    MachineFacts,
    WorkerFailure,
    check_launch,
    compose_torchrun_argv,
    describe_failures,
    failed,
    format_command,
    parse_endpoint,
    script_is_a_file,
    split_command_line,
    torchrun_option_arity,
    worker_env,
)
from elixir_tune.launcher.launch import exit_code_of, order_failures
from elixir_tune.plan import PLAN_ENV_VAR, load_plan
from tests.e2e.launch_helpers import EXAMPLE_PLAN, write_plan

GIB = 2**30


@pytest.fixture
def cpu_plan():
    return load_plan(EXAMPLE_PLAN)


@pytest.fixture
def cuda_plan(tmp_path):
    return load_plan(
        write_plan(
            tmp_path / "cuda.yaml", {"cluster.device": "cuda", "cluster.backend": "nccl", "cluster.gpus_per_node": 2}
        )
    )


def _machine(gpus: int = 0, gpu_gib: float = 80, cores: int = 16, torch_version: str = "2.13.0") -> MachineFacts:
    return MachineFacts(
        torch_version=torch_version,
        cuda_available=gpus > 0,
        gpu_memory_bytes=[int(gpu_gib * GIB)] * gpus,
        gpu_names=["GPU"] * gpus,
        cpu_cores=cores,
        host_memory_bytes=64 * GIB,
    )


def test_single_node_uses_standalone():
    argv = compose_torchrun_argv(LaunchSpec(nproc_per_node=2, script="train.py", script_args=["--steps", "5"]))
    assert argv == ["--nproc-per-node=2", "--standalone", "--max-restarts=0", "train.py", "--steps", "5"]


def test_multi_node_uses_c10d_rendezvous():
    spec = LaunchSpec(
        nproc_per_node=4,
        script="train.py",
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="10.0.0.1:29400",
        rdzv_id="job7",
        max_restarts=2,
        torchrun_options=["--monitor-interval=1"],
    )
    argv = compose_torchrun_argv(spec)
    assert argv == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=job7",
        "--max-restarts=2",
        "--monitor-interval=1",
        "train.py",
    ]
    # torchrun's own parser accepts what we compose and reads the same values back.
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    assert (args.nproc_per_node, args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.max_restarts) == (
        "4",
        "2",
        "c10d",
        "10.0.0.1:29400",
        2,
    )
    assert args.training_script == "train.py"


def test_one_node_with_endpoint_uses_it():
    argv = compose_torchrun_argv(LaunchSpec(nproc_per_node=1, script="t.py", rdzv_endpoint="127.0.0.1:1234"))
    assert "--standalone" not in argv and "--rdzv-endpoint=127.0.0.1:1234" in argv


def test_format_command_round_trips_through_the_shell():
    argv = ["--nproc-per-node=2", "--standalone", "train.py", "--note", "two words"]
    command = format_command(argv, {PLAN_ENV_VAR: "/tmp/my plan.yaml"})
    words = shlex.split(command)
    assert words[0] == f"{PLAN_ENV_VAR}=/tmp/my plan.yaml"
    assert words[1:] == ["torchrun", *argv]


def test_split_command_line():
    arity = torchrun_option_arity()
    assert arity["--redirects"] is True and arity["--no-python"] is False
    options, plan, script, args = split_command_line(
        [
            "--redirects",
            "3",
            "--monitor-interval=1",
            "--no-python",
            "plan.yaml",
            "train.py",
            "--steps",
            "3",
            "--dry-run",
        ],
        arity,
    )
    assert options == ["--redirects", "3", "--monitor-interval=1", "--no-python"]
    assert (plan, script, args) == ("plan.yaml", "train.py", ["--steps", "3", "--dry-run"])
    assert not script_is_a_file(options) and script_is_a_file(["--redirects", "3"])
    # The form of docs/overview.md (commands), `PLAN SCRIPT -- ARGS`, means the same as without `--`.
    assert split_command_line(["p.yaml", "t.py", "--", "--steps", "2"], arity)[3] == ["--steps", "2"]


@pytest.mark.parametrize(
    "tokens, words",
    [
        ([], "missing PLAN"),
        (["plan.yaml"], "missing SCRIPT"),
        (["--nproc-per-node=4", "plan.yaml", "t.py"], "--nproc-per-node"),
        (["--nnodes", "2", "plan.yaml", "t.py"], "elixir-run's --nnodes"),
        (["--redirects"], "needs a value"),
    ],
)
def test_split_command_line_errors(tokens, words):
    with pytest.raises(ArgvError, match=words):
        split_command_line(tokens, torchrun_option_arity())


def test_cpu_plan_passes_on_any_machine(cpu_plan):
    for machine in (_machine(gpus=0, cores=2), _machine(gpus=8)):
        checks = check_launch(cpu_plan, machine, nnodes=1)
        assert not failed(checks), checks
        assert {check.name for check in checks} >= {"torch", "world size", "node rank", "rendezvous", "cpu workers"}


def test_cpu_plan_warns_when_workers_share_cores(cpu_plan):
    checks = check_launch(cpu_plan, _machine(cores=1), nnodes=1)
    assert not failed(checks)
    assert [check.name for check in failed(checks, fatal=False)] == ["cpu workers"]


def test_cuda_plan_needs_gpus(cuda_plan):
    problems = failed(check_launch(cuda_plan, _machine(gpus=0), nnodes=1))
    assert [p.name for p in problems] == ["gpus"] and "no GPU" in problems[0].detail
    problems = failed(check_launch(cuda_plan, _machine(gpus=1), nnodes=1))
    assert [p.name for p in problems] == ["gpus"] and "needs 2 GPU(s) per node, this node has 1" in problems[0].detail
    assert "--gpus 1" in problems[0].hint
    assert not failed(check_launch(cuda_plan, _machine(gpus=2), nnodes=1))


def test_cuda_plan_needs_gpu_memory(tmp_path):
    plan = load_plan(
        write_plan(
            tmp_path / "p.yaml",
            {
                "cluster.device": "cuda",
                "cluster.backend": "nccl",
                "prediction": {
                    "step_time_s": 1.0,
                    "tokens_per_s": 1.0,
                    "tflops_per_gpu": 1.0,
                    "mfu": 0.1,
                    "peak_gpu_bytes": 30 * GIB,
                    "peak_host_bytes": GIB,
                },
            },
        )
    )
    assert not failed(check_launch(plan, _machine(gpus=2, gpu_gib=40), nnodes=1))
    problems = failed(check_launch(plan, _machine(gpus=2, gpu_gib=24), nnodes=1))
    assert [p.name for p in problems] == ["gpu memory"] and "30.00 GiB" in problems[0].detail


def test_old_torch_is_refused(cpu_plan):
    problems = failed(check_launch(cpu_plan, _machine(torch_version="2.3.1"), nnodes=1))
    assert [p.name for p in problems] == ["torch"]


def test_world_size_and_rendezvous_checks(cpu_plan):
    problems = failed(check_launch(cpu_plan, _machine(), nnodes=2, node_rank=0, rdzv_endpoint="h:1"))
    assert [p.name for p in problems] == ["world size"]
    assert "= 2" in problems[0].detail and "= 4" in problems[0].detail
    two_nodes = cpu_plan
    two_nodes.cluster.nodes = 2
    assert [p.name for p in failed(check_launch(two_nodes, _machine(), nnodes=2))] == ["rendezvous"]
    assert [
        p.name for p in failed(check_launch(two_nodes, _machine(), nnodes=2, node_rank=2, rdzv_endpoint="h:29400"))
    ] == ["node rank"]
    assert [p.name for p in failed(check_launch(two_nodes, _machine(), nnodes=2, rdzv_endpoint="no-port"))] == [
        "rendezvous"
    ]
    assert parse_endpoint("[::1]:29400") == ("::1", 29400) and parse_endpoint("h:0") is None


def test_worker_env(cpu_plan, tmp_path):
    env = worker_env(cpu_plan, "configs/plans/example.yaml", cpu_cores=16, current={})
    assert env[PLAN_ENV_VAR].endswith("/configs/plans/example.yaml") and env[PLAN_ENV_VAR].startswith("/")
    assert env["OMP_NUM_THREADS"] == "8"
    assert worker_env(cpu_plan, "p.yaml", cpu_cores=1, current={})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in worker_env(cpu_plan, "p.yaml", cpu_cores=16, current={"OMP_NUM_THREADS": "3"})


def test_failure_report_names_the_root_cause_first():
    stopped = WorkerFailure(rank=0, local_rank=0, pid=10, exit_code=-15)
    killed = WorkerFailure(rank=3, local_rank=1, pid=11, exit_code=-9)
    crashed = WorkerFailure(rank=2, local_rank=0, pid=12, exit_code=1, message="RuntimeError: boom")
    assert order_failures([stopped, crashed, killed]) == [killed, crashed, stopped]
    text = describe_failures([stopped, killed])
    assert text.startswith("worker rank 3 (local rank 1, pid 11) was killed by SIGKILL")
    assert "rank 0 (local rank 0, pid 10) was killed by SIGTERM" in text
    assert describe_failures([crashed]).endswith("exited with code 1: RuntimeError: boom")
    assert exit_code_of(killed) == 137 and exit_code_of(crashed) == 1


def test_launcher_imports_no_cli_click_rich_or_torch():
    import subprocess
    import sys

    code = (
        "import sys, elixir_tune.launcher; print(sorted(m for m in ('click', 'rich', 'torch', 'elixir_tune.cli', "
        "'elixir_tune.search', 'elixir_tune.profiler') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_bootstrap_starts_the_script_or_module_through_worker_main():
    from torch.distributed.run import parse_args

    script = compose_torchrun_argv(LaunchSpec(nproc_per_node=2, script="train.py", bootstrap=True))
    assert script[-3:] == ["-m", "elixir_tune.launcher.worker_main", "train.py"]
    module = compose_torchrun_argv(
        LaunchSpec(nproc_per_node=2, script="pkg.train", bootstrap=True, torchrun_options=["-m"])
    )
    args = parse_args(module)
    assert (args.module, args.training_script, args.training_script_args) == (
        True,
        "elixir_tune.launcher.worker_main",
        ["-m", "pkg.train"],
    )
    # an executable (--no-python) cannot be bootstrapped: it is started as it is
    binary = compose_torchrun_argv(
        LaunchSpec(nproc_per_node=2, script="./a.out", bootstrap=True, torchrun_options=["--no-python"])
    )
    assert binary[-2:] == ["--no-python", "./a.out"]


def test_rdzv_timeout_becomes_join_timeout_unless_the_user_set_one():
    def conf(options):
        spec = LaunchSpec(
            nproc_per_node=1, script="t.py", nnodes=2, rdzv_endpoint="h:1", rdzv_timeout_s=30, torchrun_options=options
        )
        from torch.distributed.run import parse_args

        return parse_args(compose_torchrun_argv(spec)).rdzv_conf

    assert conf([]) == "join_timeout=30"
    assert conf(["--rdzv-conf", "read_timeout=9"]) == "read_timeout=9,join_timeout=30"
    assert conf(["--rdzv-conf=join_timeout=5"]) == "join_timeout=5"


def test_the_engine_reads_the_timeout_elixir_run_exports(monkeypatch):
    from elixir_tune.engine import worker as comm  # what the engine's process group reads
    from elixir_tune.launcher.env import COLLECTIVE_TIMEOUT_ENV

    assert comm.COLLECTIVE_TIMEOUT_ENV == COLLECTIVE_TIMEOUT_ENV
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "12.5")
    assert comm.collective_timeout_s() == 12.5
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV)
    assert comm.collective_timeout_s() == comm.DEFAULT_COLLECTIVE_TIMEOUT_S == 300
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="positive number of seconds"):
        comm.collective_timeout_s()


def test_worker_main_runs_a_script_as_main_with_its_arguments(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys\nprint(__name__, sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "elixir_tune.launcher.worker_main", str(script), "--x", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"__main__ {[str(script), '--x', '1']} True"
    assert "RuntimeWarning" not in result.stderr
