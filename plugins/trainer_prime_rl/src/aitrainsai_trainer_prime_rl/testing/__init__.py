"""Test helpers: the trainer wired to the stand-ins for prime-rl and vLLM, and frozen jobs as the probe leaves them."""

import sys

from aitrainsai import Constraints, JobFormat, job_template, load_family, write_frozen_rows

from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer

STAND_IN = [sys.executable, "-m", "aitrainsai_trainer_prime_rl.testing.fake_prime_rl"]
FAKE_VLLM = [sys.executable, "-m", "aitrainsai_trainer_prime_rl.testing.fake_vllm"]


def installed_family(name: str):
    """The workspace's task family ``name`` (in ``aitrainsai-family-NAME``), or the test is skipped: this
    distribution's tests also run alone, without families."""
    from importlib import metadata

    import pytest

    distribution = "aitrainsai-family-" + name.replace("_", "-")
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        pytest.skip(f"needs the {name} family installed (the whole workspace)")
    return load_family(name, distribution)


def stand_in_trainer(fault: str = "", **options) -> PrimeRlTrainer:
    """The trainer with prime-rl and vLLM replaced by the stand-ins, asking for no GPU."""
    launcher = STAND_IN + (["--fault", fault] if fault else [])
    settings = {"launcher": launcher, "eval_server": FAKE_VLLM, "gpus": 0, "eval_size": 6, "memory_gb": 1.0,
                "disk_gb": 0.5, **options}
    return PrimeRlTrainer(PrimeRlTrainer.Config(**settings))


def frozen_job(folder, family_name: str = "calc_chain", trainer: PrimeRlTrainer | None = None, rows: int = 16,
               trainer_toml: str | None = None, job_format: JobFormat = "verifiers"):
    """A frozen job of ``family_name`` as the probe leaves it: the template's files (of ``job_format``: classic
    ``verifiers`` or ``verifiers-v1``) and the frozen rows."""
    trainer = trainer or PrimeRlTrainer()
    family = installed_family(family_name)
    spec = family.task_spec(family.default_level, trainer.constraints(Constraints(), job_format)).model_copy(
        update={"job_format": job_format})
    folder.mkdir(parents=True)
    for name, text in job_template(spec, trainer.config_template(spec), job_format).items():
        (folder / name).write_text(text)
    if trainer_toml is not None:
        (folder / "trainer.toml").write_text(trainer_toml)
    items = family.generate(7, family.default_level, rows)
    write_frozen_rows(folder, [{"question": i.question, "answer": i.answer, "world": i.world} for i in items],
                      spec.eval_interface.system_prompt)
    return spec, folder
