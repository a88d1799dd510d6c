import pytest

from aitrainsai.run.session import Session
from aitrainsai.testing.runs import episode_session, fake_plugins


@pytest.fixture
def make_episode(tmp_path):
    sessions: list[Session] = []

    def make(family="tally", episode_id="ep-1", **config):
        """An episode of a fresh run, or with ``episode_id`` other than ep-1, another of the last one's run."""
        if episode_id == "ep-1":
            sessions.append(episode_session(tmp_path / "runs", fake_plugins(), **config))
        return sessions[-1].episode(family, 1, episode_id, step=0, group_id="g0")

    return make
