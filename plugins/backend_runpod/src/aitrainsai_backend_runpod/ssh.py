"""Commands on a pod over SSH (the OpenSSH client), with bounded output, and safe unpacking of fetched artifacts.

Every pod gets its own ``known_hosts`` file: the host key it shows first is pinned for its life (pods come and go on
reused addresses, so one shared file would refuse a new pod or trust a changed one).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

OUTPUT_CAP = 1_000_000  # bytes of a command's output that are read; the rest is refused


class SshError(Exception):
    """The command could not run: connection refused or timed out, authentication failed, output too large."""


@dataclass
class SshResult:
    code: int
    stdout: bytes
    stderr: str


def make_key(path: Path) -> str:
    """Create an ed25519 key pair at ``path`` (private, mode 0600) unless it exists; return the public key line."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "aitrainsai", "-f", str(path)],
                       check=True, capture_output=True, timeout=30)
    return Path(f"{path}.pub").read_text().strip()


def control_dir() -> Path:
    """A private folder for SSH control sockets, short enough for a socket path (about 100 bytes at most)."""
    path = Path(tempfile.gettempdir()) / f"aitrainsai-ssh-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.is_symlink() or path.stat().st_uid != os.getuid() or path.stat().st_mode & 0o077:
        raise OSError(f"{path} is not a private folder of this user")
    return path


