"""Adapter uploads for the admin API: a multipart body streamed to a private staging
folder with a size limit, its files sniffed and named as the adapter store expects."""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, Request

from loraplex.adapters.limits import MAX_CONFIG_BYTES

from loraplex.platform.admin.schemas import check_text
from loraplex.platform.admin.state import AdminState
from loraplex.platform.errors import BadRequestError, PayloadTooLargeError, UnsupportedMediaTypeError

_MAX_FIELD_BYTES = 4096
_MAX_FIELDS = 32
_MAX_FILES = 2


@dataclass
class Upload:
    folder: Path  # staging: adapter_config.json + adapter_model.safetensors, or upload.zip
    fields: dict[str, list[str]]
    source: Path  # what the store validates: the folder or the zip
    total_bytes: int


def _sniff(head: bytes) -> str:
    """"zip", "json", "safetensors", "pickle" or "unknown" from a file's first bytes."""
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head.lstrip()[:1] == b"{":
        return "json"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
        return "safetensors"
    if head[:1] == b"\x80" or head.startswith(b"PK"):
        return "pickle"
    return "unknown"


# Multipart framing and form fields around the files of an upload.
_MULTIPART_OVERHEAD = 64 * 1024


def upload_limit(st: AdminState) -> int:
    """The most an upload may send: the configured limit, or less when no adapter for
    this base model and rank cap can be that large (the config plus the weights; a zip
    of them is no larger, give or take its headers)."""
    largest_adapter = st.store.max_file_bytes + MAX_CONFIG_BYTES + _MULTIPART_OVERHEAD
    return min(st.settings.admin.max_upload_bytes, largest_adapter)


def _over_limit(st: AdminState, limit: int, size: int | None = None) -> PayloadTooLargeError:
    """The refusal of an upload over `limit`, naming which bound it is: the configured one
    can be smaller than the largest valid adapter, whose size saved copies of the
    embedding and lm_head (modules_to_save: [vocab, hidden] each) dominate."""
    what = f"the upload is {size} bytes, over" if size is not None else "the upload is over"
    if limit >= st.store.max_file_bytes + MAX_CONFIG_BYTES + _MULTIPART_OVERHEAD:
        return PayloadTooLargeError(f"{what} the {limit} byte limit (the largest adapter for this base model)")
    base = st.store.base
    matrix = 4 * base.vocab_size * base.hidden_size
    return PayloadTooLargeError(
        f"{what} the {limit} byte limit (admin_max_upload_bytes); an adapter that saves embed_tokens or lm_head "
        f"(modules_to_save) carries {matrix} bytes for each in float32, so raise the limit to upload one")


class _PartSink:
    """python-multipart's callbacks: each file part streamed to the staging folder, each
    field checked and handed to `on_field` as soon as it is complete."""

    def __init__(self, folder: Path, limit: int, over_limit, on_field) -> None:
        self.folder, self.limit, self.over_limit, self.on_field = folder, limit, over_limit, on_field
        self.fields: dict[str, list[str]] = {}
        self.files: list[tuple[str, Path, bytes]] = []  # (client filename, staged path, first bytes)
        self.headers: list[tuple[bytes, bytes]] = []
        self.name = self.value = b""
        self.part: dict[str, Any] | None = None
        self.total = self.nfields = 0

    def callbacks(self) -> dict[str, Any]:
        return dict(on_part_begin=self.on_part_begin, on_part_data=self.on_part_data, on_part_end=self.on_part_end,
                    on_header_field=self.on_header_field, on_header_value=self.on_header_value,
                    on_header_end=self.on_header_end, on_headers_finished=self.on_headers_finished)

    def on_part_begin(self) -> None:
        self.headers, self.part = [], None

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def on_header_end(self) -> None:
        self.headers.append((self.name.lower(), self.value))
        self.name, self.value = b"", b""

    def on_headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, opts = parse_options_header(dict(self.headers).get(b"content-disposition", b""))
        if b"name" not in opts:
            raise BadRequestError("a multipart part has no name")
        if b"filename" in opts:
            if len(self.files) >= _MAX_FILES:
                raise BadRequestError("upload at most two files: adapter_config.json and adapter_model.safetensors "
                                      "(or one .zip)")
            path = self.folder / f"part-{len(self.files)}"
            client = opts[b"filename"].decode("utf-8", "replace")
            self.part = {"kind": "file", "f": open(path, "xb"), "path": path, "client": client, "head": b""}
        else:
            self.nfields += 1
            if self.nfields > _MAX_FIELDS:
                raise BadRequestError("too many form fields")
            self.part = {"kind": "field", "name": opts[b"name"].decode("utf-8", "replace"), "data": bytearray()}

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part, chunk = self.part, data[start:end]
        self.total += len(chunk)
        if self.total > self.limit:
            raise self.over_limit()
        if part["kind"] == "file":
            part["f"].write(chunk)
            if len(part["head"]) < 16:
                part["head"] += chunk[: 16 - len(part["head"])]
        else:
            part["data"] += chunk
            if len(part["data"]) > _MAX_FIELD_BYTES:
                raise BadRequestError(f"form field {part['name']!r} is too long")

    def on_part_end(self) -> None:
        part = self.part
        if part["kind"] == "file":
            part["f"].close()
            self.files.append((part["client"], part["path"], part["head"]))
        else:
            value = part["data"].decode("utf-8", "replace")
            check_text(value, part["name"])
            self.fields.setdefault(part["name"], []).append(value)
            self.on_field(part["name"], value)
        self.part = None

    def close(self) -> None:
        if self.part and self.part.get("kind") == "file":
            self.part["f"].close()


