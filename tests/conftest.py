from episode_helpers import make_episode, plugins  # noqa: F401  (fixtures)

# The suite's longest files, longest first (per-file totals of `make test ARGS="--durations=0"`, docs/testing.md):
# they start first, so that the two workers of `--dist loadfile` do not end on one long file while the other idles.
LONGEST_FIRST = ("tests/test_isolation.py", "tests/test_hostile_jobs.py", "core/tests/run/test_faults.py",
                 "tests/test_ray_loop.py", "tests/test_runpod_loop.py", "tests/test_hostile.py",
                 "core/tests/run/test_loop.py", "plugins/backend_ray/tests/test_backend.py", "tests/test_v1_jobs.py",
                 "tests/test_one_gpu_preset.py", "tests/test_local_training.py",
                 "plugins/backend_runpod/tests/test_backend.py", "plugins/trainer_prime_rl/tests/test_envpkg_v1.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}

    def longest_first(item) -> int:
        if not item.path.is_relative_to(config.rootpath):
            return len(rank)
        return rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank))

    items.sort(key=longest_first)  # stable: the rest keep their order
