"""A sandbox's CPU share (issue 51): one job's code, however many processes it starts, uses at most its cores' worth
of CPU time; the quota written for cgroup v1 and v2, the share a backend sizes from its slots, and what holds where
no CPU cgroup can be made."""

import asyncio
import os
import sys
import textwrap
import time
from pathlib import Path, PurePosixPath

import pytest

import aitrainsai.isolation.sandbox as sandbox_module
import aitrainsai.isolation.view as job_view
from aitrainsai.builtin.local_backend import LocalBackend
from aitrainsai.isolation import Limits, make_sandbox
from aitrainsai.isolation.cgroup import CGROUP_ROOT, CPU_PERIOD_US, Cgroup, cpu_share_enforced
from aitrainsai.isolation.container import ContainerIsolation
from aitrainsai.isolation.contract import CPUS_VARIABLE, MIN_CPUS
from aitrainsai.isolation.namespace import NamespaceIsolation

pytestmark = pytest.mark.hostile
CORES = len(os.sched_getaffinity(0))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are made by root only")
needs_cpu_cgroup = pytest.mark.skipif(not cpu_share_enforced(), reason="no CPU cgroup can be made here")
needs_namespace = pytest.mark.skipif(NamespaceIsolation().problem() is not None,
                                     reason="this machine cannot build the namespace sandbox")


def _python_for_others() -> str | None:
    """An interpreter a uid owning nothing can run (this checkout's may live under a private /root)."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        real = os.path.realpath(path)
        if os.path.isfile(real) and all(os.stat(p).st_mode & 0o001 for p in map(str, PurePosixPath(real).parents)) \
                and os.stat(real).st_mode & 0o005 == 0o005:
            return path
    return None


PYTHON = _python_for_others()
needs_container = pytest.mark.skipif(os.geteuid() != 0 or PYTHON is None,
                                     reason="the container strategy needs root and an interpreter others can run")
# every core busy, twice over, for a few seconds: the hostile job of the issue (a tool server's 190 processes)
BURNER = f"""
    import os, threading, time
    def spin():
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            pass
    children = []
    for _ in range({CORES}):
        pid = os.fork()
        if pid == 0:
            os.setsid()  # a session of its own: out of the kernel's per-session autogroup
            threads = [threading.Thread(target=spin) for _ in range(2)]
            for t in threads:
                t.start()
            spin()
            os._exit(0)
        children.append(pid)
    spin()
    for pid in children:
        os.waitpid(pid, 0)
"""


def boxed(strategy, tmp_path: Path, code: str, python: str | None = None, **limits):
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    return strategy.run([python or sys.executable, "-c", textwrap.dedent(code)], job_dir=job,
                        limits=Limits(**{"wall_s": 60, **limits}))


# -- the quota, as written ----------------------------------------------------------------------------------------
def fake_v2(root: Path, controllers: str = "cpu memory pids") -> Path:
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text(controllers + "\n")
    return root


@needs_root
@pytest.mark.parametrize("cpus, line", [(0.5, "50000 100000"), (2.0, "200000 100000"), (1 / 3, "33333 100000"),
                                        (0.001, "1000 100000")])
def test_cgroup_v2_gets_cpu_max_from_the_share(tmp_path, cpus, line):
    root = fake_v2(tmp_path / "cgroup")
    group = Cgroup.create(2**30, 64, cpus, root=root)
    assert group is not None and group.version == 2 and group.cpu_limited
    folder = group.folders[0]
    assert (folder / "cpu.max").read_text() == line
    assert (folder / "cpu.weight").read_text() == str(max(1, round(100 * cpus)))
    assert (folder / "memory.max").read_text() == str(2**30) and (folder / "pids.max").read_text() == "64"
    (folder / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert group.cpu_seconds() == 2.5


@needs_root
def test_cgroup_v2_without_a_share_or_a_cpu_controller_keeps_its_other_limits(tmp_path):
    uncapped = Cgroup.create(2**30, 64, None, root=fake_v2(tmp_path / "a"))
    assert uncapped is not None and not uncapped.cpu_limited
    assert not (uncapped.folders[0] / "cpu.max").exists()
    no_cpu = Cgroup.create(2**30, 64, 0.5, root=fake_v2(tmp_path / "b", "memory pids"))
    assert no_cpu is not None and not no_cpu.cpu_limited
    assert not (no_cpu.folders[0] / "cpu.max").exists() and (no_cpu.folders[0] / "pids.max").read_text() == "64"


def fake_v1(root: Path, parent_quota: int = -1, combined: bool = False) -> Path:
    for controller in ("memory", "pids", "cpu") if combined else ("memory", "pids", "cpu", "cpuacct"):
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")
    (root / "cpu" / "cpu.cfs_quota_us").write_text(str(parent_quota))
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000")
    (root / ("cpu" if combined else "cpuacct") / "cpuacct.usage").write_text("0")
    if combined:
        (root / "cpuacct").symlink_to("cpu")  # cpu,cpuacct mounted once
    return root


@needs_root
@pytest.mark.parametrize("combined", [False, True])
def test_cgroup_v1_joins_cpu_and_cpuacct_once_each(tmp_path, combined):
    group = Cgroup.create(2**30, 64, 1.5, root=fake_v1(tmp_path, combined=combined))
    assert group is not None and group.version == 1 and group.cpu_limited
    name = group.folders[0].name
    cpu = tmp_path / "cpu" / name
    assert (cpu / "cpu.cfs_quota_us").read_text() == "150000" and (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (cpu / "cpu.shares").read_text() == "1536"
    assert len(group.procs) == (3 if combined else 4) and len(set(group.procs)) == len(group.procs)
    accounting = tmp_path / ("cpu" if combined else "cpuacct") / name
    (accounting / "cpuacct.usage").write_text("1250000000")
    assert group.cpu_seconds() == 1.25


@needs_root
def test_cgroup_v1_share_never_asks_above_the_parents_quota(tmp_path):
    """Inside a container capped at one core, v1 refuses a child's quota above it: the share is clipped to it."""
    group = Cgroup.create(2**30, 64, 4.0, root=fake_v1(tmp_path, parent_quota=100_000))
    assert group is not None and group.cpu_limited
    assert (tmp_path / "cpu" / group.folders[0].name / "cpu.cfs_quota_us").read_text() == "100000"


