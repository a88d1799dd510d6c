"""The untrained base's hidden-eval scores (pre), computed once per setting and cached in the ledger, and the
comparison of a trained checkpoint's scores (post) against them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from aitrainsai.parsing import check_value
from aitrainsai.plugins import with_env
from aitrainsai.trainers import Baseline, EvalComparison, TrainOutcome
from aitrainsai.errors import AitrainsaiError

if TYPE_CHECKING:
    from aitrainsai.backends import GpuBackend
    from aitrainsai.evaluation import EvalResult
    from aitrainsai.families import TaskFamily
    from aitrainsai.run.ledger import Ledger
    from aitrainsai.trainers import InnerTrainer


class Baselines:
    """Untrained hidden-eval scores, computed once per key and cached in the ledger; concurrent requests for the same
    key share one computation. The key holds every setting that changes a score: the trainer and its evaluation
    settings (:meth:`InnerTrainer.eval_settings`), the family's version, level, eval seed and size, the base model."""

    def __init__(self, ledger: Ledger, trainer: InnerTrainer, backend: GpuBackend, workdir: Path, *,
                 payload_env: dict[str, str] | None = None):
        self.ledger = ledger
        self.trainer = trainer
        self.backend = backend
        self.workdir = Path(workdir)
        self.payload_env = dict(payload_env or {})
        self._pending: dict[str, asyncio.Future] = {}

    def key(self, family: TaskFamily, level: int, base: str) -> str:
        from aitrainsai.evaluation import family_version

        settings = json.dumps(self.trainer.eval_settings(base), sort_keys=True, separators=(",", ":"))
        return (f"{self.trainer.name}|{family.name}|{level}|{base}|{family.eval_seed}|{self.trainer.eval_size}|"
                f"family={family_version(family)}|{settings}")

    async def get(self, family: TaskFamily, level: int, base: str) -> Baseline:
        key = self.key(family, level, base)
        cached = self.ledger.baseline(key)
        if cached is not None:
            return Baseline(family=family.name, level=level, base_model=base, eval_seed=family.eval_seed,
                            eval_size=self.trainer.eval_size, score=cached.score, item_scores=cached.item_scores,
                            engine=cached.engine)
        if key not in self._pending:
            self._pending[key] = asyncio.ensure_future(self._compute(family, level, base, key))
        try:
            return await asyncio.shield(self._pending[key])
        finally:
            if self._pending.get(key) is not None and self._pending[key].done():
                self._pending.pop(key, None)

    async def _compute(self, family: TaskFamily, level: int, base: str, key: str) -> Baseline:
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        job_id = f"baseline-{family.name}-{level}-{base.replace('/', '_')}-{digest}"
        workdir = self.workdir / job_id
        if workdir.exists():
            shutil.rmtree(workdir)
        payload = with_env(self.trainer.eval_payload(family, level, base, None, workdir, job_id), self.payload_env)
        outcome = await self.backend.run(payload)
        if outcome.status != "done":
            raise RuntimeError(f"baseline of {base} on {family.name} died: {outcome.why}\n{outcome.log_tail[-1500:]}")
        try:  # off the event loop: a trainer may score many transcripts here
            scores = await asyncio.to_thread(self.trainer.eval_result, outcome, family=family, level=level,
                                             base_model=base)
            check_value(scores.item_scores, what="item scores")  # finite: a NaN would become every episode's reward
        except Exception as exc:  # noqa: BLE001 - unreadable scores fail this baseline with the reason, one line
            raise RuntimeError(f"baseline of {base} on {family.name}: unreadable evaluation: {exc}") from None
        baseline = Baseline(family=family.name, level=level, base_model=base, eval_seed=scores.eval_seed,
                            eval_size=scores.eval_size, score=scores.score, item_scores=scores.item_scores,
                            engine=scores.engine)
        self.ledger.save_baseline(key, family=family.name, level=level, base_model=base, eval_seed=family.eval_seed,
                                  eval_size=baseline.eval_size, score=baseline.score, item_scores=baseline.item_scores,
                                  engine=baseline.engine.model_dump(mode="json") if baseline.engine else None)
        return baseline

    async def all(self, family: TaskFamily, level: int, bases: list[str]) -> dict[str, Baseline]:
        values = await asyncio.gather(*(self.get(family, level, base) for base in bases))
        return dict(zip(bases, values))


class EngineMismatch(ValueError, AitrainsaiError):
    """Pre and post were scored with different evaluation settings: they cannot be compared."""


def compare(baseline: Baseline, post: EvalResult, train: TrainOutcome) -> EvalComparison:
    """The trained job's outcome: the untrained base's scores (pre) against the checkpoint's (post), item by item,
    when both came from the same evaluation settings."""
    from aitrainsai.evaluation import paired_bootstrap

    if baseline.engine is not None and post.engine != baseline.engine:
        raise EngineMismatch(f"pre was scored with {baseline.engine.key()}, post with {post.engine.key()}")
    if len(post.item_scores) != len(baseline.item_scores):
        raise ValueError(f"post has {len(post.item_scores)} item scores, pre {len(baseline.item_scores)}")
    low, high = paired_bootstrap(baseline.item_scores, post.item_scores)
    return EvalComparison(base_model=baseline.base_model, pre=baseline.score, post=post.score,
                       uplift=post.score - baseline.score, uplift_ci=(low, high), eval_size=post.eval_size,
                       train_seconds=train.train_seconds, train_work=train.work,
                       metrics={**train.metrics, "post_item_scores": post.item_scores,
                                "engine": post.engine.model_dump(mode="json")})
