"""False refusals and hidden causes (issue 25): the overlap rule accepts honest small datasets and still flags leaks
(in the ledger: since issue 51 a leak is hidden from training, never refused); a sandbox that cannot start says why,
in the job's log."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from aitrainsai.config import load_config, resolve
from aitrainsai.jobs.job import frozen_rows, write_frozen_rows
from aitrainsai.jobs.probe import chance_overlap, check_overlap, probe_job
from aitrainsai.run.ledger import Ledger
import aitrainsai.isolation.view as job_view
from aitrainsai.isolation import sandbox_works
from aitrainsai.isolation.namespace import NamespaceSandbox
from aitrainsai.run.session import Session
from aitrainsai.tools import call_tool
from aitrainsai.jobs.workspace import Workspace

FAMILIES = ("calc_chain", "dispatch", "ledger", "multi_hop", "string_pipeline", "triage")
OLD_SHARE = 0.02  # the rule this replaces: more than 2% of the rows matching refused the job


def rows_of(items) -> list[dict]:
    return [{"question": i.question, "answer": i.answer, "world": i.world} for i in items]


def family(plugins, name: str):
    if name not in plugins.task_families:
        pytest.skip(f"needs the {name} family")
    return plugins.task_families.get(name)()


# -- the overlap rule ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not sandbox_works(), reason="this machine cannot build the sandbox")
def test_the_recipes_second_calc_chain_job_is_accepted(tmp_path, plugins):
    """The default preset training calc_chain: its recipe policy's second job draws 32 level-1 rows of which one is,
    by chance, a hidden item. The old rule (2% of 32 rows: none allowed) refused it; now the row is dropped and the
    job is accepted."""
    resolved = resolve(load_config(None, ['families.train=["calc_chain"]'], presets=plugins.presets), plugins)
    session = Session(resolved, plugins, Ledger(tmp_path / "runs").create_run(resolved.snapshot(), []))
    episode = session.episode("calc_chain", None, "g0000-e1")
    policy = session.outer_trainer
    turns = [asyncio.run(policy.sample([], [], episode.task())) for _ in range(2)]
    workspace = Workspace(tmp_path / "ws")  # the job as the episode makes it: the template, then the calls
    for name, text in episode.template().items():
        workspace.write_file(name, text)
    tools = {"write_file": workspace.write_file, "edit_file": workspace.edit_file}
    for call in turns[1].message["tool_calls"]:
        if call["function"]["name"] in tools:
            call_tool(tools, call["function"]["name"], call["function"]["arguments"])
    files = {name: workspace.read_file(name) for name in episode.template()}
    assert "ITEMS_PER_LEVEL = {1: 32}" in files["dataset.py"], "the recipe no longer draws this job"
    seed = int(re.search(r"SEED = (\d+)", files["dataset.py"]).group(1))
    calc_chain = session.family("calc_chain")
    drawn = rows_of(calc_chain.generate(seed + 1, 1, 32))
    assert len(calc_chain.overlap(drawn)) == 1 > OLD_SHARE * 32, "the job no longer holds one chance collision"

    report = probe_job(workspace.root, tmp_path / "probe", episode.spec, calc_chain, session.inner_trainer,
                       hide=session.hidden, wall_s=90)
    assert report.ok, report.text()
    assert report.rows == 31 and report.built == 32 and report.details["removed_hidden_rows"] == 1
    assert "32 rows from build()" in report.text()
    frozen = frozen_rows(report.job_dir)
    assert len(frozen.rows) == 32 and len(frozen.left_out) == 1  # all of build()'s rows, one of them left out
    kept = [row.model_dump() for i, row in enumerate(frozen.rows) if frozen.trained(i)]
    assert calc_chain.overlap(kept) == []  # the chance collision is not trained on


def honest_draw_with_collisions(fam, level: int, n: int, at_least: int) -> list[dict]:
    """The first honest draw (the public generator, seeds in a fixed order) of ``n`` rows with ``at_least`` chance
    collisions."""
    rng = random.Random(f"{fam.name}/{n}")
    for _ in range(3_000):
        rows = rows_of(fam.generate(rng.randrange(10**6, 10**9), level, n))
        if len(fam.overlap(rows)) >= at_least:
            return rows
    pytest.fail(f"no honest {n}-row draw of {fam.name} level {level} collides {at_least} times in 3000 draws")


@pytest.mark.parametrize("name, n, collisions", [("calc_chain", 16, 1), ("calc_chain", 32, 1),
                                                 ("string_pipeline", 16, 1), ("string_pipeline", 64, 2),
                                                 ("ledger", 32, 1)])
def test_honest_small_datasets_with_chance_collisions_are_accepted(plugins, name, n, collisions):
    fam = family(plugins, name)
    rows = honest_draw_with_collisions(fam, fam.default_level, n, collisions)
    found = check_overlap(fam, rows)
    assert found.matched >= collisions > OLD_SHARE * n  # what the old rule refused
    assert not found.beyond_chance, f"{found.matched} chance matches in {n} honest rows flagged ({found.allowed})"
    assert found.leaked == fam.overlap(rows)  # accepted, and the matched rows are still dropped


@pytest.mark.parametrize("name", FAMILIES)
def test_honest_draws_are_not_flagged(plugins, name):
    """Ten honest draws of 16 and of 32 rows per family at the levels the recipe trains on, none flagged."""
    fam = family(plugins, name)
    rng = random.Random(name)
    for level in [lv for lv in (fam.default_level, fam.default_level + 1) if lv in fam.levels]:
        for n in (16, 32):
            for _ in range(10):
                rows = rows_of(fam.generate(rng.randrange(10**6, 10**9), level, n))
                assert not check_overlap(fam, rows).beyond_chance, f"level {level}, {n} rows"


def leak(fam, n: int, k: int) -> list[dict]:
    """``n`` rows: ``k`` hidden items (every other one disguised by its case) among honest rows."""
    honest = [r for r in rows_of(fam.generate(4242, fam.default_level, n * 2)) if not fam.overlap([r])][:n - k]
    hidden = rows_of(fam.hidden_eval(k))
    for i, row in enumerate(hidden):
        if i % 2:
            row["question"] = row["question"].upper()
    rows = honest + hidden
    random.Random(n * 1000 + k).shuffle(rows)
    return rows


@pytest.mark.hostile
@pytest.mark.parametrize("n, k", [(4, 3), (16, 3), (32, 4), (128, 8), (512, 16), (512, 200), (2000, 40)])
def test_a_leak_of_a_few_hidden_items_is_flagged(plugins, n, k):
    fam = family(plugins, "calc_chain")
    found = check_overlap(fam, leak(fam, n, k))
    assert found.matched == k and found.beyond_chance, f"{k} hidden items in {n} rows not flagged ({found.allowed})"


@pytest.mark.hostile
@pytest.mark.parametrize("name", FAMILIES)
def test_one_more_than_chance_is_flagged_in_every_family(plugins, name):
    """At each size, the family's chance allowance is not flagged (its rows are hidden) and one hidden item more is; the
    allowance stays a few items (under 5% at 128 rows, 2.5% at 512)."""
    fam = family(plugins, name)
    for n in (16, 32, 128, 512):
        allowed = check_overlap(fam, leak(fam, n, 0)).allowed
        assert 1 <= allowed <= {16: 3, 32: 3, 128: 6, 512: 12}[n], f"{n} rows: {allowed} allowed"
        at_chance = check_overlap(fam, leak(fam, n, allowed))
        assert not at_chance.beyond_chance and len(at_chance.leaked) == allowed
        assert check_overlap(fam, leak(fam, n, allowed + 1)).beyond_chance
    assert 0 < chance_overlap(fam) < 0.02


@pytest.mark.hostile
def test_repeated_rows_count_once(plugins):
    """An honest dataset repeated (oversampling) repeats its one chance collision: still one item, not flagged; the
    hidden set repeated is flagged."""
    fam = family(plugins, "calc_chain")
    rows = honest_draw_with_collisions(fam, 1, 16, 1)
    assert not check_overlap(fam, rows * 8).beyond_chance
    assert check_overlap(fam, rows_of(fam.hidden_eval(8)) * 4).beyond_chance


# -- a sandbox that cannot start says why ----------------------------------------------------------------------------
@pytest.fixture
def training_payload(tmp_path, monkeypatch):
    """A local training payload of the calc_chain template job (one row), ready for its driver."""
    pytest.importorskip("aitrainsai_trainer_local")
    from aitrainsai.families import Constraints
    from aitrainsai.jobs.job import job_template
    from aitrainsai.plugins import Plugins
    from aitrainsai_trainer_local.inner import LocalTrainer

    trainer = LocalTrainer()
    registry = Plugins.load().task_families
    if "calc_chain" not in registry:
        pytest.skip("needs the calc_chain family")
    family = registry.create("calc_chain")
    spec = family.task_spec(1, trainer.constraints(Constraints()))
    job = tmp_path / "episode" / "probe-1" / "job"
    job.mkdir(parents=True)
    for name, text in job_template(spec, trainer.config_template(spec)).items():
        (job / name).write_text(text)
    write_frozen_rows(job, [{"answer": "1", "question": "q", "world": {}}], spec.eval_interface.system_prompt)
    monkeypatch.chdir(tmp_path)  # the driver works in the payload's folder
    return trainer.payload(job, spec, "e1-job", family).workdir / "job.json"


def driver_log(spec_path, capsys) -> str:
    from aitrainsai_trainer_local import job as driver

    assert driver.main(str(spec_path)) == 1
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_a_sandbox_the_worker_refuses_is_one_line_in_the_jobs_log(training_payload, capsys, monkeypatch):
    """The container isolation refuses to start (not root, or a path it must hide is readable by others, here
    /etc/passwd standing in for a family's private module): the job's log says so in one line, not a traceback."""

    monkeypatch.setenv("AITRAINSAI_ISOLATION", "container")
    monkeypatch.setattr(job_view, "hidden_family_files", lambda: ["/etc/passwd"])
    log = driver_log(training_payload, capsys)
    assert "Traceback" not in log, log
    (line,) = [line for line in log.splitlines() if line.startswith("training failed")]
    assert line.startswith("training failed: the environment's sandbox could not start: the container isolation")


@pytest.mark.skipif(not sandbox_works(), reason="this machine cannot build the sandbox")
def test_bubblewraps_own_error_is_on_the_jobs_failure_line(training_payload, capsys, monkeypatch):

    arguments = NamespaceSandbox._bwrap_args
    monkeypatch.setenv("AITRAINSAI_ISOLATION", "namespace")
    monkeypatch.setattr(NamespaceSandbox, "_bwrap_args",
                        lambda self, *a: ["--no-such-option", *arguments(self, *a)])
    log = driver_log(training_payload, capsys)
    (line,) = [line for line in log.splitlines() if line.startswith("training failed")]
    assert line == ("training failed: load: the environment process ended (exit code 1): "
                    "bwrap: Unknown option --no-such-option"), log


@pytest.mark.skipif(not sandbox_works(), reason="this machine cannot build the sandbox")
def test_a_sandbox_stuck_at_start_reports_what_it_printed(tmp_path, monkeypatch):
    """A sandbox that prints its error and then hangs (a start stuck before the environment runs): the timeout names
    what it printed, not only that it did not answer."""
    from aitrainsai.jobs.remote_env import EnvironmentBroken, RemoteEnvironment

    def stuck(self, spec, uid, scratch):
        spec.update(cwd="/tmp/job", out="/tmp/out")
        return ["/bin/sh", "-c", "echo 'bwrap: setting up uid map: Permission denied' >&2; exec sleep 60", "stuck"]

    monkeypatch.setenv("AITRAINSAI_ISOLATION", "namespace")
    monkeypatch.setattr(NamespaceSandbox, "_prepare", stuck)
    with pytest.raises(EnvironmentBroken) as broken:
        with RemoteEnvironment(tmp_path, call_timeout_s=2) as env:
            env.load()
    assert str(broken.value).splitlines()[0] == (
        "load: the environment did not answer within 2 s: bwrap: setting up uid map: Permission denied")
