"""Hostile input: every case is contained, answered with a clear message, and changes nothing outside the job."""

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from aitrainsai.jobs.format import ENTRY_FILE, verifiers_v1_path
from aitrainsai.jobs.job import job_template
from aitrainsai.jobs.probe import probe_job
from aitrainsai.isolation import sandbox_works
from aitrainsai.tools import call_tool
from aitrainsai.jobs.workspace import Workspace
from episode_helpers import GivenNumbersTrainer

pytestmark = [pytest.mark.hostile,
              pytest.mark.skipif(not sandbox_works(), reason="this machine cannot build the sandbox")]

REPO = Path(__file__).resolve().parents[1]
NAMED_TARGETS = (REPO / "pwned", Path("/tmp/pwned"), Path("/root/pwned"),
                 REPO / "core" / "src" / "aitrainsai" / "pwned")


@pytest.fixture
def outside(tmp_path):
    """Canary folders that nothing may touch (one beside the job, one in the shared /tmp), and named targets that
    must never appear. Only these are watched, never a whole shared folder, so that other programs writing to /tmp
    (or editing the sources) cannot fail the suite."""
    canaries = [tmp_path / "outside", Path(tempfile.mkdtemp(prefix="aitrainsai-canary-"))]
    for canary in canaries:
        canary.mkdir(exist_ok=True)
        (canary / "keep.txt").write_text("untouched")

    def fingerprint():
        return {str(c): {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(c.iterdir()) if p.is_file()}
                for c in canaries}

    before = fingerprint()
    yield canaries[0]
    assert fingerprint() == before, "something outside the job directory changed"
    for path in NAMED_TARGETS:
        assert not path.exists(), f"{path} was created"
    shutil.rmtree(canaries[1], ignore_errors=True)


# -- the agent's file tools ------------------------------------------------------------------------------------------
@pytest.fixture
def workspace(tmp_path):
    return Workspace(tmp_path / "ws")


def tool(ws, name, **arguments):
    tools = {n: getattr(ws, n) for n in ("read_file", "write_file", "edit_file", "list_files")}
    return call_tool(tools, name, json.dumps(arguments), max_argument_chars=50_000_000)


@pytest.mark.parametrize("name, arguments, expected", [
    ("read_file", {"path": "../../etc/passwd"}, "contains '..'"),
    ("write_file", {"path": "../escape.txt", "content": "x"}, "contains '..'"),
    ("read_file", {"path": "/etc/passwd"}, "is absolute"),
    ("write_file", {"path": "/tmp/pwned", "content": "x"}, "is absolute"),
    ("write_file", {"path": "~/pwned", "content": "x"}, "is absolute"),
    ("write_file", {"path": "a\x00b", "content": "x"}, "forbidden character"),
    ("write_file", {"path": "big.txt", "content": "x" * 3_000_000}, "a file may hold at most"),
    ("write_file", {"path": "junk.bin", "content": "\x00\x01\x02" * 100}, "NUL bytes"),
    ("write_file", {"path": "junk2.bin", "content": "\x01\x02\x03\x04" * 100}, "looks binary"),
    ("edit_file", {"path": "nope.py", "old": "a", "new": "b"}, "no such file"),
    ("read_file", {"path": ""}, "non-empty relative path"),
])
def test_file_tools_refuse(workspace, outside, name, arguments, expected):
    result = tool(workspace, name, **arguments)
    assert result.startswith("error:") and expected in result, result


def test_symlink_out_is_refused(workspace, outside):
    (workspace.root / "link").symlink_to(outside)
    (workspace.root / "file-link").symlink_to(outside / "keep.txt")
    assert "symbolic link" in tool(workspace, "read_file", path="file-link")
    assert "symbolic link" in tool(workspace, "write_file", path="link/keep.txt", content="overwritten")
    assert (outside / "keep.txt").read_text() == "untouched"


def test_ten_thousand_files_are_refused(workspace, outside):
    results = [tool(workspace, "write_file", path=f"f{i}.txt", content="x") for i in range(10_000)]
    assert sum(r.startswith("wrote") for r in results) == workspace.limits.max_files
    assert "already holds 64 files" in results[-1]


