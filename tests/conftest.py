import pytest

from episode_helpers import make_episode, plugins  # noqa: F401  (fixtures)

# The suite's longest files, longest first: they start first (the Makefile keeps this order: --no-loadscope-reorder),
# so that the two workers of `--dist loadfile` do not end on one long file while the other idles. Each file's seconds
# in `make test` (those that run in this session's environment) or, for the files only `make test-fast` runs here,
# in that (docs/testing.md, "Latest").
LONGEST_FIRST = (
    "tests/test_hostile_jobs.py",  # 543 s
    "tests/test_isolation.py",  # 420 (two workers, alone, after a281cb3)
    "core/tests/run/test_faults.py",  # 344
    "tests/test_ray_loop.py",  # 301
    "tests/test_v1_jobs.py",  # 149
    "tests/test_hostile.py",  # 143
    "plugins/backend_ray/tests/test_backend.py",  # 131
    "tests/test_local_training.py",  # 131
    "core/tests/run/test_loop.py",  # 127
    "tests/test_one_gpu_preset.py",  # 121
    "plugins/backend_runpod/tests/test_backend.py",  # 113
    "tests/test_runpod_loop.py",  # 111
    "plugins/trainer_prime_rl/tests/test_payload.py",  # 82
    "plugins/outer_tinker/tests/test_warm_start.py",  # 81
    "plugins/trainer_prime_rl/tests/test_envpkg_v1.py",  # 77
    "plugins/outer_tinker/tests/test_trainer.py",  # 62
    "core/tests/run/test_episode.py",  # 46 (test-fast)
    "core/tests/run/test_outer_lifecycle.py",  # 46
    "tests/test_hostile_sandbox.py",  # 45
    "tests/test_prime_rl_loop.py",  # 41
    "tests/test_viewer.py",  # 40
    "tests/test_reference_jobs.py",  # 36
    "plugins/trainer_local/tests/test_memory.py",  # 36
    "plugins/tinker_local_server/tests/test_server.py",  # 35
    "plugins/trainer_prime_rl/tests/test_envpkg.py",  # 35
    "plugins/trainer_prime_rl/tests/test_worker_v1.py",  # 31
    "plugins/outer_tinker/tests/test_resume_faults.py",  # 29
    "tests/test_false_refusals.py",  # 28
    "tests/test_loop.py",  # 27
    "tests/test_trackers_run.py",  # 23
    "core/tests/run/test_shared_jobs.py",  # 22 (test-fast)
    "core/tests/test_builtins.py",  # 22 (test-fast)
    "core/tests/run/test_record.py",  # 22
    "tests/test_session.py",  # 18
)


ALONE = "tests/test_isolation.py"  # runs each distribution's tests (those not marked slow) in its own environment


def _run_alone(config, items) -> list:
    """The test folders the selected tests of ``ALONE`` run in environments of their own: the core's and each
    distribution's."""
    folders = []
    for item in items:
        if item.path == config.rootpath / ALONE:
            if item.originalname == "test_core_alone":
                folders.append(config.rootpath / "core" / "tests")
            elif item.originalname == "test_distribution_alone":
                folders.append(item.callspec.params["root"] / "tests")
    return folders


@pytest.hookimpl(trylast=True)  # after -m and -k chose: an isolation test they left out runs nothing
def pytest_collection_modifyitems(config, items):
    # a test that runs where its distribution is installed alone does not run again here: each test once a session
    alone = _run_alone(config, items)
    again = [item for item in items if item.get_closest_marker("slow") is None
             and any(item.path.is_relative_to(folder) for folder in alone)]
    if again:
        config.hook.pytest_deselected(items=again)
        chosen = set(map(id, again))
        items[:] = [item for item in items if id(item) not in chosen]
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}

    def longest_first(item) -> int:
        if not item.path.is_relative_to(config.rootpath):
            return len(rank)
        return rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank))

    items.sort(key=longest_first)  # stable: the rest keep their order
