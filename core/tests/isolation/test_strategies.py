"""Isolation strategies: choosing one, what each states, the container strategy's guarantees under hostile code, and
limits that work with a GPU (no address-space limit), a sized /dev/shm and the network option."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path, PurePosixPath

import pytest

import aitrainsai.isolation.view as job_view
from aitrainsai.isolation import (STRATEGIES, IsolationStatement, Limits, SandboxUnavailable, isolation, run_sandboxed,
                                  sandbox_problem)
from aitrainsai.isolation.cgroup import Cgroup, cgroups_writable
from aitrainsai.isolation.container import ContainerIsolation
from aitrainsai.isolation.contract import UID_BASE
from aitrainsai.isolation.namespace import NamespaceIsolation

pytestmark = pytest.mark.hostile
MB = 2**20


def _python_for_others() -> str | None:
    """An interpreter a uid owning nothing can run (this checkout's may live under a private /root)."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        real = os.path.realpath(path)
        if os.path.isfile(real) and all(os.stat(p).st_mode & 0o001 for p in [*map(str, PurePosixPath(real).parents)]) \
                and os.stat(real).st_mode & 0o005 == 0o005:
            return path
    return None


PYTHON = _python_for_others()
needs_container = pytest.mark.skipif(os.geteuid() != 0 or PYTHON is None,
                                     reason="the container strategy needs root and an interpreter others can run")
needs_namespace = pytest.mark.skipif(NamespaceIsolation().problem() is not None,
                                     reason="this machine cannot build the namespace sandbox")


@pytest.fixture
def container(monkeypatch):
    # the checkout's task families are readable by others here, which the strategy rightly refuses; tests of that
    # refusal use their own hidden paths
    monkeypatch.setattr(job_view, "hidden_family_files", list)
    return ContainerIsolation()


def boxed(strategy, tmp_path, code: str, python: str | None = None, **options):
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    limits = Limits(**{"wall_s": 60, **options.pop("limits", {})})
    return strategy.run([python or PYTHON or sys.executable, "-c", textwrap.dedent(code)], job_dir=job,
                        out_dir=tmp_path / "out", limits=limits, **options)


def exported(tmp_path) -> dict[str, bytes]:
    out = tmp_path / "out"
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.is_symlink()}


def survivors(marker: str) -> str:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout


# -- choosing a strategy ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [(None, "namespace"), ("namespace", "namespace"),
                                             ("container", "container"), (" Container ", "container")])