def test_edit_requires_one_exact_match(workspace, outside):
    tool(workspace, "write_file", path="a.py", content="x = 1\nx = 1\n")
    assert "occurs 2 times" in tool(workspace, "edit_file", path="a.py", old="x = 1", new="y")
    assert "does not contain" in tool(workspace, "edit_file", path="a.py", old="z", new="y")
    tool(workspace, "write_file", path="b.py", content="aaa")  # "aa" twice, overlapping: not one match either
    assert "occurs 2 times" in tool(workspace, "edit_file", path="b.py", old="aa", new="b")
    tool(workspace, "write_file", path="c.toml", content="rate = 0.1\n")
    assert tool(workspace, "edit_file", path="c.toml", old="rate = 0.1", new="rate = 0.5").startswith("edited")
    again = tool(workspace, "edit_file", path="c.toml", old="rate = 0.1", new="rate = 0.5")  # the same edit twice
    assert again.startswith("error: ") and "this edit is made; go on" in again


# -- agent code, run by the probe in the sandbox, in each job format ----------------------------------------------
@pytest.fixture(params=["verifiers", "verifiers-v1"])
def probe(request, tmp_path, plugins):
    form = request.param
    if form == "verifiers-v1" and verifiers_v1_path() is None:
        pytest.skip("needs verifiers 0.4.0 for v1 jobs (make install)")
    family = plugins.task_families.get("calc_chain")()
    trainer = GivenNumbersTrainer()
    spec = family.task_spec(1, trainer.constraints(__import__("aitrainsai.families").families.Constraints()))
    hide = [tmp_path / "runs"]
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "ledger.sqlite").write_text("secret ledger")
    template = job_template(spec, trainer.config_template(spec), form)

    def run(wall_s=25, **overrides):  # cases that only end at the wall: less, so that the suite waits less
        ws = tmp_path / "ws"
        ws.mkdir(exist_ok=True)
        files = {**template, **overrides}
        for name, text in files.items():
            (ws / name).write_text(text)
        report = probe_job(ws, tmp_path / "out", spec, family, trainer, hide=hide, wall_s=wall_s)
        return report, "\n".join(str(p) for p in report.problems)

    run.form, run.entry, run.template = form, ENTRY_FILE[form], template
    return run


def dataset_doing(code: str) -> str:
    body = "\n".join("    " + line for line in code.strip().splitlines())
    return f"import os, sys\n\ndef build():\n{body}\n    return [{{'question': 'q', 'answer': '1', 'world': {{}}}}]\n"


HOSTILE_CODE = {
    "a 1 GB write": ("open('/tmp/out/big', 'wb').write(b'x' * 1_000_000_000)", ("MemoryError", "File too large",
                                                                                "No space left")),
    "10,000 files": ("[open(f'/tmp/out/f{i}', 'w').write('x') for i in range(10_000)]", ("No space left",
                                                                                     "cap on files")),
    "a memory bomb": ("x = [bytearray(10**8) for _ in range(1000)]", ("MemoryError", "out of memory")),
    "a fork bomb": ("while True:\n    os.fork()", ("Resource temporarily unavailable", "BlockingIOError",
                                                   "ran out of wall-clock time", "could not run")),
    "opening a socket": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)",
                         ("Network is unreachable",)),
    "reading credentials": ("assert os.environ.get('TINKER_API_KEY') is None, 'leaked'\n"
                            "raise RuntimeError('no credentials: ' + ','.join(k for k in os.environ if 'KEY' in k))",
                            ("no credentials: \n", "no credentials: ")),
    "importing the hidden eval": ("from aitrainsai_family_calc_chain.family import CalcChainFamily",
                                  ("Permission denied", "No module named")),
    "reading the family's source": ("import aitrainsai_family_calc_chain as p\n"
                                    "open(os.path.join(os.path.dirname(p.__file__), 'family.py')).read()",
                                    ("Permission denied", "No such file")),
    "reading the run ledger": (None, ("Permission denied", "No such file")),
    "writing outside the workspace": (f"open({str(REPO / 'pwned')!r}, 'w').write('x')",
                                      ("Read-only file system", "Permission denied", "No such file")),
    "writing the workspace itself": ("open('/tmp/job/dataset.py', 'a').write('# changed')", ("Read-only file system",
                                                                                     "Permission denied")),
    "becoming root": ("os.setuid(0)", ("Operation not permitted",)),
    "running a shell": ("import subprocess\nsubprocess.run(['sh', '-c', 'echo pwned > /tmp/pwned; "
                        "cat /etc/shadow'], check=True)", ("CalledProcessError",)),
}


