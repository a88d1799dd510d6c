"""Fetching a finished job's artifacts from its pod: one tar over SSH, which also cleans the job's folder, checked
member by member (agent code wrote them; :func:`.ssh.unpack`) in a scratch folder before anything lands in the
payload's workdir. What cannot be taken is :class:`aitrainsai.MissingArtifacts`: the job is dead, reason
``artifact``."""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path, PurePosixPath

from aitrainsai import MissingArtifacts, place_artifact

from aitrainsai_backend_runpod.pool import Pod, Pool
from aitrainsai_backend_runpod.ssh import ArtifactError, SshError, unpack


async def fetch(pool: Pool, pod: Pod, job_id: str, artifacts: dict[str, str], local: Path) -> dict[str, Path]:
    """Fetch the artifacts (name -> path under the job's workdir) as one tar and clean the job's folder in the same
    round trip; check every member before anything lands in ``local``. Returns where each landed."""
    job = shlex.quote(job_id)
    if not artifacts:
        await pool.clean(pod, job_id)
        return {}
    paths = " ".join(shlex.quote(p) for p in artifacts.values())
    cap = int(pool.config.max_artifact_mb * 2**20)
    try:
        archive = await pool.ssh(pod, f"cd {pool.config.remote_root}/jobs/{job}/work && tar -cf - -- {paths}; "
                                      f"code=$?; cd ../.. && rm -rf {job}; exit $code", timeout_s=3600, cap=cap)
    except SshError as exc:
        await pool.clean(pod, job_id)
        raise MissingArtifacts(f"artifacts could not be fetched: {exc}") from None
    if archive.code != 0:
        raise MissingArtifacts(f"artifacts could not be read on the pod: {' '.join(archive.stderr.split())[-300:]}")
    allowed = [PurePosixPath(p) for p in artifacts.values()]
    try:
        with tempfile.TemporaryDirectory(dir=local.parent if local.parent.exists() else None) as scratch:
            unpack(archive.stdout, Path(scratch), max_bytes=cap, allowed=allowed)
            found = {}
            for name, relative in artifacts.items():
                source = Path(scratch) / relative
                if not source.exists() or source.is_symlink():
                    raise MissingArtifacts.absent([(name, relative)])
                found[name] = place_artifact(source, local / relative)
    except ArtifactError as exc:
        raise MissingArtifacts(f"artifacts refused: {exc}") from None
    except OSError as exc:
        raise MissingArtifacts(f"artifacts could not be stored here: {' '.join(str(exc).split())[:300]}") from None
    return found
