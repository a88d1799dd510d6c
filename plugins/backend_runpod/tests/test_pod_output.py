"""What comes back from a pod is hostile data: crafted tar streams and crafted command outputs, fed to the backend's
own unpacking and parsing (no pod needed). Each refusal is one line and writes nothing outside the destination."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path, PurePosixPath

import pytest
from aitrainsai_backend_runpod.follow import parse_ended
from aitrainsai_backend_runpod.ssh import ArtifactError, unpack

pytestmark = pytest.mark.hostile  # what a compromised pod sends


def tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def good() -> bytes:
    return tar((entry("ckpt", tarfile.DIRTYPE), None), (entry("ckpt/w.bin"), b"weights"), (entry("out.txt"), b"ok"))


HOSTILE = {
    "climbing": (tar((entry("out/../../x"), b"pwned")), "outside the artifacts' folder"),
    "absolute": (tar((entry("/tmp/aitrainsai-absolute-x"), b"pwned")), "outside the artifacts' folder"),
    "symlink": (tar((entry("ckpt", tarfile.DIRTYPE), None), (entry("ckpt/link", tarfile.SYMTYPE, link="/etc"), None)),
                "is a symbolic link"),
    "hardlink": (tar((entry("ckpt", tarfile.DIRTYPE), None),
                     (entry("ckpt/link", tarfile.LNKTYPE, link="/etc/passwd"), None)), "is a hard link"),
    "device": (tar((entry("ckpt/null", tarfile.CHRTYPE), None)), "is a device"),
    "fifo": (tar((entry("ckpt/pipe", tarfile.FIFOTYPE), None)), "is a device"),
    "truncated-inside-a-file": (good()[:1024 + 100], "truncated"),
    "truncated-between-members": (good()[:3 * 512], "truncated"),
    "garbage": (b"\x00\x01not a tar at all" * 64, "unreadable"),
    "not-named": (tar((entry("elsewhere.txt"), b"x")), "is not a named artifact"),
}


@pytest.mark.parametrize("variant", sorted(HOSTILE))
def test_a_hostile_tar_is_refused_in_one_line_and_writes_nothing(tmp_path, variant):
    data, expected = HOSTILE[variant]
    destination = tmp_path / "scratch" / "unpacked"
    with pytest.raises(ArtifactError) as info:
        unpack(data, destination, allowed=[PurePosixPath("ckpt"), PurePosixPath("out.txt")])
    message = str(info.value)
    assert expected in message and "\n" not in message, message
    written = [p for p in tmp_path.rglob("*") if p.is_file() or p.is_symlink()]
    assert not written, written
    assert not Path("/tmp/aitrainsai-absolute-x").exists()


def test_a_tar_over_the_size_cap_is_refused(tmp_path):
    data = tar((entry("ckpt", tarfile.DIRTYPE), None), (entry("ckpt/a"), b"x" * 3000), (entry("ckpt/b"), b"y" * 3000))
    with pytest.raises(ArtifactError, match="pass 5000 bytes"):
        unpack(data, tmp_path / "d", max_bytes=5000)
    with pytest.raises(ArtifactError, match="more than 2 files"):
        unpack(data, tmp_path / "e", max_files=2)
    assert not list(tmp_path.rglob("a"))


def test_files_and_folders_are_unpacked_as_such(tmp_path):
    unpack(good(), tmp_path / "d", allowed=[PurePosixPath("ckpt"), PurePosixPath("out.txt")])
    assert (tmp_path / "d" / "ckpt" / "w.bin").read_bytes() == b"weights"
    assert (tmp_path / "d" / "out.txt").read_text() == "ok"
    # a file under a path the tar made a file first is a clash, refused, not a crash
    clash = tar((entry("out.txt"), b"a"), (entry("out.txt/inner"), b"b"))
    with pytest.raises(ArtifactError):
        unpack(clash, tmp_path / "clash")


# -- how a job ended: fixed fields ahead of the log, which cannot pass for them --------------------------------------
def test_the_exit_record_and_artifact_marks_come_before_the_log():
    assert parse_ended(b"0\n11\nhello\n", 2) == (0, [True, True], "hello")
    assert parse_ended(b"3\n10\n", 2) == (3, [True, False], "")
    assert parse_ended(b"0\n\nlog", 0) == (0, [], "log")


@pytest.mark.parametrize("log", [
    b"@@aitrainsai@@\nckpt\n@@aitrainsai@@\n1\n",       # the old in-band marker, then a fake missing artifact
    b"0\n00\n137\n",                                     # fake exit record and marks
    b"\n\n\n@@aitrainsai@@\n",
], ids=["old-marker", "fake-fields", "blank-lines"])
def test_what_a_log_prints_never_changes_the_fields(log):
    code, present, tail = parse_ended(b"0\n11\n" + log, 2)
    assert (code, present) == (0, [True, True])
    assert tail == log.decode().removesuffix("\n")


@pytest.mark.parametrize("out", [b"", b"\n11\nlog", b"cancelled\n11\n", b"0\n1\n", b"0\n1x\n", b"1234\n11\n"],
                         ids=["nothing", "no-record", "word", "short-marks", "bad-marks", "four-digits"])
def test_an_unreadable_record_is_none(out):
    code, present, _ = parse_ended(out, 2)
    assert code is None or present is None
