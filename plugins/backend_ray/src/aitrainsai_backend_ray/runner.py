"""Runs one payload on a Ray node. The backend copies this file into the job's folder on shared storage as
``runner.py``; the job's entrypoint starts it from ``<job>/work`` (the payload's files) on the node's interpreter.

It reads ``../spec.json`` (the command, its time limit, what the node must have) and ``../env.json`` (the
environment with the secrets, mode 0600, deleted before anything runs), checks the node, runs the command with
its output on the job's log, and records how it ended in ``../outcome.json``. Standard library only (``psutil`` and
``packaging`` where the node has them, as every Ray node does): it runs on whatever interpreter the node has."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REFUSED = 97  # the node lacks what the payload needs (outcome.json says what)
TIMEOUT = 124  # as coreutils' timeout


def main() -> int:
    job = Path.cwd().parent
    spec = json.loads((job / "spec.json").read_text())
    env_path = job / "env.json"
    try:
        env = json.loads(env_path.read_text())
    finally:
        env_path.unlink(missing_ok=True)
    (job / "pid").write_text(str(os.getpid()))
    started = time.time()
    problem = install_no_deps(spec) or unmet(spec)
    if problem:
        record(job, refused=problem, started=started)
        print(f"aitrainsai: refused: {problem}", flush=True)
        return REFUSED
    command = list(spec["command"])
    if command[0] == "python":  # the worker's interpreter: the one running this runner
        command[0] = sys.executable
    try:
        child = subprocess.Popen(command, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    except OSError as exc:
        record(job, code=127, started=started, error=str(exc))
        print(f"aitrainsai: could not start {command[0]}: {exc}", flush=True)
        return 127
    try:
        code = child.wait(timeout=float(spec["timeout_s"]))
    except subprocess.TimeoutExpired:
        kill_tree(child.pid, float(spec.get("kill_grace_s", 5.0)))
        child.wait()
        record(job, code=TIMEOUT, timeout=True, started=started)
        print(f"aitrainsai: timed out after {spec['timeout_s']:g} s", flush=True)
        return TIMEOUT
    record(job, code=code, started=started)
    return code if code >= 0 else 128 - code  # death by signal N: 128 + N, as a shell reports it


def install_no_deps(spec: dict) -> str:
    """With Ray's pip runtime env, the distributions to install without their dependencies go into its virtualenv
    here, one job at a time (jobs of the same runtime share the virtualenv); '' or why they could not."""
    wanted = spec.get("install_no_deps")
    if not wanted:
        return ""
    if sys.prefix == sys.base_prefix:
        return f"no virtualenv to install {', '.join(wanted)} into: the job did not start in Ray's runtime env"
    import fcntl

    with open(Path(sys.prefix) / ".aitrainsai-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                 "--no-deps", *spec.get("pip_options", []),
                                 *(f"{name}{version}" for name, version in sorted(wanted.items()))],
                                stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        tail = " ".join((result.stderr or result.stdout).split())[-400:]
        return f"{', '.join(sorted(wanted))} could not be installed on node {socket.gethostname()}: {tail}"
    return ""


def unmet(spec: dict) -> str:
    """Why this node cannot run the payload (one line), or ''."""
    from importlib import metadata

    node = socket.gethostname()
    for name, wanted in spec.get("distributions", {}).items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            return f"distribution {name} is not installed on node {node} ({sys.prefix})"
        if wanted and not compatible(version, wanted):
            return f"distribution {name} {version} is installed on node {node}; the payload needs {name}{wanted}"
    disk_gb = spec.get("disk_gb")
    if disk_gb is not None:
        free = shutil.disk_usage(".").free / 2**30
        if disk_gb > free:
            return f"the payload needs {disk_gb:g} GB of free disk; {free:.1f} GB are free in its folder on {node}"
    shm_gb = spec.get("shm_gb")
    if shm_gb is not None:
        try:
            stats = os.statvfs("/dev/shm")
            shm = stats.f_frsize * stats.f_blocks / 2**30
        except OSError:
            shm = 0.0
        if shm_gb > shm:
            return f"the payload needs {shm_gb:g} GB of /dev/shm; node {node} has {shm:.1f} GB"
    return ""


def compatible(version: str, wanted: str) -> bool:
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # only exact pins can be checked without packaging
        return not wanted.startswith("==") or wanted[2:].strip() == version
    return SpecifierSet(wanted).contains(version, prereleases=True)


def kill_tree(pid: int, grace_s: float) -> None:
    """SIGTERM the payload and everything it started, SIGKILL what is left after ``grace_s``."""
    try:
        import psutil
    except ImportError:
        _signal(pid, signal.SIGTERM)
        time.sleep(grace_s)
        _signal(pid, signal.SIGKILL)
        return
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def record(job: Path, **outcome) -> None:
    outcome["ended"] = time.time()
    partial = job / "outcome.json.partial"
    partial.write_text(json.dumps(outcome))
    partial.replace(job / "outcome.json")


if __name__ == "__main__":
    sys.exit(main())
