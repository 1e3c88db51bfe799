"""Extract an uploaded adapter .zip without trusting it.

Only the two files an adapter has are extracted (`adapter_config.json` and
`adapter_model.safetensors`, at the top or under one folder); every other member is left
compressed and unread. Each is inflated in a stream that counts the bytes actually produced
and stops at its cap, so neither a lying header nor a compression bomb can write or hold
more than the cap. The weights' cap is what an adapter for the base model can weigh
(`limits.max_adapter_bytes`), passed by the caller.

Refused anywhere in the archive: absolute paths, `..` members (zip-slip), symlinks,
encrypted members and too many members. A pickle-only archive is refused as a folder is.
"""
from __future__ import annotations

import os
import re
import stat
import zipfile
from pathlib import Path, PurePosixPath

from .errors import AdapterArchiveError, AdapterTooLargeError, AdapterValidationError
from .limits import MAX_CONFIG_BYTES
from .peft import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME

MAX_MEMBERS = 64
_CHUNK = 1 << 20
_IGNORED_TOP = ("__MACOSX",)  # Finder's resource-fork folder

_Member = tuple[zipfile.ZipInfo, tuple[str, ...]]


def extract_adapter_zip(
    zip_path: Path, dest: Path, *, max_weights_bytes: int, max_config_bytes: int = MAX_CONFIG_BYTES
) -> Path:
    """Write the adapter's two files into `dest` (an existing empty folder), fsync'd; return `dest`."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            config, weights = _adapter_members(_checked_members(zf))
            _extract(zf, config, dest / CONFIG_NAME, max_config_bytes)
            _extract(zf, weights, dest / WEIGHTS_NAME, max_weights_bytes)
    except (zipfile.BadZipFile, NotImplementedError, EOFError) as e:  # corrupt data, unknown compression
        raise AdapterArchiveError(f"{zip_path.name} is not a valid zip archive: {e}") from None
    return dest


def _checked_members(zf: zipfile.ZipFile) -> list[_Member]:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise AdapterArchiveError(f"zip has {len(infos)} members; at most {MAX_MEMBERS} are accepted")
    members = []
    for info in infos:
        parts = _safe_parts(info.filename)
        if stat.S_ISLNK(info.external_attr >> 16):
            raise AdapterArchiveError(f"zip member {info.filename!r} is a symbolic link")
        if info.flag_bits & 0x1:
            raise AdapterArchiveError(f"zip member {info.filename!r} is encrypted")
        if info.is_dir() or not parts or parts[0] in _IGNORED_TOP:
            continue
        members.append((info, parts))
    return members


def _adapter_members(members: list[_Member]) -> tuple[zipfile.ZipInfo, zipfile.ZipInfo]:
    """The config and weights members, both at the top or both in the same single folder."""
    by_folder: dict[tuple[str, ...], dict[str, zipfile.ZipInfo]] = {}
    for info, parts in members:
        if len(parts) <= 2:
            by_folder.setdefault(parts[:-1], {})[parts[-1]] = info
    with_config = [folder for folder, files in by_folder.items() if CONFIG_NAME in files]
    if not with_config:
        raise AdapterValidationError(f"{CONFIG_NAME} is missing (at the top of the zip or in one folder)")
    if len(with_config) > 1:
        shown = ", ".join(sorted("/".join(f) or "(top)" for f in with_config))
        raise AdapterArchiveError(f"zip holds more than one adapter ({shown}); upload one at a time")
    files = by_folder[with_config[0]]
    if WEIGHTS_NAME in files:
        return files[CONFIG_NAME], files[WEIGHTS_NAME]
    pickles = sorted(n for n in files if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise AdapterValidationError(f"{pickles[0]} is a pickled checkpoint; only safetensors is accepted")
    raise AdapterValidationError(f"{WEIGHTS_NAME} is missing")


def _safe_parts(filename: str) -> tuple[str, ...]:
    # Zips written on Windows may use backslashes; treat them as separators so that
    # `..\\x` cannot slip past the `..` check.
    name = filename.replace("\\", "/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise AdapterArchiveError(f"zip member {filename!r} has an absolute path")
    parts = tuple(p for p in PurePosixPath(name).parts if p not in ("", "."))
    if ".." in parts:
        raise AdapterArchiveError(f"zip member {filename!r} escapes the archive ('..' in its path)")
    return parts


def _extract(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, cap: int) -> None:
    if info.file_size > cap:
        raise AdapterTooLargeError(f"zip member {info.filename!r} is {info.file_size} bytes, over the {cap} byte limit")
    written = 0
    # Count what inflates rather than trusting the declared size: a bomb stops at the cap.
    with zf.open(info) as src, open(target, "xb") as dst:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > cap:
                raise AdapterTooLargeError(
                    f"zip member {info.filename!r} inflates past the {cap} byte limit (a compression bomb?)"
                )
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
