"""Hostile code against the sandbox itself: copying out, what it can see, and limits that hold per sandbox."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from aitrainsai.isolation import Limits, run_sandboxed
from aitrainsai.isolation.cgroup import Cgroup
from aitrainsai.isolation.namespace import NamespaceIsolation, python_folders
from aitrainsai.isolation.receiver import Receiver

pytestmark = [pytest.mark.hostile,
              pytest.mark.skipif(NamespaceIsolation().problem() is not None,
                                 reason="this machine cannot build the namespace sandbox")]


@pytest.fixture(autouse=True)
def _namespace_isolation(monkeypatch):
    """These tests are of the namespace strategy (the container one: tests/test_isolation_strategies.py)."""
    monkeypatch.setenv("AITRAINSAI_ISOLATION", "namespace")

REPO = Path(__file__).resolve().parents[1]
SECRET = "TOP-SECRET-" + "x" * 8


def _cgroups_work() -> bool:
    group = Cgroup.create(2**30, 64)
    if group is not None:
        group.close()
    return group is not None


needs_cgroup = pytest.mark.skipif(not _cgroups_work(), reason="per-sandbox cgroups need root and a writable hierarchy")


def sandboxed(tmp_path, code: str, **limits):
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    return run_sandboxed([sys.executable, "-c", textwrap.dedent(code)], job_dir=job, out_dir=tmp_path / "out",
                         limits=Limits(**{"wall_s": 60, **limits}))


def exported(tmp_path) -> dict[str, bytes]:
    out = tmp_path / "out"
    files = {}
    for path in out.rglob("*"):
        assert not path.is_symlink(), f"{path} is a link"
        if path.is_file():
            files[str(path.relative_to(out))] = path.read_bytes()
    return files


# -- copying out --------------------------------------------------------------------------------------------------
def test_a_link_swapped_in_while_copying_is_never_followed(tmp_path):
    """A daemon keeps running after the command exits and atomically swaps ten folders, each holding a decoy named
    secret.txt, with links to the job folder, whose secret.txt the sandbox's uid may not read
    (``renameat2(RENAME_EXCHANGE)``); 500 files sort first, to give a copy that runs beside it time to be caught.
    The daemon is dead before the copy starts, and the copy follows no link: the secret never comes out."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "secret.txt").write_text(SECRET)
    (job / "secret.txt").chmod(0o600)
    result = sandboxed(tmp_path, """
        import ctypes, os, time
        exchange = ctypes.CDLL(None, use_errno=True).renameat2
        for i in range(500):
            open(f"/tmp/out/a{i:03d}", "w").write("padding")
        for i in range(10):
            os.makedirs(f"/tmp/out/d{i}")
            open(f"/tmp/out/d{i}/secret.txt", "w").write("decoy")
            os.symlink("/tmp/job", f"/tmp/out/e{i}")
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    for i in range(10):
                        exchange(-100, f"/tmp/out/d{i}".encode(), -100, f"/tmp/out/e{i}".encode(), 2)
            os._exit(0)
        time.sleep(1)
    """)
    assert result.returncode == 0, result.stderr
    files = exported(tmp_path)
    assert all(SECRET.encode() not in data for data in files.values())
    assert 500 <= len(files) <= 510


def test_links_devices_fifos_and_hard_links_are_not_exported(tmp_path):
    result = sandboxed(tmp_path, """
        import os, socket
        open("/tmp/out/ok.txt", "w").write("fine")
        os.symlink("/dev/zero", "/tmp/out/zero")
        os.symlink("/dev/urandom", "/tmp/out/random")
        os.symlink("/proc/1/environ", "/tmp/out/environ")
        os.mkfifo("/tmp/out/fifo")
        socket.socket(socket.AF_UNIX).bind("/tmp/out/socket")
        open("/tmp/out/a", "w").write("linked")
        os.link("/tmp/out/a", "/tmp/out/b")
        os.makedirs("/tmp/out/dir")
        os.symlink("/tmp/job", "/tmp/out/dir/job")
    """, out_mb=8)
    assert result.returncode == 0, result.stderr
    assert exported(tmp_path) == {"ok.txt": b"fine"}
    skipped = "\n".join(result.export_problems)
    for name in ("zero", "random", "environ", "fifo", "socket", "dir/job"):
        assert f"{name}: not a regular file" in skipped
    assert "a: a hard link" in skipped and "b: a hard link" in skipped


