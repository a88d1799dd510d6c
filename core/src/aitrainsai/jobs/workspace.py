"""The agent's workspace: a directory it reads and writes through four tools, and nothing else.

Every refusal (absolute paths, ``..``, symlinks, size and count caps, binary content) comes back as the tool's
result text, never as an exception that would end the episode.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aitrainsai.errors import AitrainsaiError

MAX_LISTED = 200


@dataclass(frozen=True)
class WorkspaceLimits:
    max_file_bytes: int = 1_000_000
    max_total_bytes: int = 10_000_000
    max_files: int = 64
    max_path_chars: int = 200


class WorkspaceError(ValueError, AitrainsaiError):
    """A refused file operation; the message is what the agent reads."""


class Workspace:
    """The agent's folder for one episode: the file tools read, write and edit it within its limits, and nothing else
    reaches outside it."""

    def __init__(self, root: Path, limits: WorkspaceLimits | None = None):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.limits = limits or WorkspaceLimits()

    # -- the agent's tools (each returns text) -------------------------------------------------------------------
    def read_file(self, path: str) -> str:
        """Read a text file of the workspace.

        Args:
            path: path relative to the workspace, e.g. environment.py
        """
        target = self._existing(path)
        return target.read_text(encoding="utf-8", errors="replace")

    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a text file of the workspace.

        Args:
            path: path relative to the workspace, e.g. rubric.py
            content: the whole new content of the file
        """
        target = self._target(path)
        self._check_content(content)
        data = content.encode("utf-8")
        existing = target.stat().st_size if target.exists() else 0
        if not target.exists() and self._count() >= self.limits.max_files:
            raise WorkspaceError(f"the workspace already holds {self.limits.max_files} files, the most allowed; "
                                 "edit or overwrite one instead")
        if self._total() - existing + len(data) > self.limits.max_total_bytes:
            raise WorkspaceError(f"the workspace would exceed {self.limits.max_total_bytes} bytes in all")
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.partial")
        temporary.write_bytes(data)
        os.replace(temporary, target)
        return f"wrote {self._relative(target)} ({len(data)} bytes)"

    def edit_file(self, path: str, old: str, new: str) -> str:
        """Replace one exact occurrence of `old` with `new` in a file of the workspace.

        Args:
            path: path relative to the workspace
            old: the exact text to replace; it must occur exactly once
            new: the replacement text
        """
        target = self._existing(path)
        text = target.read_text(encoding="utf-8", errors="replace")
        if not old:
            raise WorkspaceError("old must not be empty")
        first = text.find(old)
        count = 0 if first < 0 else max(text.count(old), 1 if text.find(old, first + 1) < 0 else 2)  # overlaps too
        if count == 0 and new and new in text:
            raise WorkspaceError(f"{self._relative(target)} does not contain the text to replace but already contains "
                                 "the new text: this edit is made; go on with the next step")
        if count == 0:
            raise WorkspaceError(f"{self._relative(target)} does not contain the text to replace; read_file it and "
                                 "copy the text exactly")
        if count > 1:
            raise WorkspaceError(f"the text to replace occurs {count} times in {self._relative(target)}; include "
                                 "more surrounding lines so that it occurs once")
        return self.write_file(path, text.replace(old, new, 1)).replace("wrote", "edited", 1)

    def list_files(self, path: str = ".") -> str:
        """List the files of the workspace (or of one directory in it) with their sizes.

        Args:
            path: directory relative to the workspace; "." for all
        """
        base = self.root if path in ("", ".") else self._existing(path, directory=True)
        rows = []
        for file in sorted(base.rglob("*")):
            if file.is_file() and not file.is_symlink() and not file.name.startswith("."):
                rows.append(f"{self._relative(file)}  {file.stat().st_size} bytes")
        if not rows:
            return "(no files)"
        more = f"\n... and {len(rows) - MAX_LISTED} more" if len(rows) > MAX_LISTED else ""
        return "\n".join(rows[:MAX_LISTED]) + more

    # -- checks ----------------------------------------------------------------------------------------------------
    def _target(self, path: str) -> Path:
        if not isinstance(path, str) or not path.strip():
            raise WorkspaceError("path must be a non-empty relative path such as environment.py")
        if len(path) > self.limits.max_path_chars:
            raise WorkspaceError(f"path is longer than {self.limits.max_path_chars} characters")
        if "\x00" in path or "\\" in path:
            raise WorkspaceError("path contains a forbidden character")
        pure = PurePosixPath(path)
        if pure.is_absolute() or path.startswith("~"):
            raise WorkspaceError(f"{path!r} is absolute; paths are relative to the workspace")
        if ".." in pure.parts:
            raise WorkspaceError(f"{path!r} contains '..'; paths must stay inside the workspace")
        target = self.root
        for part in pure.parts:
            if part == ".":
                continue
            target = target / part
            if target.is_symlink():
                raise WorkspaceError(f"{path!r} goes through a symbolic link, which is not allowed")
            if target.exists() and not (target.is_dir() or target.is_file()):
                raise WorkspaceError(f"{path!r} is not a regular file")
        if target == self.root:
            raise WorkspaceError(f"{path!r} is the workspace itself, not a file")
        if not target.resolve().is_relative_to(self.root):
            raise WorkspaceError(f"{path!r} leads outside the workspace")
        return target

    def _existing(self, path: str, directory: bool = False) -> Path:
        target = self._target(path)
        if not target.exists():
            what = "directory" if directory else "file"
            raise WorkspaceError(f"no such {what}: {path}; list_files shows what exists")
        if directory and not target.is_dir():
            raise WorkspaceError(f"{path} is a file, not a directory")
        if not directory:
            mode = target.lstat().st_mode
            if not stat.S_ISREG(mode):
                raise WorkspaceError(f"{path} is not a regular file")
            if target.stat().st_size > self.limits.max_file_bytes:
                raise WorkspaceError(f"{path} is larger than {self.limits.max_file_bytes} bytes")
        return target

    def _check_content(self, content: str) -> None:
        if not isinstance(content, str):
            raise WorkspaceError("content must be text")
        size = len(content.encode("utf-8", errors="replace"))
        if size > self.limits.max_file_bytes:
            raise WorkspaceError(f"content is {size} bytes; a file may hold at most {self.limits.max_file_bytes}")
        if "\x00" in content:
            raise WorkspaceError("content contains NUL bytes: only text files are allowed")
        controls = sum(1 for ch in content if ord(ch) < 32 and ch not in "\n\r\t\f")
        if controls > max(8, len(content) // 100):
            raise WorkspaceError("content looks binary (many control characters): only text files are allowed")

    def _files(self) -> list[Path]:
        return [p for p in self.root.rglob("*") if p.is_file() and not p.is_symlink()]

    def _count(self) -> int:
        return len(self._files())

    def _total(self) -> int:
        return sum(p.stat().st_size for p in self._files())

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()
