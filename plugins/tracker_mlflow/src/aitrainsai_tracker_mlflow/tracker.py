"""The ``mlflow`` tracker: one MLflow run per aitrainsai run, in a local SQLite store or a user's tracking server.

The MLflow run is named after the aitrainsai run id and tagged ``aitrainsai.run_id``; a later process finds it again
by that tag and goes on logging into it. Its params are the run config flattened (``loop.steps``), its tags the
plugin versions, its metrics ``<axis>/<name>`` from each point's :meth:`~aitrainsai.trackers.Point.scalars` at
``step = point.x``. A reopened run's metric history is read once, and a ``(key, step)`` already there is never logged
again: points a killed process wrote after the core's cursor are dropped when fed a second time.

MLflow is imported only when a tracker starts (it takes seconds); this module imports fast.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import unquote, urlparse

from pydantic import Field

from aitrainsai import ComponentConfig, EpisodePoint, EvalPoint, JobPoint, RunEnd, StepPoint, TrackedRun, Tracker

RUN_ID_TAG = "aitrainsai.run_id"
END_TAGS = ("aitrainsai.end", "aitrainsai.end_reason", "aitrainsai.end_steps")
# MLflow's limits (mlflow.utils.validation): a log_batch call, a key, a param or tag value.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_KEY_LENGTH = 250
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 8000
CUT = "...[cut]"
# Leaves of the config not logged as params: credentials, by their key's last part.
SECRET = re.compile(r"(^|_)(api_?key|key|token|secret|password|passwd|credentials?)$", re.IGNORECASE)
# What MLflow accepts in a metric, param or tag key (its own rule on POSIX); anything else becomes "_".
NOT_KEY = re.compile(r"[^/\w.\- :]")
DATABASES = ("postgresql", "mysql", "sqlite", "mssql")
OTHER_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc")

T = TypeVar("T")


class MlflowConfig(ComponentConfig):
    tracking_uri: str | None = Field(
        None, min_length=1, description="an MLflow tracking server or store: http(s)://host:port, sqlite:///path.db, "
                                        "postgresql://..., a folder (default: a SQLite store in "
                                        "run_dir/trackers/mlflow/mlflow.db)")
    experiment: str = Field("aitrainsai", min_length=1, max_length=500,
                            description="the MLflow experiment the run goes in (created when missing)")


class MlflowTracker(Tracker):
    """Logs a run to MLflow: config as params, plugin versions as tags, every point's scalars as metrics."""

    name = "mlflow"
    description = "MLflow: a run per aitrainsai run, in a local SQLite store (or a tracking server)"
    Config: ClassVar[type[ComponentConfig]] = MlflowConfig

    def __init__(self, config: ComponentConfig | None = None, *, run_dir: Path):
        super().__init__(config, run_dir=run_dir)
        self._client: Any = None
        self._run_id: str | None = None  # MLflow's id of the run
        self._seen: dict[str, set[int]] = {}  # metric key -> steps already in the store

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        assert isinstance(config, MlflowConfig)
        if importlib.util.find_spec("mlflow") is None:
            return ["the mlflow tracker needs MLflow: pip install aitrainsai-tracker-mlflow"]
        uri = config.tracking_uri
        scheme = _scheme(uri) if uri is not None else "sqlite"
        if scheme in DATABASES:
            missing = [name for name in ("sqlalchemy", "alembic") if importlib.util.find_spec(name) is None]
            if missing:
                return [f"the mlflow tracker's SQL store needs {' and '.join(missing)}: "
                        "pip install aitrainsai-tracker-mlflow"]
            return []
        plugin_schemes = {ep.name for ep in importlib.metadata.entry_points(group="mlflow.tracking_store")}
        if scheme not in OTHER_SCHEMES and scheme not in plugin_schemes:
            return [f"tracker.mlflow.tracking_uri {uri!r}: MLflow has no tracking store for {scheme!r} (use a "
                    "folder, sqlite:///path.db, postgresql://, mysql://, mssql://, http(s)://host:port or databricks)"]
        return []

    # -- the contract ----------------------------------------------------------------------------------------------
    def start(self, run: TrackedRun) -> None:
        client_class = _mlflow_client()
        config = self.config
        assert isinstance(config, MlflowConfig)
        uri, artifacts = self._store()
        client = self._client = client_class(tracking_uri=uri)
        experiment_id = _experiment(client, config.experiment, artifacts, uri)
        found = _find(client, experiment_id, run.run_id)
        if found is None:
            created = client.create_run(experiment_id, start_time=_ms(run.created_at), run_name=run.run_id,
                                        tags={RUN_ID_TAG: run.run_id})
            self._run_id = created.info.run_id
            logged_params: dict[str, str] = {}
        else:  # reopened (a resume, or a process killed before its cursor was saved): same run, go on from its data
            self._run_id = found.info.run_id
            logged_params = dict(found.data.params)
            if found.info.status != "RUNNING":
                client.update_run(self._run_id, status="RUNNING")
            for key in END_TAGS:
                if key in found.data.tags:
                    client.delete_tag(self._run_id, key)
            self._seen = {key: {metric.step for metric in client.get_metric_history(self._run_id, key)}
                          for key in found.data.metrics}
        # params are immutable in MLflow: one logged before keeps its value
        params = {k: v for k, v in _params(run.config).items() if k not in logged_params}
        tags = {"aitrainsai.run_dir": str(run.run_dir)} | ({"aitrainsai.name": run.name} if run.name else {})
        tags |= {f"aitrainsai.plugin.{dist}": version for dist, version in run.plugins.items()}
        self._write(params=params, tags=tags)

    def log(self, points: Sequence[StepPoint | EpisodePoint | JobPoint | EvalPoint]) -> None:
        from mlflow.entities import Metric

        client, run_id = self._open()
        metrics = []
        now = int(time.time() * 1000)
        for point in points:
            at = _ms(point.at) or now
            for name, value in point.scalars().items():
                key = _key(f"{point.axis}/{name}")
                if key is None:
                    continue
                steps = self._seen.setdefault(key, set())
                if point.x in steps:  # already in the store: written before a kill, fed again
                    continue
                steps.add(point.x)
                metrics.append(Metric(key=key, value=value, timestamp=at, step=point.x))
        for batch in _batches(metrics, MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=batch, synchronous=True)

    def finish(self, end: RunEnd) -> None:
        client, run_id = self._open()
        tags = {"aitrainsai.end": end.status, "aitrainsai.end_steps": str(end.steps)}
        if end.reason:
            tags["aitrainsai.end_reason"] = end.reason
        self._write(tags=tags)
        # a stopped run ended before its plan and may be resumed: KILLED; a killed process leaves RUNNING
        client.set_terminated(run_id, status="FINISHED" if end.status == "finished" else "KILLED")

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        # a SQL store keeps its engine (and the SQLite file) open for the process: let its connections go
        engine = getattr(getattr(getattr(client, "_tracking_client", None), "store", None), "engine", None)
        if engine is not None:
            engine.dispose()

    # -- helpers ---------------------------------------------------------------------------------------------------
    @property
    def mlflow_run_id(self) -> str | None:
        """MLflow's id of the run this tracker writes (after :meth:`start`)."""
        return self._run_id

    def _open(self) -> tuple[Any, str]:
        if self._client is None or self._run_id is None:
            raise RuntimeError("the mlflow tracker is not started (or already closed)")
        return self._client, self._run_id

    def _store(self) -> tuple[str, str | None]:
        """The tracking URI and, for the default local store, where its experiment's artifacts would go. A local
        SQLite file is made writable-or-raise here, not by MLflow (which retries a bad one for ~100 s)."""
        config = self.config
        assert isinstance(config, MlflowConfig)
        if config.tracking_uri is None:
            database = (self.folder / "mlflow.db").resolve()
            _writable(database)
            return f"sqlite:///{database.as_posix()}", (self.folder / "artifacts").resolve().as_uri()
        sqlite = _sqlite_file(config.tracking_uri)
        if sqlite is not None:
            _writable(sqlite)
        return config.tracking_uri, None

    def _write(self, *, params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        client, run_id = self._open()
        entities: list[Any] = [Param(k, _cut(v, MAX_PARAM_LENGTH)) for k, v in (params or {}).items()]
        entities += [RunTag(key, _cut(v, MAX_TAG_LENGTH)) for k, v in (tags or {}).items()
                     if (key := _key(k)) is not None]
        for batch in _batches(entities, MAX_PARAMS_TAGS_PER_BATCH):
            client.log_batch(run_id, params=[e for e in batch if isinstance(e, Param)],
                             tags=[e for e in batch if isinstance(e, RunTag)], synchronous=True)


def _mlflow_client() -> Any:
    """MLflow's client class. MLflow sends usage telemetry to its makers unless told not to: a run's tracker does not,
    unless the user set ``MLFLOW_DISABLE_TELEMETRY`` themselves (read when MLflow is first imported)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient


def _experiment(client: Any, name: str, artifacts: str | None, uri: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifacts)
        except MlflowException:  # made meanwhile by another run on the same store
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise RuntimeError(f"MLflow experiment {name!r} is deleted in {uri}: restore it or choose another "
                           "(tracker.mlflow.experiment)")
    return experiment.experiment_id


def _find(client: Any, experiment_id: str, run_id: str) -> Any:
    """The active MLflow run tagged with ``run_id`` (the oldest, should there be more), or None."""
    from mlflow.entities import ViewType

    quote = "'" if "'" not in run_id else '"'
    if quote in run_id:
        raise ValueError(f"a run id with both quote characters cannot be searched for in MLflow: {run_id!r}")
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = {quote}{run_id}{quote}",
                              run_view_type=ViewType.ACTIVE_ONLY, max_results=10,
                              order_by=["attributes.start_time ASC"])
    return runs[0] if runs else None


def _params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config's leaves as params: ``a.b.c`` -> the value (a string as it is, anything else as JSON), leaving out
    the trackers' own options (they watch the run, and may hold a server's credentials) and keys that name a
    credential; a key MLflow would refuse for its length is left out too."""
    params: dict[str, str] = {}
    for name, value in config.items():
        path = f"{prefix}{name}"
        if not prefix and name in ("tracker", "trackers"):
            continue
        if isinstance(value, dict) and value:
            params |= _params(value, f"{path}.")
            continue
        key = _key(path)
        if key is None or SECRET.search(str(name)):
            continue
        params[key] = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)
    return params


