"""Extract an uploaded adapter .zip without trusting it.

Refused: absolute paths, `..` members (zip-slip), symlinks, encrypted members, members or
totals over the size caps, and too many members. A zip whose files all sit in one top folder
is flattened, so both `adapter_config.json` and `my-lora/adapter_config.json` work.
"""
from __future__ import annotations

import re
import stat
import zipfile
from pathlib import Path, PurePosixPath

from .errors import AdapterValidationError

MAX_MEMBERS = 64
_CHUNK = 1 << 20
_IGNORED_TOP = ("__MACOSX",)  # Finder's resource-fork folder


def extract_adapter_zip(
    zip_path: Path, dest: Path, *, max_member_bytes: int, max_total_bytes: int
) -> Path:
    """Extract into `dest` (an empty folder) and return the folder holding the adapter files."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            members = _checked_members(zf, max_member_bytes, max_total_bytes)
            for info, parts in members:
                try:
                    _extract_member(zf, info, dest.joinpath(*parts), max_member_bytes)
                except OSError as e:  # duplicate names, a file where a folder should be, ...
                    raise AdapterValidationError(f"cannot extract zip member {info.filename!r}: {e}") from None
    except (zipfile.BadZipFile, NotImplementedError) as e:  # corrupt data, unknown compression
        raise AdapterValidationError(f"{zip_path.name} is not a valid zip archive: {e}") from None
    tops = {parts[0] for _, parts in members}
    if len(tops) == 1 and all(len(parts) > 1 for _, parts in members):
        return dest / tops.pop()
    return dest


def _checked_members(
    zf: zipfile.ZipFile, max_member_bytes: int, max_total_bytes: int
) -> list[tuple[zipfile.ZipInfo, tuple[str, ...]]]:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise AdapterValidationError(f"zip has {len(infos)} members; at most {MAX_MEMBERS} are accepted")
    members = []
    total = 0
    for info in infos:
        parts = _safe_parts(info.filename)
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise AdapterValidationError(f"zip member {info.filename!r} is a symbolic link")
        if info.flag_bits & 0x1:
            raise AdapterValidationError(f"zip member {info.filename!r} is encrypted")
        if info.is_dir() or not parts or parts[0] in _IGNORED_TOP:
            continue
        if info.file_size > max_member_bytes:
            raise AdapterValidationError(
                f"zip member {info.filename!r} is {info.file_size} bytes, over the {max_member_bytes} byte limit"
            )
        total += info.file_size
        if total > max_total_bytes:
            raise AdapterValidationError(f"zip content is over the {max_total_bytes} byte limit")
        members.append((info, parts))
    return members


def _safe_parts(filename: str) -> tuple[str, ...]:
    # Zips written on Windows may use backslashes; treat them as separators so that
    # `..\\x` cannot slip past the `..` check.
    name = filename.replace("\\", "/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise AdapterValidationError(f"zip member {filename!r} has an absolute path")
    parts = tuple(p for p in PurePosixPath(name).parts if p not in ("", "."))
    if ".." in parts:
        raise AdapterValidationError(f"zip member {filename!r} escapes the archive ('..' in its path)")
    return parts


def _extract_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, cap: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    # Count while streaming rather than trusting the header's declared size.
    with zf.open(info) as src, open(target, "xb") as dst:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > cap:
                raise AdapterValidationError(f"zip member {info.filename!r} is over the {cap} byte limit")
            dst.write(chunk)
