"""`GET /docs`: Swagger UI served from the packaged copy (swagger-ui-bundle), so it works offline.

FastAPI's own /docs loads Swagger UI from a CDN and is blank without network access; here the
page and its assets come from this server. ReDoc (CDN only) is not offered.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def add_offline_docs(app: FastAPI) -> None:
    """Call on an app built with docs_url=None and redoc_url=None."""
    from swagger_ui_bundle import swagger_ui_path  # noqa: PLC0415 - only when the app is built

    app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")