def test_the_byte_cap_counts_what_is_read(tmp_path):
    """Sparse files take no room in the sandbox's tmpfs but read as gigabytes: the cap counts bytes read."""
    result = sandboxed(tmp_path, """
        for name in "abc":
            with open(f"/tmp/out/{name}", "wb") as handle:
                handle.truncate(2**30)
    """, out_mb=8, file_size_mb=2048)
    assert result.returncode == 0, result.stderr
    assert sum(len(data) for data in exported(tmp_path).values()) <= 8 * 2**20
    assert any("exceeded its cap on bytes" in p for p in result.export_problems)


def test_the_file_cap_counts_what_is_read(tmp_path):
    result = sandboxed(tmp_path, """
        for i in range(300):
            open(f"/tmp/out/f{i:03d}", "w").write("x")
    """, out_files=100)
    assert len(exported(tmp_path)) == 100
    assert any("exceeded its cap on files" in p for p in result.export_problems)


def test_the_command_never_holds_the_export_channel(tmp_path):
    """Writing forged records to every descriptor and to PID 1's through /proc fails: the export pipe is PID 1's
    alone, and PID 1 cannot be read or traced."""
    result = sandboxed(tmp_path, """
        import os
        forged = b"F 9\\n../../pwn" + b"D 4\\nPWND" + b"E\\n"
        written = []
        for fd in range(3, 256):
            try:
                os.write(fd, forged)
                written.append(fd)
            except OSError:
                pass
        for fd in range(0, 32):
            try:
                with open(f"/proc/1/fd/{fd}", "wb") as handle:
                    handle.write(forged)
                written.append(f"proc-{fd}")
            except OSError:
                pass
        print(written)
        open("/tmp/out/ok", "w").write("ok")
    """)
    assert result.stdout.strip() == "[]", result.stdout
    assert exported(tmp_path) == {"ok": b"ok"} and not result.export_problems
    assert not (tmp_path / "pwn").exists() and not (tmp_path.parent / "pwn").exists()


@pytest.mark.parametrize("stream, problem", [
    (b"F 12\n../../escape" + b"D 1\nx" + b"E\n", "bad file name"),
    (b"F 11\n/etc/passwd" + b"D 1\nx" + b"E\n", "bad file name"),
    (b"F 1\na" + b"D 65536\n" + b"x" * 65536 + b"D 65536\n" + b"x" * 65536 + b"E\n", "more than 100000 bytes"),
    (b"F 1\na" + b"E\n" + b"F 1\na" + b"E\n", "File exists"),
    (b"Q junk\n", "unexpected record"),
    (b"F 1\na" + b"D 99\nshort", "truncated"),
])
def test_the_receiver_refuses_a_forged_stream(tmp_path, stream, problem):
    read, write = os.pipe()
    (tmp_path / "out").mkdir()
    receiver = Receiver(read, tmp_path / "out", 100_000, 10)
    os.write(write, stream)
    os.close(write)
    receiver.finish()
    assert any(problem in p for p in receiver.problems), receiver.problems
    assert not (tmp_path.parent / "escape").exists() and not (tmp_path / "escape").exists()
    assert all(p.is_relative_to(tmp_path / "out") for p in tmp_path.rglob("*") if p.name != "out")