@pytest.mark.parametrize("label", sorted(HOSTILE_CODE))
def test_hostile_dataset_code_is_contained(probe, outside, tmp_path, label, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-secret-do-not-leak")
    monkeypatch.setenv("RUNPOD_API_KEY", "rp-secret-do-not-leak")
    code, expected = HOSTILE_CODE[label]
    if code is None:
        code = f"open({str(tmp_path / 'runs' / 'ledger.sqlite')!r}).read()"
    wall_s = 15 if label == "a fork bomb" else 25  # it may well end only at the wall
    if probe.form == "verifiers":
        report, text = probe(wall_s, **{"dataset.py": dataset_doing(code)})
    else:  # a v1 job: the same code where the sandboxed server runs it, in the taskset module the server imports
        report, text = probe(wall_s, **{"taskset.py": probe.template["taskset.py"] + "\n\nimport os, sys\n" + code
                                        + "\n"})
    exported = [p.name for p in (tmp_path / "out").rglob("*")]
    if probe.form == "verifiers-v1" and label == "10,000 files":  # the server's /tmp is its own, thrown away with it
        assert "f9999" not in exported and len(exported) < 1_000, "files the job's server wrote came out"
        return
    assert not report.ok, f"{label}: accepted"
    assert any(e in text for e in expected), f"{label}: unclear message: {text[:600]}"
    assert "dataset.py" in text or probe.entry in text
    assert "tml-secret" not in text and "rp-secret" not in text
    everything = "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert "tml-secret" not in everything


def rubric_returning(form: str, body: str) -> str:
    """A rubric of one reward whose body is ``body``, in the job format ``form``."""
    body = "\n".join("    " + line for line in body.splitlines())
    if form == "verifiers-v1":
        body = "\n".join("    " + line for line in body.splitlines())
        return ("import verifiers.v1 as vf\n\nclass Rubric:\n    @vf.reward(weight=1.0)\n"
                f"    async def bad(self, trace: vf.Trace):\n{body}\n")
    return (f"import verifiers as vf\n\ndef bad(completion, **kwargs):\n{body}\n\n"
            "def build_rubric(parser):\n    return vf.Rubric(funcs=[bad], parser=parser)\n")


def test_an_infinite_loop_in_the_rubric_is_stopped(probe, outside):
    report, text = probe(wall_s=15, **{"rubric.py": rubric_returning(probe.form, "while True:\n    pass")})
    assert not report.ok and ("wall-clock" in text or "CPU time" in text), text[:500]


@pytest.mark.parametrize("value, expected", [("float('nan')", "finite"), ("'high'", "not a number"),
                                             ("float('inf')", "finite")])
def test_a_rubric_returning_nan_or_a_string_is_refused(probe, outside, value, expected):
    if probe.form == "verifiers-v1" and value == "'high'":
        expected = "could not convert string to float: 'high'"  # verifiers 0.4.0 converts each reward itself
    report, text = probe(**{"rubric.py": rubric_returning(probe.form, f"return {value}")})
    assert not report.ok and "rubric.py" in text and expected in text, text[:500]


def test_patching_aitrainsai_scoring_changes_nothing_outside(probe, outside, plugins):
    patch = ("import aitrainsai.families as f\nf.TaskFamily.score = lambda self, item, transcript: 1.0\n"
             "f.extract_answer = lambda *a, **k: 'patched'\n")
    report, _ = probe(**{"dataset.py": patch + dataset_doing("")})
    family = plugins.task_families.get("calc_chain")()
    item = family.hidden_eval(1)[0]
    wrong = family.initial_messages(item) + [{"role": "assistant", "content": "<answer>-1</answer>"}]
    assert family.score(item, wrong) == 0.0, "the trusted scorer was patched"
