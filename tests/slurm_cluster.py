"""A private Slurm cluster for the tests: its own munge key and ``munged``, ``slurmctld`` and ``slurmd`` on
loopback, free ports, every file under one temporary folder, every daemon ended by its pid at the end.

Debian's ``slurm-wlm`` + ``munge`` (installed by ``scripts/system-deps.sh``), run as root (Slurm's ``SlurmUser``
and the jobs' user are root here: a test machine, not a shared cluster). Nothing outside the temporary folder
is touched: the system's ``/etc/munge`` and ``/etc/slurm`` stay as they are (``AuthInfo=socket=`` points Slurm
at the private ``munged``; every command gets ``SLURM_CONF``), and two runs at once never meet (their own
ports, folders and socket).

    with SlurmCluster(tmp_path) as c:
        job = c.sbatch(["scripts/slurm/train_torch.sbatch", "--steps", "4"])
        c.wait(job, "COMPLETED")

What the daemons started (``slurmstepd``, the job's processes) carries ``SLURM_CONF=<this cluster's file>`` in its
environment: :meth:`close` cancels every job, then ends the daemons by their pid files, then any process
still carrying that variable by its pid, and :meth:`leftovers` lists what is left (should be nothing).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")


def available() -> tuple[bool, str]:
    """``(True, "")`` where a private cluster can start here, else ``(False, why in one line)``."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return False, (f"{', '.join(missing)} not found: install Debian's slurm-wlm and munge "
                       "(scripts/system-deps.sh does, as root)")
    if os.geteuid() != 0:
        return False, "the private Slurm runs its daemons and jobs as root (SlurmUser=root); run the tests as root"
    return True, ""


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


