"""The Slurm launcher (`scripts/slurm/launch.py`) and `train.sbatch` under a faked Slurm environment."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "slurm" / "launch.py"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"

_spec = importlib.util.spec_from_file_location("slurm_launch", LAUNCH)
launch = importlib.util.module_from_spec(_spec)
sys.modules["slurm_launch"] = launch  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(launch)

TWO_NODES = {
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_GPUS_ON_NODE": "4",
}


def expected_command(rank: int, *, config: str = "recipes/deepspeed/zero2.json") -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--use_deepspeed",
        "--deepspeed_config_file", config,
        "--deepspeed_multinode_launcher", "standard",
        "--same_network",
        "--num_machines", "2",
        "--machine_rank", str(rank),
        "--main_process_ip", "gpu07",
        "--main_process_port", "29500",
        "--num_processes", "8",
        "train.py",
        "recipe=qwen3_8b",
        "optim.lr=3e-4",
        "data.name=my data",
    ]  # fmt: skip


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    """A submit directory (the cwd) with the files the launcher checks."""
    (tmp_path / "recipes" / "deepspeed").mkdir(parents=True)
    (tmp_path / "recipes" / "deepspeed" / "zero2.json").write_text("{}")
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# Expansions the fake `scontrol show hostnames` knows (a real one asks Slurm's own parser).
FAKE_HOSTNAMES = {
    "gpu[07-08]": ["gpu07", "gpu08"],
    "gpu07": ["gpu07"],
    "gpu[01-03,07],cpu5": ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"],
}


def write_fake_scontrol(bin_dir: Path) -> Path:
    """An executable `scontrol` that answers `show hostnames EXPR` from FAKE_HOSTNAMES, logs
    its arguments to scontrol.log beside it, and fails like Slurm on anything else."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"table = {FAKE_HOSTNAMES!r}\n"
        f"open({str(bin_dir / 'scontrol.log')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1:3] != ['show', 'hostnames'] or sys.argv[3] not in table:\n"
        "    sys.exit('scontrol: error: Invalid hostlist: ' + ' '.join(sys.argv[3:]))\n"
        "print('\\n'.join(table[sys.argv[3]]))\n"
    )
    fake.chmod(0o755)
    return fake


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """The fake `scontrol` first on PATH; returns its directory (holding scontrol.log)."""
    bin_dir = tmp_path / "fake_slurm_bin"
    write_fake_scontrol(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


# --------------------------------------------------------------------------- node lists
def test_nodelist_is_expanded_by_scontrol_show_hostnames(fake_scontrol):
    hosts = launch.expand_nodelist("gpu[01-03,07],cpu5")
    assert hosts == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert (fake_scontrol / "scontrol.log").read_text() == "show hostnames gpu[01-03,07],cpu5\n"


def test_missing_scontrol_names_the_nodelist_and_scontrol(tmp_path, monkeypatch):
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(launch.LaunchError, match=r"\$SLURM_JOB_NODELIST='gpu\[07-08\]'.*"
                       r"scontrol show hostnames.*no scontrol is on PATH"):
        launch.expand_nodelist("gpu[07-08]")


def test_failing_scontrol_is_an_error_naming_its_message(fake_scontrol):
    with pytest.raises(launch.LaunchError, match=r"\$SLURM_JOB_NODELIST='gpu\[07-': .*"
                       r"show hostnames` failed \(scontrol: error: Invalid hostlist: gpu\[07-\)"):
        launch.expand_nodelist("gpu[07-")


# --------------------------------------------------------------------------- the command
@pytest.mark.parametrize("rank", [0, 1])
def test_dry_run_prints_exact_command_per_node(job_dir, fake_scontrol, capsys, rank):
    env = {**TWO_NODES, "SLURM_NODEID": str(rank)}
    argv = ["--recipe", "qwen3_8b", "--dry-run", "--", "optim.lr=3e-4", "data.name=my data"]
    assert launch.main(argv, env=env) == 0
    out = capsys.readouterr().out.strip()
    assert shlex.split(out) == expected_command(rank)
    assert "'data.name=my data'" in out  # shell-quoted, safe to paste


def test_gpu_count_sources_and_precedence():
    env = {**TWO_NODES, "SLURM_NODEID": "0"}
    fake_expand = FAKE_HOSTNAMES.__getitem__
    assert launch.read_slurm_layout(env, expand=fake_expand).num_processes == 8
    assert launch.read_slurm_layout(env, gpus_per_node=2, expand=fake_expand).num_processes == 4
    per_node = {k: v for k, v in env.items() if k != "SLURM_GPUS_ON_NODE"}
    per_node["SLURM_GPUS_PER_NODE"] = "h100:8"
    assert launch.read_slurm_layout(per_node, expand=fake_expand).num_processes == 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_NNODES": None}, r"\$SLURM_NNODES is not set"),
        ({"SLURM_NODEID": None}, r"\$SLURM_NODEID is not set"),
        ({"SLURM_JOB_NODELIST": None}, r"\$SLURM_JOB_NODELIST is not set"),
        ({"SLURM_GPUS_ON_NODE": None}, r"SLURM_GPUS_ON_NODE nor \$SLURM_GPUS_PER_NODE"),
        ({"SLURM_NNODES": "two"}, r"\$SLURM_NNODES must be an integer, got 'two'"),
        ({"SLURM_NODEID": "2"}, r"\$SLURM_NODEID=2 is outside 0..1"),
        ({"SLURM_JOB_NODELIST": "gpu07"}, r"names 1 hosts, fewer than \$SLURM_NNODES=2"),
        ({"SLURM_JOB_NODELIST": "gpu[07-"}, r"\$SLURM_JOB_NODELIST='gpu\[07-': .*Invalid hostlist"),
    ],
)
def test_missing_or_bad_variables_fail_clearly(job_dir, fake_scontrol, capsys, change, message):
    env = {**TWO_NODES, "SLURM_NODEID": "1"}
    for name, value in change.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = value
    assert launch.main(["--recipe", "qwen3_8b", "--dry-run"], env=env) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(message, captured.err), captured.err


