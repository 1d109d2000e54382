"""`GET /docs`: Swagger UI served from the packaged copy (swagger-ui-bundle), so it works offline.

FastAPI's own /docs loads Swagger UI from a CDN and is blank without network access; here the
page and its assets come from this server. ReDoc (CDN only) is not offered.

The assets are a nicety, never a reason not to serve: when swagger-ui-bundle cannot be imported
(a slim image, a broken install), start-up logs one warning and /docs answers 404 with an error
body that names the missing package and the command that installs it. /openapi.json still works.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

logger = logging.getLogger(__name__)

ASSETS = "/docs/assets"
PACKAGE = "swagger-ui-bundle"
INSTALL_HINT = f"pip install {PACKAGE}"


def add_offline_docs(app: FastAPI) -> None:
    """Call on an app built with docs_url=None and redoc_url=None."""
    try:
        from swagger_ui_bundle import swagger_ui_path  # noqa: PLC0415 - only when the app is built
    except ImportError as err:
        logger.warning("/docs is off: the package %s is missing (%s); install it with `%s`",
                       PACKAGE, err, INSTALL_HINT)
        _add_missing_docs(app)
        return
    from fastapi.staticfiles import StaticFiles  # noqa: PLC0415

    app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")


def _add_missing_docs(app: FastAPI) -> None:
    message = (f"/docs is not available: the package {PACKAGE} (Swagger UI's assets) is not installed. "
               f"Install it with `{INSTALL_HINT}`; the schema is at {app.openapi_url}.")
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "docs_unavailable"}}

    @app.get("/docs", include_in_schema=False)
    async def docs() -> JSONResponse:
        return JSONResponse(body, status_code=404)