def test_the_setting_chooses_the_strategy(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("AITRAINSAI_ISOLATION", raising=False)
    else:
        monkeypatch.setenv("AITRAINSAI_ISOLATION", value)
    assert isolation().name == expected


@needs_namespace
def test_auto_takes_namespaces_where_they_work(monkeypatch):
    monkeypatch.setenv("AITRAINSAI_ISOLATION", "auto")
    assert isolation().name == "namespace"


def test_an_unknown_strategy_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setenv("AITRAINSAI_ISOLATION", "chroot")
    problem = sandbox_problem()
    assert problem == ("AITRAINSAI_ISOLATION='chroot' is not an isolation strategy: choose one of namespace, "
                       "container, auto")
    with pytest.raises(SandboxUnavailable, match="not an isolation strategy"):
        run_sandboxed(["true"], job_dir=tmp_path)


def test_an_unknown_network_option_is_refused(tmp_path):
    with pytest.raises(ValueError, match="network must be one of none, loopback"):
        NamespaceIsolation().sandbox(["true"], job_dir=tmp_path, limits=Limits(network="host"))


def test_the_problem_reported_is_the_chosen_strategys(monkeypatch):
    monkeypatch.setenv("AITRAINSAI_ISOLATION", "container")
    monkeypatch.setattr(STRATEGIES["container"], "_problem", "container: nothing works here")
    assert sandbox_problem() == "container: nothing works here"


def test_each_strategy_states_what_it_does_not_guarantee():
    for strategy in (NamespaceIsolation(), ContainerIsolation()):
        statement = strategy.statement()
        assert isinstance(statement, IsolationStatement) and statement.strategy == strategy.name
        assert statement.guarantees and statement.not_guaranteed
        assert "does not guarantee:" in statement.text()
    container = " ".join(ContainerIsolation().statement().not_guaranteed)
    for words in ("file system view is the container's", "network is the container's", "not enforced",
                  "trusted side's included", "the container's own boundary"):
        assert words in container
    namespace = " ".join(NamespaceIsolation().statement().not_guaranteed)
    assert "the host's loopback included" in namespace and "inside the same sandbox" in namespace


def test_the_container_strategy_wants_root_to_keep_agent_code_apart(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in ContainerIsolation().problem()


# -- the container strategy under hostile code ----------------------------------------------------------------------
@needs_container
def test_container_runs_as_its_own_uid_and_cannot_touch_the_trusted_side(container, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "leak-me-not")
    monkeypatch.setenv("OPENAI_API_KEY", "leak-me-not")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "dataset.py").write_text("rows = 1\n")
    result = boxed(container, tmp_path, """
        import json, os, signal
        report = {"uid": os.getuid(), "groups": os.getgroups(), "env": dict(os.environ), "cwd": os.getcwd(),
                  "job": open("dataset.py").read(), "denied": []}
        for name, attempt in [("write the job", lambda: open("dataset.py", "a").write("x")),
                              ("new file in the job", lambda: open("planted.py", "w")),
                              ("signal its init", lambda: os.kill(os.getppid(), signal.SIGKILL)),
                              ("read /root", lambda: os.listdir("/root")),
                              ("become root", lambda: os.setuid(0))]:
            try:
                attempt()
            except OSError:
                report["denied"].append(name)
        print(json.dumps(report))
    """)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["uid"] >= UID_BASE and report["groups"] == []
    assert "leak-me-not" not in result.stdout and report["job"] == "rows = 1\n"
    assert report["env"]["AITRAINSAI_JOB_DIR"] == report["cwd"] != str(tmp_path / "job")  # a copy of the job
    assert report["denied"] == ["write the job", "new file in the job", "signal its init", "read /root", "become root"]
    assert (tmp_path / "job" / "dataset.py").read_text() == "rows = 1\n"


@needs_container
def test_container_kills_every_process_of_its_uid_when_the_command_exits(container, tmp_path):
    marker = f"aitrainsai-container-survivor-{os.getpid()}"
    result = boxed(container, tmp_path, f"""
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/usr/bin/sleep", ["{marker}", "600"])
            os._exit(0)
        os.wait()
        print("left a daemon")
    """)
    assert result.returncode == 0 and "left a daemon" in result.stdout, result.stderr
    assert survivors(marker) == ""


@needs_container
def test_container_kills_everything_when_the_wall_clock_runs_out(container, tmp_path):
    marker = f"aitrainsai-container-late-{os.getpid()}"
    result = boxed(container, tmp_path, f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                os.execv("/usr/bin/sleep", ["{marker}", "600"])
        time.sleep(600)
    """, limits={"wall_s": 3})
    assert result.timed_out
    time.sleep(0.5)
    assert survivors(marker) == ""


@needs_container
def test_container_copy_out_takes_regular_files_only_within_its_caps(container, tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "secret.txt").write_text("SECRET")
    result = boxed(container, tmp_path, """
        import os, socket
        out = os.environ["AITRAINSAI_OUT_DIR"]
        open(f"{out}/ok.txt", "w").write("fine")
        os.symlink("/etc/hostname", f"{out}/host")
        os.symlink(os.path.join(os.environ["AITRAINSAI_JOB_DIR"], "secret.txt"), f"{out}/secret")
        os.mkfifo(f"{out}/fifo")
        socket.socket(socket.AF_UNIX).bind(f"{out}/socket")
        open(f"{out}/a", "w").write("linked")
        os.link(f"{out}/a", f"{out}/b")
        for name in "xyz":
            with open(f"{out}/sparse-{name}", "wb") as handle:
                handle.truncate(2**30)
    """, limits={"out_mb": 4, "file_size_mb": 2048})
    assert result.returncode == 0, result.stderr
    files = exported(tmp_path)
    assert files["ok.txt"] == b"fine" and not {"host", "secret", "fifo", "socket", "a", "b"} & set(files)
    assert all(b"SECRET" not in data for data in files.values())
    assert sum(map(len, files.values())) <= 4 * MB
    problems = "\n".join(result.export_problems)
    assert "secret: not a regular file" in problems and "a: a hard link" in problems
    assert "exceeded its cap on bytes" in problems


@needs_container
def test_container_file_cap(container, tmp_path):
    result = boxed(container, tmp_path, """
        import os
        for i in range(300):
            open(os.path.join(os.environ["AITRAINSAI_OUT_DIR"], f"f{i:03d}"), "w").write("x")
    """, limits={"out_files": 100})
    assert len(exported(tmp_path)) == 100
    assert any("exceeded its cap on files" in p for p in result.export_problems)


@needs_container
def test_container_limits_hold(container, tmp_path):
    result = boxed(container, tmp_path, """
        import os, time
        limits = {line[:26].strip(): line[26:47].strip() for line in open("/proc/self/limits")}
        children = 0
        try:
            while children < 500:
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                children += 1
        except OSError:
            pass
        print(limits["Max open files"], limits["Max file size"], limits["Max cpu time"], children)
    """, limits={"open_files": 77, "file_size_mb": 3, "cpu_s": 41, "processes": 32})
    assert result.returncode == 0, result.stderr
    files, size, cpu, children = result.stdout.split()
    assert (files, size, cpu) == ("77", str(3 * MB), "41")
    assert int(children) < 32


@needs_container
@pytest.mark.skipif(not cgroups_writable(), reason="needs a writable cgroup hierarchy")
def test_container_memory_is_limited_for_the_whole_sandbox(container, tmp_path):
    result = boxed(container, tmp_path, """
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                block = bytearray(200 * 2**20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(3)
                os._exit(0)
        print(sum(os.waitstatus_to_exitcode(os.wait()[1]) == 0 for _ in range(4)))
    """, limits={"memory_mb": 384})
    assert result.out_of_memory or result.returncode != 0 or int(result.stdout) < 4, result


@needs_container
def test_container_refuses_while_a_hidden_path_is_readable(container, tmp_path):
    """What the namespace sandbox hides by not binding it, the container strategy can only check: a readable hidden
    path refuses the run; once unreadable to others, the command cannot read it."""
    folder = Path(__file__).resolve().parents[4] / f".aitrainsai-hidden-{os.getpid()}"  # beside the checkout
    secret = folder / "family.py"
    folder.mkdir(mode=0o755)
    try:
        secret.write_text("eval_seed = 1")
        secret.chmod(0o644)
        with pytest.raises(SandboxUnavailable, match="cannot hide .*family.py"):
            boxed(container, tmp_path, "print('ran')", hide=[folder])
        secret.chmod(0o600)
        result = boxed(container, tmp_path, f"""
            try:
                print(open({str(secret)!r}).read())
            except OSError as exc:
                print(type(exc).__name__)
        """, hide=[folder])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert result.stdout.strip() == "PermissionError", result.stderr


@needs_container
def test_container_removes_what_its_uid_left_in_shared_folders(container, tmp_path):
    name = f"aitrainsai-leftover-{os.getpid()}"
    result = boxed(container, tmp_path, f"""
        import os
        for folder in ("/tmp", "/dev/shm"):
            os.makedirs(f"{{folder}}/{name}/deep")
            open(f"{{folder}}/{name}/deep/planted", "w").write("for the next job")
            open(f"{{folder}}/{name}.file", "w").write("for the next job")
    """)
    assert result.returncode == 0, result.stderr
    for folder in ("/tmp", "/dev/shm"):
        assert not os.path.lexists(f"{folder}/{name}") and not os.path.lexists(f"{folder}/{name}.file")


# -- GPU-compatible limits, shared memory, network --------------------------------------------------------------------
ADDRESS_SPACE = """
    line = [l for l in open("/proc/self/limits") if l.startswith("Max address space")][0]
    print(line.split()[3])
"""


@pytest.mark.parametrize("strategy", [pytest.param(NamespaceIsolation, marks=needs_namespace),
                                      pytest.param(ContainerIsolation, marks=needs_container)])
def test_no_address_space_limit_with_a_gpu(strategy, tmp_path, monkeypatch):
    """Without a cgroup, memory falls back to an address-space limit per process; never with a GPU (CUDA reserves
    far more address space than it uses). With a cgroup there is none at all: the cgroup limits memory."""
    monkeypatch.setattr(job_view, "hidden_family_files", list)
    monkeypatch.setattr(Cgroup, "create", classmethod(lambda cls, *args, **kwargs: None))
    python = PYTHON if strategy is ContainerIsolation else sys.executable
    seen = {}
    for gpu in (False, True):
        (tmp_path / str(gpu)).mkdir()
        result = boxed(strategy(), tmp_path / str(gpu), ADDRESS_SPACE, python, gpu=gpu, limits={"memory_mb": 3000})
        seen[gpu] = result.stdout.strip() or result.stderr
    assert seen == {False: str(3000 * MB), True: "unlimited"}


@needs_namespace
def test_no_address_space_limit_where_a_cgroup_limits_memory(tmp_path):
    if not cgroups_writable():
        pytest.skip("needs a writable cgroup hierarchy")
    result = boxed(NamespaceIsolation(), tmp_path, ADDRESS_SPACE, sys.executable, limits={"memory_mb": 3000})
    assert result.stdout.strip() == "unlimited"


@needs_namespace
@pytest.mark.parametrize("shm_mb", [48, 700])
def test_shared_memory_has_the_size_asked_for(tmp_path, shm_mb):
    result = boxed(NamespaceIsolation(), tmp_path, """
        import os
        stat = os.statvfs("/dev/shm")
        print(stat.f_blocks * stat.f_frsize)
    """, sys.executable, limits={"shm_mb": shm_mb, "tmp_mb": 16})
    assert result.stdout.strip() == str(shm_mb * MB), result.stderr


LOOPBACK = """
    import socket, threading
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    threading.Thread(target=lambda: server.accept()[0].sendall(b"pong"), daemon=True).start()
    reached = []
    for port in (server.getsockname()[1], HOST_PORT):
        client = socket.socket()
        client.settimeout(1)
        try:
            client.connect(("127.0.0.1", port))
            reached.append("own" if port != HOST_PORT else "host")
        except OSError:
            pass
    print(" ".join(reached) or "-")
"""


@needs_namespace
@pytest.mark.skipif(os.geteuid() != 0, reason="only root can take a sandbox's loopback down")
@pytest.mark.parametrize("network, reached", [("none", "-"), ("loopback", "own")])
def test_loopback_is_the_sandboxs_own_and_only_on_request(tmp_path, network, reached):
    """A trainer and the inference server it starts in the same sandbox talk over the sandbox's own loopback; the
    host's loopback is never reachable; with network 'none' not even its own is up."""
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen()
    try:
        result = boxed(NamespaceIsolation(), tmp_path, LOOPBACK.replace("HOST_PORT", str(host.getsockname()[1])),
                       sys.executable, limits={"network": network})
    finally:
        host.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == reached


def test_the_default_is_no_network():
    assert Limits().network == "none"