# -- what the sandbox sees ------------------------------------------------------------------------------------------
def test_the_sandbox_shows_no_hidden_eval_no_repository_and_no_other_checkout(tmp_path, plugins):
    other = REPO.parent / f".aitrainsai-other-checkout-{os.getpid()}"  # beside this one, outside /tmp
    (other / ".git").mkdir(parents=True)
    (other / "family.py").write_text("eval_seed = 1")
    families = {name: plugins.task_families.get(name) for name in plugins.task_families.names()}
    private = [str(Path(sys.modules[f.__module__].__file__)) for f in families.values()]
    packages = sorted({f.__module__ for f in families.values()})
    try:
        result = sandboxed(tmp_path, f"""
            import importlib, json, os
            report = {{"visible": [], "imported": [], "repositories": []}}
            for path in {[*private, str(REPO / ".git"), str(REPO / "runs"), str(REPO / "tests"), str(other),
                          "/root/.ssh", "/etc/shadow", "/home", "/var", "/run"]!r}:
                if os.path.exists(path):
                    report["visible"].append(path)
            for module in {packages!r}:
                try:
                    importlib.import_module(module)
                    report["imported"].append(module)
                except ImportError:
                    pass
            for top in sorted(set(os.listdir("/")) - {{"proc", "sys", "dev"}}):
                for folder, dirs, _ in os.walk("/" + top):
                    report["repositories"] += [os.path.join(folder, d) for d in dirs if d == ".git"]
            print(json.dumps(report))
        """, wall_s=120, cpu_s=120)
    finally:
        shutil.rmtree(other, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"visible": [], "imported": [], "repositories": []}


def test_no_readable_source_file_holds_an_eval_seed(tmp_path, plugins):
    """Every text file the sandbox shows (sources, metadata) is searched for every family's eval seed."""
    seeds = sorted({str(plugins.task_families.get(n).eval_seed) for n in plugins.task_families.names()})
    result = sandboxed(tmp_path, f"""
        import os
        seeds = [s.encode() for s in {seeds!r}]
        found, searched = [], 0
        for top in {list(python_folders())!r}:
            for folder, dirs, files in os.walk(top):
                for name in files:
                    if not name.endswith((".py", ".pyc", ".pth", ".txt", ".json", ".toml", ".cfg", ".md", ".pyi")):
                        continue
                    path = os.path.join(folder, name)
                    try:
                        data = open(path, "rb").read(2_000_000)
                    except OSError:
                        continue
                    searched += 1
                    found += [path for seed in seeds if seed in data]
        print(searched, found)
    """, wall_s=300, cpu_s=300)
    assert result.returncode == 0, result.stderr
    searched, found = result.stdout.split(" ", 1)
    assert int(searched) > 1000 and found.strip() == "[]", result.stdout[-2000:]