@needs_root
@needs_cpu_cgroup
def test_the_real_v1_or_v2_cgroup_gets_the_quota():
    group = Cgroup.create(2**30, 64, 0.5)
    assert group is not None and group.cpu_limited
    try:
        if group.version == 1:
            cpu = next(f for f in group.folders if f.parent.name in ("cpu", "cpu,cpuacct"))
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == str(CPU_PERIOD_US // 2)
            assert (cpu / "cpu.cfs_period_us").read_text().strip() == str(CPU_PERIOD_US)
            assert (cpu / "cpu.shares").read_text().strip() == "512"
        else:
            assert (group.folders[0] / "cpu.max").read_text().split() == [str(CPU_PERIOD_US // 2), str(CPU_PERIOD_US)]
            assert (group.folders[0] / "cpu.weight").read_text().strip() == "50"
        assert group.cpu_seconds() == 0
    finally:
        group.close()
    assert all(not folder.exists() for folder in group.folders)
    uncapped = Cgroup.create(2**30, 64)
    assert uncapped is not None and not uncapped.cpu_limited
    uncapped.close()
    assert all(folder.parent.name in ("memory", "pids") for folder in uncapped.folders) or uncapped.version == 2


# -- the kernel enforces it ---------------------------------------------------------------------------------------
@needs_cpu_cgroup
@pytest.mark.parametrize("strategy", [pytest.param(NamespaceIsolation, marks=needs_namespace),
                                      pytest.param(ContainerIsolation, marks=needs_container)])
def test_a_burner_on_every_core_gets_no_more_than_its_share(strategy, tmp_path, monkeypatch):
    """2 x cores busy threads in cores + 1 processes, capped at half a core: the cgroup's own count of their CPU
    time stays within half the wall time plus one period (the kernel's enforcement, not a timing)."""
    monkeypatch.setattr(job_view, "hidden_family_files", list)
    python = PYTHON if strategy is ContainerIsolation else None
    result = boxed(strategy(), tmp_path, BURNER, python, cpus=0.5)
    assert result.returncode == 0, result.stderr
    assert result.cpu_used_s is not None and result.cpu_used_s > 0
    assert result.cpu_used_s <= 0.5 * result.wall_s + CPU_PERIOD_US / 1e6, (result.cpu_used_s, result.wall_s)


@needs_root
@needs_cpu_cgroup
@needs_namespace
def test_only_the_jobs_code_is_in_the_cgroup(tmp_path):
    """The trusted side that starts a sandbox (the orchestrator, a trainer) stays out of its cgroup."""
    job = tmp_path / "job"
    job.mkdir()
    with make_sandbox([sys.executable, "-c", "import time; time.sleep(30)"], job_dir=job,
                      limits=Limits(wall_s=60, cpus=0.5)) as box:
        box.start()
        group = box._cgroup
        assert group is not None and group.cpu_limited
        for _ in range(100):
            inside = {int(p) for f in group.procs for p in f.read_text().split()}
            if len(inside) >= 3:  # bubblewrap, the init, the command
                break
            time.sleep(0.05)
        assert inside and os.getpid() not in inside and box.running.pid in inside
        assert "aitrainsai-" not in Path("/proc/self/cgroup").read_text()
        box.kill()


# -- where the share comes from -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, cpus", [(None, max(MIN_CPUS, CORES / 2)), ("1.5", 1.5), (" 2 ", 2.0),
                                         ("none", None), ("None", None)])
def test_the_default_share_comes_from_the_backends_variable(monkeypatch, value, cpus):
    if value is None:
        monkeypatch.delenv(CPUS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(CPUS_VARIABLE, value)
    assert Limits().cpus == cpus
    assert Limits(cpus=3.0).cpus == 3.0  # a caller's own share stands


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1e400", "0x10"])
def test_a_bad_share_in_the_variable_is_one_clear_line(monkeypatch, value):
    monkeypatch.setenv(CPUS_VARIABLE, value)
    with pytest.raises(ValueError, match=f"{CPUS_VARIABLE}=.* is not a CPU share") as raised:
        Limits()
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("cpus", [0, -0.5, float("nan"), float("inf"), "1"])
def test_a_bad_share_in_the_limits_is_refused(tmp_path, cpus):
    with pytest.raises(ValueError, match="Limits.cpus must be a number of cores above 0"):
        NamespaceIsolation().sandbox(["true"], job_dir=tmp_path, limits=Limits(cpus=cpus))


@pytest.mark.parametrize("setting, share", [({"workers": 1}, CORES / 2), ({"workers": 2}, CORES / 2),
                                            ({"workers": 64}, MIN_CPUS)])
def test_the_local_backend_sizes_each_payloads_share_from_its_slots(tmp_path, monkeypatch, setting, share):
    """A payload's sandboxes (its env server, its tool servers) get this machine's cores split among the payloads
    that may run at once, at most half of them (as the probe's sandboxes: nothing tells training from the probe), at
    least half a core: the payload's own Limits() reads it."""
    from aitrainsai.backends import JobPayload

    monkeypatch.delenv(CPUS_VARIABLE, raising=False)
    out = tmp_path / "cpus.txt"
    code = f"from aitrainsai.isolation import Limits; open({str(out)!r}, 'w').write(repr(Limits().cpus))"
    payload = JobPayload(job_id="c", workdir=tmp_path / "c", command=["python", "-c", code],
                         env={CPUS_VARIABLE: "64"})  # a payload cannot raise its own share
    result = asyncio.run(LocalBackend(LocalBackend.Config(**setting), workdir=tmp_path).run(payload))
    assert result.status == "done", result
    assert float(out.read_text()) == max(MIN_CPUS, share)


def test_an_operators_share_passes_to_the_payloads(tmp_path, monkeypatch):
    monkeypatch.setenv(CPUS_VARIABLE, "none")
    assert LocalBackend(LocalBackend.Config(workers=4), workdir=tmp_path).sandbox_cpus() == {CPUS_VARIABLE: "none"}


# -- where no CPU cgroup can be made ---------------------------------------------------------------------------------
NICENESS = "import os; print(os.nice(0))"


@needs_namespace
def test_without_a_cpu_cgroup_the_sandbox_yields_and_says_so_once(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(Cgroup, "create", classmethod(lambda cls, *args, **kwargs: None))
    monkeypatch.setattr(sandbox_module, "_said_cpu", False)
    seen = []
    for name, cpus in (("a", 0.5), ("b", 1.0), ("c", None)):
        (tmp_path / name).mkdir()
        result = boxed(NamespaceIsolation(), tmp_path / name, NICENESS, cpus=cpus)
        assert result.returncode == 0, result.stderr
        assert result.cpu_used_s is None
        seen.append(result.stdout.strip())
    assert seen == [str(sandbox_module.UNCAPPED_NICE)] * 2 + ["0"]
    assert capfd.readouterr().err.count("a sandbox's CPU share (Limits.cpus) is not enforced") == 1


@needs_namespace
@needs_cpu_cgroup
def test_with_a_cpu_cgroup_the_sandbox_keeps_its_priority(tmp_path):
    result = boxed(NamespaceIsolation(), tmp_path, NICENESS, cpus=0.5)
    assert result.stdout.strip() == "0", result.stderr


def test_each_strategy_states_the_cpu_share(monkeypatch):
    for strategy in (NamespaceIsolation(), ContainerIsolation()):
        text = strategy.statement().text()
        if os.geteuid() == 0 and cpu_share_enforced():
            assert "capped by a cgroup quota" in text
        else:
            assert "CPU share (cpus) is not enforced" in text


def test_the_v1_cpu_controller_is_where_this_machine_has_it():
    """This machine class (and CI) is cgroup v1 with cpu and cpuacct mounted: the real test above must not skip."""
    if not (CGROUP_ROOT / "cpu" / "cgroup.procs").is_file() or os.geteuid() != 0:
        pytest.skip("not a cgroup v1 machine as root")
    assert cpu_share_enforced()
