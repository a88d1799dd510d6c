"""Reading what comes out of a sandbox, with caps: its streams (head and tail kept) and the export stream of its
init (:mod:`aitrainsai.isolation.init`), written into the out folder as regular files only."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path, PurePosixPath
from typing import IO

from aitrainsai.isolation.contract import STREAM_HEAD, STREAM_TAIL


class Capture:
    """A stream read to its end, keeping its head and tail only."""

    def __init__(self, stream: IO[bytes]):
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        with contextlib.suppress(OSError, ValueError):
            read = getattr(stream, "read1", stream.read)  # a pipe's buffered reader: what is there, without waiting
            for chunk in iter(lambda: read(1 << 16), b""):
                room = STREAM_HEAD - len(self.head)
                self.head += chunk[:room]
                self.tail += chunk[room:] if room > 0 else chunk
                if len(self.tail) > STREAM_TAIL:
                    self.dropped += len(self.tail) - STREAM_TAIL
                    del self.tail[:len(self.tail) - STREAM_TAIL]

    def text(self) -> str:
        self.thread.join(timeout=5)
        middle = f"\n...[{self.dropped} bytes cut]...\n" if self.dropped else ""
        return (bytes(self.head).decode("utf-8", "replace") + middle + bytes(self.tail).decode("utf-8", "replace"))


class Receiver:
    """Writes the export stream of :mod:`aitrainsai.isolation.init` into ``out_dir`` with its own caps: regular files
    it creates itself (never follows or overwrites anything), names checked, bytes and files counted."""

    def __init__(self, fd: int, out_dir: Path, max_bytes: int, max_files: int):
        self.out_dir = out_dir
        self.max_bytes, self.max_files = max_bytes, max_files
        self.files: list[str] = []
        self.problems: list[str] = []
        self.complete = False
        self.thread = threading.Thread(target=self._run, args=(os.fdopen(fd, "rb"),), daemon=True)
        self.thread.start()

    def _run(self, stream: IO[bytes]) -> None:
        with stream:
            try:
                self._receive(stream)
            except (OSError, ValueError) as exc:
                self.problems.append(f"the sandbox's output was refused: {exc}")

    def _receive(self, stream: IO[bytes]) -> None:
        received = 0
        target: int | None = None
        while True:
            line = stream.readline(64)
            if not line:
                return
            kind, _, size = line.rstrip(b"\n").partition(b" ")
            length = int(size) if size.isdigit() else -1
            if kind == b"Z" and 0 < length <= 1 << 20:
                summary = json.loads(stream.read(length).decode())
                self.problems += [f"not exported: {s}" for s in summary.get("skipped", [])[:100]]
                if summary.get("cap"):
                    self.problems.append(f"the output exceeded its cap on {summary['cap']}")
                self.complete = True
                return
            if kind == b"F":
                if length < 1 or length > 1024 or len(self.files) >= self.max_files:
                    raise ValueError("too many files or a bad name")
                name = stream.read(length).decode("utf-8")
                target = self._create(name)
                self.files.append(name)
            elif kind == b"D" and target is not None and 0 < length <= 1 << 16:
                received += length
                if received > self.max_bytes:
                    raise ValueError(f"more than {self.max_bytes} bytes")
                data = stream.read(length)
                if len(data) != length:
                    raise ValueError("a truncated chunk")
                os.write(target, data)
            elif kind == b"E" and target is not None:
                os.close(target)
                target = None
            else:
                raise ValueError(f"unexpected record {line[:20]!r}")

    def _create(self, name: str) -> int:
        parts = PurePosixPath(name).parts
        if (not parts or name.startswith("/") or len(parts) > 32 or "\x00" in name
                or any(p in (".", "..") or len(p) > 255 for p in parts)):
            raise ValueError(f"a bad file name {name[:80]!r}")
        folder = self.out_dir
        for part in parts[:-1]:
            folder = folder / part
            if not folder.is_dir() or folder.is_symlink():
                folder.mkdir()
        return os.open(folder / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)

    def finish(self, timeout: float = 30) -> None:
        self.thread.join(timeout)
