import pytest

from episode_helpers import make_episode, plugins  # noqa: F401  (fixtures)

# The suite's longest files, longest first (per-file totals of `make test ARGS="--durations=0"`, docs/testing.md):
# they start first, so that the two workers of `--dist loadfile` do not end on one long file while the other idles.
LONGEST_FIRST = ("tests/test_isolation.py", "tests/test_hostile_jobs.py", "core/tests/run/test_faults.py",
                 "tests/test_ray_loop.py", "tests/test_runpod_loop.py", "tests/test_hostile.py",
                 "core/tests/run/test_loop.py", "plugins/backend_ray/tests/test_backend.py", "tests/test_v1_jobs.py",
                 "tests/test_one_gpu_preset.py", "tests/test_local_training.py",
                 "plugins/backend_runpod/tests/test_backend.py", "plugins/trainer_prime_rl/tests/test_envpkg_v1.py")


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