def test_host_sockets_are_unreachable(tmp_path):
    """Sockets of the host — a path socket in a folder no old mask covered, an abstract one, TCP on loopback."""
    folder = REPO.parent / f".aitrainsai-sockets-{os.getpid()}"
    folder.mkdir(mode=0o755)
    path_socket = socket.socket(socket.AF_UNIX)
    path_socket.bind(str(folder / "host.sock"))
    (folder / "host.sock").chmod(0o777)  # anyone may connect, as to many system sockets
    path_socket.listen()
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0aitrainsai-hostile-{os.getpid()}"
    abstract.bind(name)
    abstract.listen()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    try:
        result = sandboxed(tmp_path, f"""
            import socket
            reached = []
            for family, address in [(socket.AF_UNIX, {str(folder / "host.sock")!r}),
                                    (socket.AF_UNIX, {name!r}),
                                    (socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]}))]:
                s = socket.socket(family)
                s.settimeout(2)
                try:
                    s.connect(address)
                    reached.append(str(address))
                except OSError:
                    pass
            print(reached)
        """)
    finally:
        for s in (path_socket, abstract, tcp):
            s.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_host_wide_counters_read_as_constants(tmp_path):
    """Review eleven's lead: the host's CPU times, load, pressure, free memory, uptime and idle time were readable in
    the sandbox, so a job's code could see the trainer's compute between its calls and tell training from the probe.
    The sandbox reads constants in their place, and still counts its CPUs. What stays open is stated: the kernel's
    sysinfo() (os.getloadavg() uses it; a filter that refused it would leave glibc's page counts uninitialised), the
    clocks, and a process timing its own progress on shared cores."""
    result = sandboxed(tmp_path, """
        import glob, json, os
        def read(path):
            try:
                with open(path) as handle:
                    return handle.read()
            except OSError as error:
                return type(error).__name__
        seen = {name: read("/proc/" + name) for name in ("stat", "loadavg", "uptime", "meminfo", "pressure/cpu",
                                                         "vmstat", "interrupts", "zoneinfo", "buddyinfo",
                                                         "sys/fs/file-nr", "sys/fs/dentry-state")}
        seen["idle"] = sorted(glob.glob("/sys/devices/system/cpu/cpu*/cpuidle/*/time"))
        seen["frequency"] = sorted(glob.glob("/sys/devices/system/cpu/cpufreq/*"))
        seen["cpus"] = [os.cpu_count(), len(os.sched_getaffinity(0)), read("/sys/devices/system/cpu/online")]
        print(json.dumps(seen))
    """, memory_mb=2048)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["loadavg"] == "0.00 0.00 0.00 1/1 1\n"
    assert seen["uptime"] == "0.00 0.00\n"
    assert seen["stat"].splitlines()[0].split()[1:] == ["0"] * 10 and "ctxt 0\n" in seen["stat"]
    assert "MemAvailable: 2097152 kB\n" in seen["meminfo"] and "MemFree: 2097152 kB\n" in seen["meminfo"]
    if os.path.exists("/proc/pressure/cpu"):
        assert seen["pressure/cpu"].startswith("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert seen["vmstat"] == seen["interrupts"] == seen["zoneinfo"] == seen["buddyinfo"] == ""  # review twelve: zones
    assert seen["sys/fs/file-nr"] == "0\t0\t0\n" and seen["sys/fs/dentry-state"] == "0 0 45 0 0 0\n"
    assert seen["idle"] == [] and seen["frequency"] == []
    assert seen["cpus"][:2] == [os.cpu_count(), len(os.sched_getaffinity(0))]
    assert seen["cpus"][2] == Path("/sys/devices/system/cpu/online").read_text()
    assert any("sysinfo()" in line and "free memory, uptime and process count" in line
               for line in NamespaceIsolation().statement().not_guaranteed)


# -- limits per sandbox ---------------------------------------------------------------------------------------------
FORK_HOLDER = """
    import os, time
    children = 0
    try:
        while True:
            if os.fork() == 0:
                time.sleep(15)
                os._exit(0)
            children += 1
    except OSError:
        pass
    open("/tmp/out/children", "w").write(str(children))
    time.sleep(12)
"""


def test_one_sandbox_at_its_process_limit_does_not_starve_another(tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    holder = threading.Thread(target=sandboxed, args=(first, FORK_HOLDER), kwargs={"processes": 64})
    holder.start()
    try:
        time.sleep(4)  # the first sandbox reaches its limit and holds it
        second = tmp_path / "second"
        second.mkdir()
        result = sandboxed(second, """
            import subprocess
            processes = [subprocess.Popen(["sleep", "1"]) for _ in range(40)]
            print(sum(p.wait() == 0 for p in processes))
        """, processes=64)
    finally:
        holder.join()
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "40"


@needs_cgroup
def test_memory_is_limited_for_the_whole_sandbox_not_per_process(tmp_path):
    result = sandboxed(tmp_path, """
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                block = bytearray(300 * 2**20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(5)
                os._exit(0)
        held = sum(os.waitstatus_to_exitcode(os.wait()[1]) == 0 for _ in range(4))
        print(held)
    """, memory_mb=512, tmp_mb=16, out_mb=16)
    assert result.out_of_memory or result.returncode != 0 or int(result.stdout) < 4, result


@needs_cgroup
def test_tmpfs_pages_count_against_the_memory_limit(tmp_path):
    result = sandboxed(tmp_path, """
        for i in range(16):
            with open(f"/dev/shm/f{i}", "wb") as handle:
                handle.write(b"m" * 60 * 2**20)
        print("wrote")
    """, memory_mb=256, tmp_mb=1024, out_mb=16, file_size_mb=64)
    assert "wrote" not in result.stdout
    assert result.out_of_memory or result.returncode != 0


def test_nothing_outlives_the_wall_clock(tmp_path):
    marker = f"aitrainsai-survivor-{os.getpid()}"
    result = sandboxed(tmp_path, f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.fork() == 0:
            os.setsid()
            os.execv("/usr/bin/sleep", ["{marker}", "600"])
        time.sleep(600)
    """, wall_s=3)
    assert result.timed_out
    time.sleep(0.5)
    survivors = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert survivors == ""


# -- trusted code reading agent data --------------------------------------------------------------------------------
@pytest.mark.parametrize("line", [b'{"question": "' + b"q" * 60_000_000 + b'"}\n',
                                  b"[" * 5_000_000 + b"\n",
                                  b'{"question": "q", "answer": "a", "world": ' + b'{"a":' * 100_000 + b"\n"])
def test_one_huge_or_deep_dataset_row_is_refused_without_reading_it_all(tmp_path, line):
    from aitrainsai.jobs.job import read_dataset

    path = tmp_path / "dataset.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "1", "world": {}}\n' + line)
    tracemalloc.start()
    rows, problems = read_dataset(path, 5_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rows == [] and problems and "row 1" in str(problems[0])
    assert peak < 10 * 2**20, f"the trusted reader held {peak} bytes"


@pytest.mark.parametrize("config, message", [({"r": 2048}, "rank 2048"), ({"r": "16"}, "rank '16'"),
                                             ({}, "rank None")])
def test_an_adapter_beyond_what_a_job_can_produce_is_refused_before_loading(tmp_path, config, message):
    policy = pytest.importorskip("aitrainsai_trainer_local.lora")
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        policy.check_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * (policy.MAX_ADAPTER_BYTES + 1))
    with pytest.raises(ValueError, match="bytes"):
        policy.check_adapter(tmp_path)


def test_folders_the_interpreter_needs_are_shown_even_under_tmp(tmp_path, monkeypatch):
    """A checkout or virtual environment under /tmp (a CI clone, say) is bound over the sandbox's own /tmp."""
    import aitrainsai.isolation.namespace as namespace

    extra = tmp_path / "site-packages"
    extra.mkdir()
    (extra / "marker.txt").write_text("here")
    shown = namespace.python_folders()
    monkeypatch.setattr(namespace, "python_folders", lambda: (*shown, str(extra)))
    result = sandboxed(tmp_path, f"print(open({str(extra / 'marker.txt')!r}).read())")
    assert result.returncode == 0 and result.stdout.strip() == "here", result.stderr


def test_the_export_pipe_is_closed_once(tmp_path, monkeypatch):
    """The receiver's stream closes the export pipe; closing its number again at clean-up would close whatever file
    reused it by then (seen as SQLite's "disk I/O error" and EBADF in a run's other threads)."""
    import stat

    import aitrainsai.isolation.sandbox as sandbox

    closed_twice = []
    close = sandbox.close_quietly

    def checked(fd):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                closed_twice.append(fd)
        except OSError:
            closed_twice.append(fd)
        close(fd)

    monkeypatch.setattr(sandbox, "close_quietly", checked)
    result = sandboxed(tmp_path, "open('/tmp/out/a.txt', 'w').write('a')")
    assert result.returncode == 0 and result.exported == ["a.txt"], result
    assert not closed_twice, f"fd {closed_twice} closed after its owner had closed it"
