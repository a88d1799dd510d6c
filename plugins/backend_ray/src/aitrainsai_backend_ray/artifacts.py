"""Copying a job's artifacts out of its folder on shared storage, where agent code (the payload, or anything else
that can write that folder) may still change them while they are copied.

Everything is opened by file descriptor relative to its folder's descriptor, with ``O_NOFOLLOW``: a name is never
looked up twice, so a checked file cannot be swapped for a link before it is read. Regular files (one link, no hard
link to a file elsewhere) and folders only; a symbolic link at any level, a FIFO, socket or device refuses the
artifacts, naming the path; the byte and file caps count what is read. Copies are written the same way into a folder
of the caller's (``O_EXCL``, no link followed), then moved into the payload's workdir here (:func:`fetch`). As the
sandbox's export does (:mod:`aitrainsai.sandbox_init`). What cannot be taken is :class:`aitrainsai.MissingArtifacts`:
the job is dead, reason ``artifact``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import NoReturn

from aitrainsai import MissingArtifacts, place_artifact, relative_path

from aitrainsai_backend_ray.pool import line

MAX_DEPTH = 64  # folders inside an artifact
CHUNK = 1 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Absent(Exception):
    """An artifact the job did not leave."""


def fetch(work: Path, artifacts: dict[str, str], local: Path, *, max_bytes: int, max_files: int) -> dict[str, Path]:
    """Copy the job's artifacts (name -> path under ``work``, the job's folder's copy of the workdir) into ``local``,
    the payload's workdir here; returns where each landed. They go through a scratch folder beside ``local`` and
    only then into place. Raises :class:`aitrainsai.MissingArtifacts`."""
    local.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".ray-artifacts-", dir=local.parent))
    try:
        copy_artifacts(work, artifacts, scratch, max_bytes=max_bytes, max_files=max_files)
        return {name: place_artifact(scratch / str(index) / relative, local / relative)
                for index, (name, relative) in enumerate(artifacts.items())}
    except OSError as exc:
        raise MissingArtifacts(f"the artifacts could not be copied: {line(exc)}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def copy_artifacts(work: Path, artifacts: dict[str, str], into: Path, *, max_bytes: int, max_files: int) -> None:
    """Copy each artifact (name -> path under ``work``) to ``into/<i>/<path>``, ``i`` its index in ``artifacts``.
    ``work`` itself must not be a link (its parent, the job's folder, is opened by path). Raises
    :class:`aitrainsai.MissingArtifacts`."""
    copy = _Copy(max_bytes, max_files)
    try:
        parent = os.open(work.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise MissingArtifacts(f"the job's folder {work.parent} cannot be opened: {exc.strerror}") from None
    try:
        top = copy.open_dir(parent, work.name, work.name)
    except Absent:
        raise MissingArtifacts(f"the job's folder has no {work.name}/: it finished without its artifacts") from None
    finally:
        os.close(parent)
    missing: list[tuple[str, str]] = []
    try:
        for index, (name, relative) in enumerate(artifacts.items()):
            target = into / str(index)
            target.mkdir(parents=True)
            try:
                copy.artifact(top, name, relative, target)
            except Absent:
                missing.append((name, relative))
    finally:
        os.close(top)
    if missing:
        raise MissingArtifacts.absent(missing)


class _Copy:
    def __init__(self, max_bytes: int, max_files: int):
        self.max_bytes, self.max_files = max_bytes, max_files
        self.bytes_left, self.files_left = max_bytes, max_files
        self.name = ""

    def artifact(self, top: int, name: str, relative: str, into: Path) -> None:
        self.name = name
        try:
            parts = PurePosixPath(relative_path(relative, f"artifact {name}:")).parts
        except ValueError as exc:
            raise MissingArtifacts(str(exc)) from None
        source, target = top, os.open(into, _DIR)
        try:
            for depth, part in enumerate(parts[:-1], 1):
                path = "/".join(parts[:depth])
                child = self.open_dir(source, part, path)
                if source != top:
                    os.close(source)
                source = child
                os.mkdir(part, 0o755, dir_fd=target)
                inner = os.open(part, _DIR, dir_fd=target)
                os.close(target)
                target = inner
            self.entry(source, parts[-1], target, relative, 0, top_level=True)
        finally:
            if source != top:
                os.close(source)
            os.close(target)

    def open_dir(self, parent: int, name: str, path: str) -> int:
        try:
            return os.open(name, _DIR, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:  # Linux says so for a link too: tell which (refused either way)
                try:
                    kind = _kind(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
                except OSError:
                    kind = "not a folder"
                what = "not a folder" if kind in ("file", "folder") else kind
                raise MissingArtifacts(f"{self.what(path)} is {what}") from None
            self.refuse(exc, path)

    def refuse(self, exc: OSError, path: str) -> NoReturn:
        """Why ``path`` could not be opened or looked at, as the artifacts' refusal (``Absent``: it is not there)."""
        if exc.errno == errno.ENOENT:
            raise Absent(path) from None
        if exc.errno == errno.ELOOP:
            raise MissingArtifacts(f"{self.what(path)} is a symbolic link") from None
        if exc.errno in (errno.ENXIO, errno.ENODEV):
            raise MissingArtifacts(f"{self.what(path)} is not a plain file or folder") from None
        raise MissingArtifacts(f"{self.what(path)} cannot be read: {exc.strerror}") from None

    def what(self, path: str) -> str:
        return f"artifact {self.name}: {path}" if self.name else f"the job's folder {path}"

    def entry(self, parent: int, name: str, into: int, path: str, depth: int, *, top_level: bool = False) -> None:
        """Copy ``name`` in the folder ``parent`` (a file or a whole folder) into the folder ``into``."""
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            if exc.errno == errno.ENOENT and not top_level:
                raise MissingArtifacts(f"{self.what(path)} vanished while it was copied") from None
            self.refuse(exc, path)
        kind = _kind(info.st_mode)
        if kind not in ("file", "folder"):
            raise MissingArtifacts(f"{self.what(path)} is {kind}, not a plain file or folder")
        self.count_file()
        if kind == "folder":
            if depth >= MAX_DEPTH:
                raise MissingArtifacts(f"{self.what(path)} is more than {MAX_DEPTH} folders deep")
            try:
                source = self.open_dir(parent, name, path)
            except Absent:
                raise MissingArtifacts(f"{self.what(path)} vanished while it was copied") from None
            try:
                os.mkdir(name, 0o755, dir_fd=into)
                target = os.open(name, _DIR, dir_fd=into)
                try:
                    for child in sorted(os.listdir(source)):
                        self.entry(source, child, target, f"{path}/{child}", depth + 1)
                finally:
                    os.close(target)
            finally:
                os.close(source)
            return
        try:
            source = os.open(name, _FILE, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise MissingArtifacts(f"{self.what(path)} vanished while it was copied") from None
            self.refuse(exc, path)
        try:
            opened = os.fstat(source)  # what was opened, whatever the name points to by now
            kind = _kind(opened.st_mode)
            if kind != "file":
                raise MissingArtifacts(f"{self.what(path)} is {kind}, not a plain file or folder")
            if opened.st_nlink != 1:
                raise MissingArtifacts(f"{self.what(path)} is a hard link ({opened.st_nlink} names): a file the job "
                                       "did not write may be one of them")
            mode = 0o755 if opened.st_mode & stat.S_IXUSR else 0o644
            target = os.open(name, _NEW, mode, dir_fd=into)
            try:
                self.copy_bytes(source, target)
                os.utime(target, ns=(opened.st_atime_ns, opened.st_mtime_ns))
            finally:
                os.close(target)
        finally:
            os.close(source)

    def count_file(self) -> None:
        self.files_left -= 1
        if self.files_left < 0:
            raise MissingArtifacts(f"the artifacts hold more than {self.max_files} files")

    def copy_bytes(self, source: int, target: int) -> None:
        """Copy what ``source`` holds, counting it against the byte cap (the kernel copies: ``sendfile``)."""
        while True:
            try:
                sent = os.sendfile(target, source, None, min(CHUNK, self.bytes_left + 1))
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                return self.read_bytes(source, target)
            if not sent:
                return None
            self.take(sent)

    def read_bytes(self, source: int, target: int) -> None:
        while True:
            chunk = os.read(source, min(CHUNK, self.bytes_left + 1))
            if not chunk:
                return
            self.take(len(chunk))
            view = memoryview(chunk)
            while view:
                view = view[os.write(target, view):]

    def take(self, size: int) -> None:
        if size > self.bytes_left:
            raise MissingArtifacts(f"the artifacts hold more than {self.max_bytes / 2**20:g} MB")
        self.bytes_left -= size


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"