def _key(name: str) -> str | None:
    key = NOT_KEY.sub("_", name)
    return key if len(key) <= MAX_KEY_LENGTH else None


def _cut(value: str, limit: int) -> str:
    """``value``, or its first ``limit`` characters ending in ``...[cut]``."""
    return value if len(value) <= limit else value[:limit - len(CUT)] + CUT


def _ms(seconds: float) -> int | None:
    return int(round(seconds * 1000)) if seconds > 0 else None


def _batches(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _scheme(uri: str) -> str:
    """The scheme MLflow picks a tracking store by (``sqlite+pysqlite://`` -> ``sqlite``; a path -> ``""``)."""
    if uri in ("databricks", "databricks-uc", "uc"):
        return uri
    scheme = urlparse(uri).scheme.lower()
    database = scheme.split("+", 1)[0]
    if database in DATABASES:
        return database
    return "" if len(scheme) == 1 else scheme  # a Windows drive letter is a path


def _sqlite_file(uri: str) -> Path | None:
    """The file of a ``sqlite:///path`` URI (None for another store, or an in-memory database)."""
    if _scheme(uri) != "sqlite":
        return None
    path = unquote(urlparse(uri).path)
    path = path[1:] if path.startswith("/") else path  # sqlite:///relative, sqlite:////absolute
    return Path(path) if path and path != ":memory:" else None


def _writable(database: Path) -> None:
    """Raise now (OSError) unless ``database`` can be created or opened for writing."""
    database.parent.mkdir(parents=True, exist_ok=True)
    open(database, "ab").close()