async def receive_upload(request: Request, st: AdminState, on_field) -> Upload:
    """Stream a multipart body to a staging folder; fields go to `on_field(name, value)` as
    they arrive (so a bad adapter name stops the upload before its files are read)."""
    import python_multipart
    from python_multipart.multipart import parse_options_header

    limit = upload_limit(st)
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise UnsupportedMediaTypeError("upload the adapter as multipart/form-data: its two files "
                                        "(adapter_config.json, adapter_model.safetensors) or a .zip of the folder")
    length = request.headers.get("content-length")
    if length and length.isascii() and length.isdigit() and len(length) < 20 and int(length) > limit:
        raise _over_limit(st, limit, int(length))
    uploads = st.store.root / "uploads"
    uploads.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="upload-", dir=uploads))
    sink = _PartSink(folder, limit, lambda: _over_limit(st, limit), on_field)
    parser = python_multipart.MultipartParser(params[b"boundary"], sink.callbacks())
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
        if sink.part is not None:
            raise BadRequestError("the upload ended in the middle of a part (interrupted?)")
        source = _arrange(folder, sink.files)
    except BaseException as exc:
        sink.close()
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, ClientDisconnect):
            raise BadRequestError("the client went away before the upload completed") from None
        if isinstance(exc, python_multipart.exceptions.MultipartParseError):
            raise BadRequestError(f"the multipart body is malformed: {exc}") from None
        raise
    return Upload(folder, sink.fields, source, sink.total)


def _arrange(folder: Path, files: list[tuple[str, Path, bytes]]) -> Path:
    """Name the staged files as the adapter store expects; the client's file names are
    used as hints only, never as paths."""
    if not files:
        raise BadRequestError("no adapter files in the upload: send adapter_config.json and "
                              "adapter_model.safetensors, or a .zip of the adapter folder")
    kinds = [(_sniff(head), client, path) for client, path, head in files]
    for kind, client, _ in kinds:
        low = client.lower()
        if low.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")) or (kind == "pickle" and not low.endswith(".zip")):
            raise BadRequestError(f"{_show(client)} is a pickled checkpoint; only safetensors is accepted "
                                  "(adapter_model.safetensors)")
    if len(kinds) == 1:
        kind, client, path = kinds[0]
        if kind == "zip":
            return path.rename(folder / "upload.zip")
        if kind in ("json", "safetensors"):
            missing = "adapter_model.safetensors" if kind == "json" else "adapter_config.json"
            raise BadRequestError(f"{missing} is missing: upload both files of the adapter, or a .zip of its folder")
        raise BadRequestError(f"{_show(client)} is neither a .zip nor an adapter file")
    if "zip" in [k for k, _, _ in kinds]:
        raise BadRequestError("upload either one .zip, or the two adapter files, not both")
    by_kind = {k: p for k, _, p in kinds}
    if set(by_kind) != {"json", "safetensors"}:
        names = ", ".join(_show(c) for _, c, _ in kinds)
        raise BadRequestError(f"expected adapter_config.json (JSON) and adapter_model.safetensors, got {names}")
    adapter = folder / "adapter"
    adapter.mkdir()
    by_kind["json"].rename(adapter / "adapter_config.json")
    by_kind["safetensors"].rename(adapter / "adapter_model.safetensors")
    return adapter


def _show(client_name: str) -> str:
    return repr(client_name.replace("\\", "/").rsplit("/", 1)[-1][:80])


def bool_field(fields: dict[str, list[str]], name: str) -> bool | None:
    vals = fields.get(name)
    if not vals:
        return None
    v = vals[-1].strip().lower()
    if v in ("true", "1", "on", "yes"):
        return True
    if v in ("false", "0", "off", "no", ""):
        return False
    raise BadRequestError(f"{name}: {vals[-1]!r} is not true or false", name)
