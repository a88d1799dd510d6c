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
from pathlib import Path

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

    async def close(self) -> None:
        """End the shared connection (a pod that is gone ends it anyway, after the keep-alive gives up)."""
        with contextlib.suppress(OSError):
            process = await asyncio.create_subprocess_exec(
                "ssh", *self.options(), "-O", "exit", f"{self.user}@{self.host}", stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), 10)

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
        chunks, size = [], 0
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


def unpack(data: bytes, destination: Path, *, max_files: int = 10_000) -> None:
    """Unpack a tar the pod produced (untrusted: agent code wrote those files) into ``destination``: regular files
    and folders only (no link, device or absolute or climbing path), at most ``max_files`` members."""
    destination.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        members = []
        for count, member in enumerate(archive, 1):
            if count > max_files:
                raise ValueError(f"the artifacts hold more than {max_files} files")
            if not (member.isfile() or member.isdir()):
                raise ValueError(f"artifact member {member.name!r} is not a file or a folder")
            members.append(member)
        for member in members:
            target = destination / member.name
            if member.isfile() and target.is_symlink():
                target.unlink()
        archive.extractall(destination, members=members, filter="data")

