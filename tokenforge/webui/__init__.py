"""The browser UI's files (playground and dashboard), shipped in the package and served offline.

Both `tokenforge serve` (server/ui.py) and `tokenforge router` (router/ui.py) serve these same
assets: plain JavaScript, CSS and one HTML shell, with no CDN and no build step. `Assets` reads
them once, keeps a gzip copy of each, and answers by name with the headers a browser needs.
Nothing here imports the engine, the server or the router.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path

ASSET_DIR = Path(__file__).with_name("assets")
PAGES = ("/ui", "/ui/", "/ui/dashboard")     # every page is the one shell; the script picks the view
ASSET_PREFIX = "/ui/assets/"
STATS_PATH = "/ui/api/stats"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# The page runs no inline script and loads nothing from elsewhere: model output that slipped past
# the renderer as HTML still could not run (defence in depth behind markdown.js's escaping).
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    gzipped: bytes
    content_type: str
    etag: str


class Assets:
    def __init__(self, directory: Path = ASSET_DIR) -> None:
        self.files: dict[str, Asset] = {}
        for path in sorted(directory.iterdir()):
            if path.suffix in _TYPES:
                body = path.read_bytes()
                self.files[path.name] = Asset(body, gzip.compress(body, 9, mtime=0), _TYPES[path.suffix],
                                              '"' + hashlib.sha256(body).hexdigest()[:16] + '"')

    def lookup(self, path: str) -> Asset | None:
        """The asset for a request path (a page or /ui/assets/NAME), or None."""
        if path in PAGES:
            return self.files["index.html"]
        if path.startswith(ASSET_PREFIX):
            return self.files.get(path[len(ASSET_PREFIX):])
        return None

    def answer(self, path: str, accept_encoding: str = "", if_none_match: str = "") -> tuple[int, bytes, dict] | None:
        """(status, body, headers) for a page or asset path (304 when the ETag matches), or None."""
        asset = self.lookup(path)
        if asset is None:
            return None
        body, headers = self.headers(asset, accepts_gzip(accept_encoding))
        if asset.etag in (tag.strip() for tag in if_none_match.split(",")):
            return 304, b"", {k: v for k, v in headers.items() if k in ("etag", "cache-control", "vary")}
        return 200, body, headers

    @staticmethod
    def headers(asset: Asset, accepts_gzip: bool) -> tuple[bytes, dict[str, str]]:
        """(body, headers): gzip when the client takes it; revalidated by ETag on every load."""
        headers = {"content-type": asset.content_type, "etag": asset.etag, "cache-control": "no-cache",
                   "content-security-policy": CSP, "x-content-type-options": "nosniff",
                   "referrer-policy": "no-referrer", "vary": "accept-encoding"}
        if accepts_gzip:
            headers["content-encoding"] = "gzip"
            return asset.gzipped, headers
        return asset.body, headers


def accepts_gzip(accept_encoding: str) -> bool:
    return any(part.split(";")[0].strip() == "gzip" for part in accept_encoding.lower().split(","))
