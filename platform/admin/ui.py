"""The admin UI's static files (under /admin): served by exact name from one folder, with
a strict Content-Security-Policy."""
from __future__ import annotations

import mimetypes
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response

from loraplex.platform.errors import NotFoundError, api_error, error_response


def admin_ui_dir() -> Path:
    """The UI's static files: <repo>/admin_ui in a checkout, loraplex/admin_ui installed
    (both beside this package's folder)."""
    return Path(__file__).resolve().parents[2] / "admin_ui"


UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}


async def ui_index(request: Request) -> Response:
    path = admin_ui_dir() / "index.html"
    if not path.is_file():
        return error_response(api_error(NotFoundError(f"the admin UI files are missing ({path.parent})")))
    return FileResponse(path, media_type="text/html; charset=utf-8", headers=UI_HEADERS)


async def ui_asset(request: Request) -> Response:
    name = request.path_params["file"]
    files = {p.name: p for p in admin_ui_dir().iterdir() if p.is_file()} if admin_ui_dir().is_dir() else {}
    path = files.get(name)  # only files that are in the folder, by exact name: no paths
    if path is None:
        return error_response(api_error(NotFoundError(f"no admin UI file {name!r}")))
    media = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if media.startswith("text/") or media.endswith("javascript"):
        media += "; charset=utf-8"
    return FileResponse(path, media_type=media, headers=UI_HEADERS)


async def ui_redirect(request: Request) -> Response:
    return RedirectResponse("/admin/", status_code=308)
