from episode_helpers import make_episode, plugins  # noqa: F401  (fixtures)
