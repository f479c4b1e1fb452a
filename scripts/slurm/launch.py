"""Start one node's share of a multi-node DSpine training job under Slurm.

`train.sbatch` runs this once per node (`srun --ntasks-per-node=1`). It reads the job layout
from Slurm's environment and replaces itself with

    python -m accelerate.commands.launch --use_deepspeed --deepspeed_config_file CONFIG \
        --deepspeed_multinode_launcher standard --same_network \
        --num_machines $SLURM_NNODES --machine_rank $SLURM_NODEID \
        --main_process_ip FIRST_HOST --main_process_port PORT \
        --num_processes NODES*GPUS_PER_NODE train.py recipe=NAME [overrides...]

where FIRST_HOST is the first host of $SLURM_JOB_NODELIST (expanded by Slurm's `scontrol show
hostnames`, which must be on PATH) and GPUS_PER_NODE comes from
`--gpus-per-node`, $SLURM_GPUS_ON_NODE or $SLURM_GPUS_PER_NODE, in that order.

Usage (inside an allocation; `--dry-run` prints the command and exits 0):

    python scripts/slurm/launch.py --recipe qwen3_8b [--dry-run] -- optim.lr=3e-4 seed=1
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DEEPSPEED_CONFIG = "recipes/deepspeed/zero2.json"
DEFAULT_MAIN_PROCESS_PORT = 29500


class LaunchError(RuntimeError):
    """A problem with the Slurm environment or the arguments; the message says which."""


# --------------------------------------------------------------------------- node lists
def expand_nodelist(expression: str, scontrol: str | None = None) -> list[str]:
    """Hosts of a Slurm nodelist, in order, expanded by Slurm's own `scontrol show hostnames`.

    `scontrol` is the path of the scontrol binary (default: looked up on PATH). Raises
    `LaunchError` naming $SLURM_JOB_NODELIST and scontrol when scontrol is absent, fails or
    prints no host.
    """
    scontrol = scontrol or shutil.which("scontrol")
    if not scontrol:
        raise LaunchError(
            f"$SLURM_JOB_NODELIST={expression!r} is expanded by `scontrol show hostnames`, "
            "and no scontrol is on PATH (run inside a Slurm allocation, or put Slurm's bin "
            "directory on PATH)"
        )
    try:
        result = subprocess.run(
            [scontrol, "show", "hostnames", expression], capture_output=True, text=True
        )
    except OSError as err:
        raise LaunchError(f"$SLURM_JOB_NODELIST: cannot run {scontrol} ({err})") from None
    hosts = result.stdout.split()
    if result.returncode != 0 or not hosts:
        reason = result.stderr.strip() or f"exit status {result.returncode}, no host printed"
        raise LaunchError(
            f"$SLURM_JOB_NODELIST={expression!r}: `{scontrol} show hostnames` failed ({reason})"
        )
    return hosts


# --------------------------------------------------------------------------- Slurm environment
@dataclass(frozen=True)
class SlurmLayout:
    """Where this process sits in the job.

    Attributes:
        num_nodes: nodes in the job ($SLURM_NNODES).
        node_rank: this node's index ($SLURM_NODEID), 0-based.
        hosts: expanded $SLURM_JOB_NODELIST; hosts[0] runs the main process.
        gpus_per_node: training processes per node.
    """

    num_nodes: int
    node_rank: int
    hosts: list[str]
    gpus_per_node: int

    @property
    def main_host(self) -> str:
        """Address of the machine of rank 0: the first host of the job."""
        return self.hosts[0]

    @property
    def num_processes(self) -> int:
        """Training processes in the whole job."""
        return self.num_nodes * self.gpus_per_node


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise LaunchError(f"${name} is not set: run inside a Slurm allocation (sbatch/srun)")
    return value


def _as_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"${name} must be an integer, got {value!r}") from None


def _gpu_count(name: str, value: str) -> int:
    """GPUs in `[type:]count[,[type:]count...]` (the form of $SLURM_GPUS_PER_NODE)."""
    total = 0
    for part in value.split(","):
        total += _as_int(name, part.rsplit(":", 1)[-1])
    return total


def read_slurm_layout(
    env: Mapping[str, str],
    gpus_per_node: int | None = None,
    expand: Callable[[str], list[str]] = expand_nodelist,
) -> SlurmLayout:
    """The job layout from Slurm's variables; `LaunchError` names any missing or bad one.

    GPUs per node: `gpus_per_node` when given, else $SLURM_GPUS_ON_NODE, else
    $SLURM_GPUS_PER_NODE (which may carry a type, `h100:8`).
    """
    num_nodes = _as_int("SLURM_NNODES", _required(env, "SLURM_NNODES"))
    node_rank = _as_int("SLURM_NODEID", _required(env, "SLURM_NODEID"))
    nodelist = _required(env, "SLURM_JOB_NODELIST")
    if num_nodes < 1:
        raise LaunchError(f"$SLURM_NNODES must be >= 1, got {num_nodes}")
    if not 0 <= node_rank < num_nodes:
        raise LaunchError(
            f"$SLURM_NODEID={node_rank} is outside 0..{num_nodes - 1} ($SLURM_NNODES)"
        )
    hosts = expand(nodelist)
    if len(hosts) < num_nodes:
        raise LaunchError(
            f"$SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} hosts, fewer than "
            f"$SLURM_NNODES={num_nodes}"
        )

    if gpus_per_node is None:
        for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
            if env.get(name, "").strip():
                gpus_per_node = _gpu_count(name, env[name].strip())
                break
        else:
            raise LaunchError(
                "cannot tell the GPUs per node: neither $SLURM_GPUS_ON_NODE nor "
                "$SLURM_GPUS_PER_NODE is set (request GPUs with --gpus-per-node, or pass "
                "--gpus-per-node to launch.py)"
            )
    if gpus_per_node < 1:
        raise LaunchError(f"GPUs per node must be >= 1, got {gpus_per_node}")
    return SlurmLayout(num_nodes, node_rank, hosts, gpus_per_node)


# --------------------------------------------------------------------------- the command
def build_command(
    layout: SlurmLayout,
    *,
    recipe: str,
    overrides: Sequence[str] = (),
    deepspeed_config: str = DEFAULT_DEEPSPEED_CONFIG,
    main_process_port: int = DEFAULT_MAIN_PROCESS_PORT,
    train_script: str = "train.py",
    python: str = sys.executable,
) -> list[str]:
    """The `accelerate launch` command line for this node (argv list, not shell text).

    `--deepspeed_multinode_launcher standard` makes accelerate start torchrun on this node only
    (srun already runs one launcher per node; the default pdsh launcher would ssh to the others);
    `--same_network` gives every node the same static rendezvous at main_host:port.
    """
    return [
        python, "-m", "accelerate.commands.launch",
        "--use_deepspeed",
        "--deepspeed_config_file", deepspeed_config,
        "--deepspeed_multinode_launcher", "standard",
        "--same_network",
        "--num_machines", str(layout.num_nodes),
        "--machine_rank", str(layout.node_rank),
        "--main_process_ip", layout.main_host,
        "--main_process_port", str(main_process_port),
        "--num_processes", str(layout.num_processes),
        train_script,
        f"recipe={recipe}",
        *overrides,
    ]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description="Run this node's `accelerate launch` (DeepSpeed) of train.py under Slurm.",
    )
    parser.add_argument("--recipe", required=True, help="recipe name, e.g. qwen3_8b")
    parser.add_argument(
        "--deepspeed-config",
        default=DEFAULT_DEEPSPEED_CONFIG,
        help=f"DeepSpeed JSON (default {DEFAULT_DEEPSPEED_CONFIG})",
    )
    parser.add_argument("--main-process-port", type=int, default=DEFAULT_MAIN_PROCESS_PORT)
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="processes per node (default: $SLURM_GPUS_ON_NODE, then $SLURM_GPUS_PER_NODE)",
    )
    parser.add_argument("--train-script", default="train.py")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit 0")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for train.py (after --)")
    return parser


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Build this node's command; print it (`--dry-run`) or exec it. Returns the exit status."""
    args = _parser().parse_args(argv)
    env = os.environ if env is None else env
    try:
        if not 1 <= args.main_process_port <= 65535:
            raise LaunchError(
                f"--main-process-port must be in 1..65535, got {args.main_process_port}"
            )
        for flag, path in (
            ("--deepspeed-config", args.deepspeed_config),
            ("--train-script", args.train_script),
        ):
            if not Path(path).is_file():
                raise LaunchError(f"{flag}: {path} does not exist (relative to {Path.cwd()})")
        layout = read_slurm_layout(env, args.gpus_per_node)
    except LaunchError as err:
        print(f"launch.py: error: {err}", file=sys.stderr)
        return 2
    command = build_command(
        layout,
        recipe=args.recipe,
        overrides=args.overrides,
        deepspeed_config=args.deepspeed_config,
        main_process_port=args.main_process_port,
        train_script=args.train_script,
    )
    if args.dry_run:
        print(shlex.join(command))
        return 0
    print(
        f"[launch.py node {layout.node_rank}/{layout.num_nodes}] {shlex.join(command)}", flush=True
    )
    # exec, not a child process: srun's signals (preemption, time limit) reach accelerate directly.
    os.execv(command[0], command)
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