class Ssh:
    """One pod's SSH endpoint. Commands share one connection (OpenSSH's ControlMaster): the first pays the key
    exchange, the rest open a channel on it, which keeps the round trip of a poll to milliseconds."""

    def __init__(self, host: str, port: int, *, user: str, key: Path, known_hosts: Path, connect_timeout_s: float):
        self.host, self.port, self.user = host, port, user
        self.key, self.known_hosts, self.connect_timeout_s = key, known_hosts, connect_timeout_s
        self.control = control_dir() / "%C"

    def options(self) -> list[str]:
        return ["-i", str(self.key), "-p", str(self.port), "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", "StrictHostKeyChecking=accept-new", "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", f"ConnectTimeout={max(1, int(self.connect_timeout_s))}", "-o", "ServerAliveInterval=15",
                "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR", "-o", "ControlMaster=auto",
                "-o", f"ControlPath={self.control}", "-o", "ControlPersist=120"]

    def argv(self, command: str) -> list[str]:
        return ["ssh", *self.options(), "-T", f"{self.user}@{self.host}", command]

    async def close(self, timeout_s: float = 5.0) -> None:
        """End the shared connection (a pod that is gone ends it anyway, after the keep-alive gives up). Only the
        local master is asked, so a pod that hangs cannot hold this up past ``timeout_s``."""
        with contextlib.suppress(OSError):
            process = await asyncio.create_subprocess_exec(
                "ssh", *self.options(), "-O", "exit", f"{self.user}@{self.host}", stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                _kill(process)
            except asyncio.CancelledError:
                _kill(process)
                raise

    async def run(self, command: str, *, stdin: bytes | None = None, timeout_s: float = 120.0,
                  cap: int = OUTPUT_CAP) -> SshResult:
        """Run ``command`` (a shell line) on the pod. ``SshError`` when SSH itself fails (exit 255), the output
        passes ``cap`` bytes or the call passes ``timeout_s``; otherwise the command's own exit code."""
        process = await asyncio.create_subprocess_exec(
            *self.argv(command), stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(_communicate(process, stdin, cap), timeout_s)
        except (TimeoutError, SshError) as exc:
            _kill(process)
            await process.wait()
            raise SshError(str(exc) or f"no answer from {self.host}:{self.port} within {timeout_s:g} s") from None
        except BaseException:
            _kill(process)
            raise
        code = await process.wait()
        if code == 255:
            raise SshError(f"ssh to {self.host}:{self.port} failed: {err.strip()[-300:] or 'exit 255'}")
        return SshResult(code, out, err)


async def _communicate(process: asyncio.subprocess.Process, stdin: bytes | None, cap: int) -> tuple[bytes, str]:
    async def feed() -> None:
        if stdin is not None and process.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(stdin)
                await process.stdin.drain()
            process.stdin.close()

    async def read(stream: asyncio.StreamReader, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                raise SshError(f"the command's output passed {limit} bytes")
            chunks.append(chunk)

    assert process.stdout is not None and process.stderr is not None
    _, out, err = await asyncio.gather(feed(), read(process.stdout, cap), read(process.stderr, 65536))
    return out, err.decode("utf-8", "replace")


def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, 9)


def pack(folder: Path, *, prefix: str = ".", extra: dict[str, bytes] | None = None) -> bytes:
    """``folder``'s files under ``prefix`` as an uncompressed tar, plus ``extra`` files (mode 0600) at its top.
    Symbolic links are refused: a payload's workdir travels as files."""
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            raise ValueError(f"{path.relative_to(folder)} is a symbolic link: a payload's files travel as files")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(folder, arcname=prefix, recursive=True)
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class ArtifactError(ValueError):
    """A fetched tar was refused: one line naming why (a climbing, absolute or linked member, a device, a truncated
    or unreadable stream, too many files or bytes)."""


def unpack(data: bytes, destination: Path, *, max_files: int = 10_000, max_bytes: int | None = None,
           allowed: list[PurePosixPath] | None = None) -> None:
    """Unpack a tar the pod produced (untrusted: agent code wrote those files, and a compromised pod the stream)
    into ``destination``, a new empty folder: regular files and folders only, each under ``destination`` (no link,
    device, absolute or climbing path) and, where ``allowed`` is given, at or under one of those paths or a folder
    above one; at most ``max_files`` members and ``max_bytes`` bytes of files. Every member is checked before
    anything is written; files are written by this function (no link followed, ``O_NOFOLLOW``). Any problem is one
    :class:`ArtifactError`."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            members = _checked_members(archive, max_files, max_bytes, allowed)
            # tarfile stops quietly at a stream cut between members: a whole tar ends with two zero blocks
            end = archive.offset
            if len(data) < end + 2 * tarfile.BLOCKSIZE or any(data[end:end + 2 * tarfile.BLOCKSIZE]):
                raise ArtifactError(f"the artifacts' tar is truncated (no end-of-archive marker after "
                                    f"{len(members)} members)")
            destination.mkdir(parents=True, exist_ok=True)
            for member, relative in members:
                _extract(archive, member, destination, relative)
    except ArtifactError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:  # a truncated or corrupt stream, a clash
        what = "truncated" if "unexpected end" in str(exc) or isinstance(exc, EOFError) else "unreadable"
        raise ArtifactError(f"the artifacts' tar is {what} ({type(exc).__name__}: {_one_line(exc)})") from None


def _checked_members(archive: tarfile.TarFile, max_files: int, max_bytes: int | None,
                     allowed: list[PurePosixPath] | None) -> list[tuple[tarfile.TarInfo, PurePosixPath]]:
    members, total = [], 0
    for count, member in enumerate(archive, 1):
        if count > max_files:
            raise ArtifactError(f"the artifacts hold more than {max_files} files")
        name = member.name
        if not (member.isreg() or member.isdir()) or member.issparse():
            kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else
                    "a device" if member.isdev() else "a sparse file" if member.issparse() else "not a file")
            raise ArtifactError(f"artifact member {name!r} is {kind}: only files and folders are accepted")
        relative = _relative(name)
        if relative is None:
            raise ArtifactError(f"artifact member {name!r} is outside the artifacts' folder (an absolute or "
                                "climbing path)")
        if allowed is not None and relative != PurePosixPath(".") and not any(
                relative == a or a in relative.parents or relative in a.parents for a in allowed):
            raise ArtifactError(f"artifact member {name!r} is not a named artifact")
        total += member.size if member.isreg() else 0
        if max_bytes is not None and total > max_bytes:
            raise ArtifactError(f"the artifacts pass {max_bytes} bytes")
        members.append((member, relative))
    return members


def _relative(name: str) -> PurePosixPath | None:
    """``name`` as a plain relative path ("." for the top), or None where it is absolute or climbs."""
    if not name or "\x00" in name or name.startswith("/"):
        return None
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if any(part == ".." for part in parts):
        return None
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def _extract(archive: tarfile.TarFile, member: tarfile.TarInfo, destination: Path, relative: PurePosixPath) -> None:
    target = destination.joinpath(*relative.parts)
    for parent in reversed(target.relative_to(destination).parents):  # every folder on the way is a real folder
        folder = destination / parent
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise ArtifactError(f"artifact member {member.name!r} lies under something that is not a folder")
        folder.mkdir(exist_ok=True)
    if member.isdir():
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise ArtifactError(f"artifact member {member.name!r} is both a file and a folder")
        target.mkdir(exist_ok=True)
        return
    source = archive.extractfile(member)
    assert source is not None
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as out:
        left = member.size
        while left:
            chunk = source.read(min(left, 1 << 20))
            if not chunk:
                raise ArtifactError(f"the artifacts' tar ends inside {member.name!r} (a truncated stream)")
            out.write(chunk)
            left -= len(chunk)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