def test_missing_deepspeed_config_is_named(job_dir, capsys):
    env = {**TWO_NODES, "SLURM_NODEID": "0"}
    argv = [
        "--recipe",
        "qwen3_8b",
        "--deepspeed-config",
        "recipes/deepspeed/zero9.json",
        "--dry-run",
    ]
    assert launch.main(argv, env=env) == 2
    assert (
        "--deepspeed-config: recipes/deepspeed/zero9.json does not exist" in capsys.readouterr().err
    )


# --------------------------------------------------------------------------- train.sbatch
def test_sbatch_runs_launcher_once_per_node_under_srun(job_dir):
    """Run train.sbatch with a fake `srun` that plays both nodes of the step, in dry-run mode."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not available")
    (job_dir / "scripts" / "slurm").mkdir(parents=True)
    shutil.copy(LAUNCH, job_dir / "scripts" / "slurm" / "launch.py")
    bin_dir = job_dir / "bin"
    bin_dir.mkdir()
    # Fake srun: checks it was asked for one task per node, then runs the command as each node.
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        'echo "srun $*" >> srun.log\n'
        'while [[ "$1" == --* ]]; do shift; done\n'
        'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@" || exit $?; done\n'
    )
    (bin_dir / "srun").chmod(0o755)
    write_fake_scontrol(bin_dir)  # the node list comes from `scontrol show hostnames`
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
        **TWO_NODES,
        "SLURM_SUBMIT_DIR": str(job_dir),
        "SLURM_JOB_ID": "42",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "DRY_RUN": "1",
    }
    result = subprocess.run(
        [bash, str(SBATCH), "qwen3_8b", "optim.lr=3e-4", "data.name=my data"],
        cwd=job_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if "accelerate.commands.launch" in line]
    assert [shlex.split(line) for line in commands] == [expected_command(0), expected_command(1)]
    assert "--ntasks-per-node=1" in (job_dir / "srun.log").read_text()


def test_sbatch_without_recipe_fails_with_usage(tmp_path):
    result = subprocess.run(
        ["bash", str(SBATCH)], cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "usage: sbatch scripts/slurm/train.sbatch RECIPE" in result.stderr


def test_command_parses_with_accelerates_own_parser():
    """Every flag the launcher emits is one `accelerate launch` accepts, with the intended value."""
    from accelerate.commands.launch import launch_command_parser

    command = expected_command(1)
    args = launch_command_parser().parse_args(command[3:])
    assert args.use_deepspeed and args.same_network
    assert args.deepspeed_multinode_launcher == "standard"
    assert (args.num_machines, args.machine_rank, args.num_processes) == (2, 1, 8)
    assert (args.main_process_ip, args.main_process_port) == ("gpu07", 29500)
    assert args.training_script == "train.py"
    assert args.training_script_args == ["recipe=qwen3_8b", "optim.lr=3e-4", "data.name=my data"]