CONF = """\
ClusterName={name}
SlurmctldHost={host}
SlurmUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# seconds, not minutes: a test waits on each of these
SlurmdTimeout={slurmd_timeout}
KillWait={kill_wait}
MessageTimeout=10
MinJobAge=600
InactiveLimit=0
SchedulerType=sched/builtin
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmCluster:
    """One ``slurmctld`` and one ``slurmd`` per node, on this host. ``nodes``: ``[(name, addr)]``; default one
    node named after this host on 127.0.0.1."""

    def __init__(self, root: Path, *, cpus: int = 2, slurmd_timeout: int = 5, kill_wait: int = 15):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.node = self.host
        self.cpus = cpus
        self.slurmd_timeout, self.kill_wait = slurmd_timeout, kill_wait
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del self.env[k]   # a test run inside a Slurm job must not hand its job's settings to these commands
        self._daemons: dict[str, subprocess.Popen] = {}

    # -- life cycle --------------------------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)          # munged refuses a key or socket folder others can write
        for d in ("state",):
            (self.root / d).mkdir(exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port = _free_ports(2)
        self.conf.write_text(CONF.format(
            name=f"t{os.getpid()}", host=self.host, ctld_port=ctld_port, slurmd_port=slurmd_port, root=self.root,
            slurmd_timeout=self.slurmd_timeout, kill_wait=self.kill_wait,
            nodes=f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"))
        self._spawn("munged", ["munged", "--force", "--foreground", f"--socket={self.root}/munge.socket",
                               f"--key-file={key}", f"--pid-file={self.root}/munged.pid",
                               f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munged.seed"])
        self._wait_for(lambda: (self.root / "munge.socket").exists(), "munged's socket", 10)
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self.start_slurmd()
        self._wait_for(lambda: self.node_state() == "idle", f"node {self.node} idle", 30)

    def start_slurmd(self, wait: bool = False) -> None:
        """Start the node's slurmd; ``wait``: until slurmctld has it back (idle). A restarted node must have
        registered before a job is started on it: a batch job launched in between was cancelled "due to node
        failure" when the registration arrived, and ended FAILED (JobLaunchFailure), not requeued (seen here)."""
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        if wait:
            self._wait_for(lambda: self.node_state() == "idle", f"node {self.node} idle again", 60)

    def _spawn(self, name: str, argv: list[str]) -> None:
        # Only slurmd's environment carries SLURM_CONF (its steps and the jobs' processes inherit it, which is how
        # kill_node and close find them); munged and slurmctld are told their files by flags.
        env = self.env if name == "slurmd" else {k: v for k, v in self.env.items() if k != "SLURM_CONF"}
        log = open(self.root / f"{name}.out", "ab")
        self._daemons[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self._daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > end:
                tail = "".join((self.root / f"{n}.out").read_text(errors="replace")[-600:] for n in dead)
                raise RuntimeError(f"private Slurm: no {what} after {timeout} s; ended: {dead} {tail}")
            time.sleep(0.1)

    def kill_node(self) -> list[int]:
        """A node failure: SIGKILL slurmd and everything it started (its job steps and their processes), as a
        machine losing power would. Returns the pids killed."""
        p = self._daemons.pop("slurmd")
        p.kill()
        p.wait()
        return self._kill_carriers()

    def wait_node_down(self, timeout: float = 60) -> float:
        """After :meth:`kill_node`: wait until slurmctld declares the node DOWN by itself (no answer within
        SlurmdTimeout; it requeues the node's ``--requeue`` jobs as NODE_FAIL). Returns the seconds waited
        (~25 s here with SlurmdTimeout=5: "not responding" at ~12 s, DOWN at ~25 s)."""
        t0 = time.monotonic()
        self._wait_for(lambda: "down" in self.node_state(), f"node {self.node} down", timeout)
        return time.monotonic() - t0

    def close(self) -> None:
        if self._daemons.get("slurmctld") and self._daemons["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env, capture_output=True, timeout=20)
            end = time.monotonic() + 20
            while time.monotonic() < end and self.squeue():
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self._daemons.pop(name, None)
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._kill_carriers()

    def _carriers(self) -> list[int]:
        """Processes whose environment says they belong to this cluster (``SLURM_CONF=<our file>``)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != os.getpid():
                try:
                    if mark in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                        pids.append(int(d))
                except OSError:
                    pass
        return pids

    def _kill_carriers(self) -> list[int]:
        pids = self._carriers()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 5
        while time.monotonic() < end and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids):
            time.sleep(0.05)
        return pids

    def leftovers(self) -> list[int]:
        """Processes of this cluster still alive (daemons, steps, tasks): ``[]`` after :meth:`close`."""
        return [p for p in self._carriers() if _alive(p)] + [
            p.pid for p in self._daemons.values() if p.poll() is None]

    # -- using it ----------------------------------------------------------------------------------------------
    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                           timeout=kw.pop("timeout", 30), **kw)
        if check and r.returncode:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def node_state(self) -> str:
        return self.run(["sinfo", "-h", "-n", self.node, "-o", "%T"], check=False).stdout.strip()

    def squeue(self) -> list[str]:
        return self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()

    def sbatch(self, argv: list[str], env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        """``sbatch --parsable ...``: the completed process (``.stdout`` is the job id when it was accepted)."""
        return self.run(["sbatch", "--parsable", *argv], check=False, env=env or {}, cwd=cwd)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``: ``{"JobState": "RUNNING", "Restarts": "1", ...}`` ({} once purged)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, states, timeout: float = 60, *, until=None) -> dict[str, str]:
        """Poll ``scontrol show job`` until its JobState is one of ``states`` (and ``until(info)`` holds)."""
        states = {states} if isinstance(states, str) else set(states)
        end = time.monotonic() + timeout
        seen = []
        while True:
            info = self.job(job_id)
            st = info.get("JobState")
            if not seen or seen[-1] != st:
                seen.append(st)
            if st in states and (until is None or until(info)):
                return info
            if time.monotonic() > end:
                raise TimeoutError(f"job {job_id}: states {seen}, not {sorted(states)} after {timeout} s; "
                                   f"reason {info.get('Reason')}")
            time.sleep(0.2)

    def release(self, job_id: str, restarts: int, timeout: float = 60) -> dict[str, str]:
        """Wait for the job's requeue number ``restarts`` (PENDING again), then start it now: Slurm holds a
        requeued job ~120 s (its BeginTime; 121 s measured here with 22.05), which an admin may lift exactly
        so. Returns the job once it runs again."""
        self.wait(job_id, "PENDING", timeout, until=lambda i: i.get("Restarts") == str(restarts))
        # Released at once, the new start raced the old one's end: slurmd refused it ("Job credential revoked":
        # its revocation of the killed start is stamped to the second) and the job ended FAILED. Slurm's own hold
        # avoids that; here: the node empty again, then a 2 s margin.
        self._wait_for(lambda: self.node_state() == "idle", f"node {self.node} idle after the requeue", timeout)
        time.sleep(2)
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
        return self.wait(job_id, "RUNNING", timeout)

    def jobcomp(self) -> list[dict[str, str]]:
        """The job-completion log (``jobcomp/filetxt``): one record per end of a job, requeues included."""
        path = self.root / "jobcomp.txt"
        if not path.exists():
            return []
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in path.read_text().splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
