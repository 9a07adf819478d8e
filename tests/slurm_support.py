"""A real Slurm for the test session: `scripts/slurm.sh start` in a temp state dir, stopped at the end.

Without Slurm's daemons installed the tests are skipped loudly, or fail with CHIPLEDGER_REQUIRE_SLURM=1 (CI,
.ci/run). `bash scripts/slurm.sh ensure` (called by `make test`) installs them as root. The cluster: 4 nodes x
8 fake GPUs, partitions a100 (n1, n2) and h100 (n3, n4), accounts vision, nlp, speech, QOS high preempting
normal by requeue (see scripts/slurm.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

REQUIRE_ENV = "CHIPLEDGER_REQUIRE_SLURM"
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm.sh"
DAEMONS = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "mariadb-install-db", "sacct", "sreport")


class SlurmUnavailable(RuntimeError):
    pass


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def missing() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [d for d in DAEMONS if shutil.which(d, path=path) is None]


class Cluster:
    def __init__(self, state_dir: Path, port: int = 16917):
        gone = missing()
        if gone:
            raise SlurmUnavailable(f"Slurm is not installed (missing {', '.join(gone)}): run "
                                   f"`bash scripts/slurm.sh ensure` as root")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test Slurm runs its daemons as root (SlurmUser=root); run the tests as root")
        self.dir = Path(state_dir)
        self.env = {**os.environ, "CHIPLEDGER_SLURM_DIR": str(self.dir), "CHIPLEDGER_SLURM_PORT": str(port),
                    "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}

    def start(self) -> dict:
        p = subprocess.run(["bash", str(SCRIPT), "start"], env=self.env, capture_output=True, text=True, timeout=240)
        if p.returncode != 0:
            raise RuntimeError(f"scripts/slurm.sh start failed:\n{p.stderr}\n{p.stdout}")
        self.env["SLURM_CONF"] = str(self.dir / "etc" / "slurm.conf")
        os.environ["SLURM_CONF"] = self.env["SLURM_CONF"]
        os.environ["PATH"] = self.env["PATH"]
        return self.env

    def stop(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=self.env, capture_output=True, text=True, timeout=120)

    # -- helpers for the tests ------------------------------------------------------------------------
    def cmd(self, *args: str, check: bool = True) -> str:
        p = subprocess.run(list(args), env={**self.env, "TZ": "UTC"}, capture_output=True, text=True, timeout=60,
                           cwd=str(self.dir))
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr}")
        return p.stdout

    def sbatch(self, *args: str) -> str:
        return self.cmd("sbatch", "--parsable", "-o", "/dev/null", *args).strip().split(";")[0]

    def state(self, job: str) -> str:
        return self.cmd("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()

    def wait(self, predicate, timeout: float = 120, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.5)
        raise AssertionError(f"Slurm: {what} not reached within {timeout}s:\n{self.cmd('squeue', check=False)}")

    def queue_empty(self) -> bool:
        return self.cmd("squeue", "-h", "-o", "%i", check=False).strip() == ""
