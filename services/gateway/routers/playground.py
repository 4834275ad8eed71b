"""The playground: a page to try the server (chat, images with live previews, interleaved answers), static HTML +
JS + CSS from services/gateway/static, no build step. It calls the public API like any client (the API key is
typed into the page), so it is open itself; `/` leads to it."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"
# the page loads only its own files and shows images from data: URLs
CSP = ("default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")

router = APIRouter(include_in_schema=False)


@router.get("/")
async def root():
    return RedirectResponse("/playground")


@router.get("/playground")
async def playground():
    return FileResponse(STATIC / "playground.html", media_type="text/html",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/playground/static", StaticFiles(directory=STATIC), name="playground-static")
