"""Runs the 2-process checks of the test suite in one launch: 2 CPU processes on one gloo process group (the session
fixture ``gloo_runs`` in tests/conftest.py starts it). Each launch of 2 processes costs ~20 s of imports (torch and
Lightning) on a 2-core machine, most checks take a few seconds: one launch for all of them.

Usage: gloo_checks.py OUT_DIR CHECK [CHECK ...]. A CHECK is ``SCRIPT/ARG/...`` (``ddp_resume/delayed``,
``fsdp2_train/delayed/single``, ``ddp_stats``): ``main(OUT_DIR/FOLDER, *ARGS)`` of tests/scripts/SCRIPT.py, FOLDER being
:func:`folder` of the check, each check in its own folder.

This process is rank 0. It starts rank 1 first (this command line, ``LOCAL_RANK=1``), so that the two import in
parallel (``GLOO_WORLD_SIZE=N`` in the environment: N processes, ranks 1 to N-1 started first); then it runs, alone,
the checks whose script's ``single_process(*ARGS)`` is true (the one-process references, before any process group
exists, as their scripts run them on their own); then all ranks set up the process group as torchrun would
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``RANK``) and run the other checks, in the order
given. Lightning's Trainer and Fabric find the process group and the environment and launch nothing.

A check that raises writes its traceback to ``error_rank{R}.txt`` in its folder and the next check runs; one that
returns writes ``done_rank{R}``. The tests read the folders (``gloo_runs.folder(check)`` fails with the traceback or
with this run's output when a check did not complete).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def folder(check: str) -> str:
    """The check's folder name (tests/utils.py's ``gloo_check_folder`` finds it by the same rule)."""
    return check.replace("/", "__").replace(",", "-")


def parse(check: str):
    script, *args = check.split("/")
    return importlib.import_module(script), args


def run(check: str, out_dir: str, rank: int) -> bool:
    path = os.path.join(out_dir, folder(check))
    os.makedirs(path, exist_ok=True)
    print(f"[rank {rank}] {check}: start", flush=True)
    try:
        module, args = parse(check)
        module.main(path, *args)
    except Exception:  # noqa: BLE001  (recorded for the check's test; the next check runs)
        error = traceback.format_exc()
        print(f"[rank {rank}] {check}: FAILED\n{error}", file=sys.stderr, flush=True)
        with open(os.path.join(path, f"error_rank{rank}.txt"), "w") as f:
            f.write(error)
        return False
    open(os.path.join(path, f"done_rank{rank}"), "w").close()
    print(f"[rank {rank}] {check}: done", flush=True)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out_dir: str, checks: list[str]) -> int:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("GLOO_WORLD_SIZE", "2"))
    children = []
    if rank == 0:
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world),
            "NODE_RANK": "0",
        }
        children = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), out_dir, *checks],
                env={**env, "LOCAL_RANK": str(r), "RANK": str(r)},
            )
            for r in range(1, world)
        ]
    single = [c for c in checks if getattr(parse(c)[0], "single_process", lambda *args: False)(*parse(c)[1])]
    distributed = [c for c in checks if c not in single]
    ok = True
    if rank == 0:
        with open(os.path.join(out_dir, "plan.json"), "w") as f:
            json.dump({"single": single, "distributed": distributed, "world": world}, f)
        for check in single:
            ok &= run(check, out_dir, 0)
        os.environ.update(
            {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK")}, LOCAL_RANK="0", RANK="0"
        )

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    for check in distributed:
        ok &= run(check, out_dir, rank)
    dist.barrier()
    dist.destroy_process_group()
    for child in children:
        ok &= child.wait() == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
