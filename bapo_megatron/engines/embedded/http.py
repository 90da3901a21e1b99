"""The embedded server's HTTP conventions, as SGLang's: JSON object bodies within limits, 400 for a bad
request, 500 with one line for anything else, control answers as success and a message."""

from __future__ import annotations

import asyncio
import functools
import traceback


def one_line(err: BaseException) -> str:
    """An error as one line for a response: its type and the first line of its message."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def ok(message: str, refused: str | None = None):
    """SGLang's answer to a control call: success and a message; a refusal is success false, HTTP 200."""
    from aiohttp import web

    return web.json_response({"success": refused is None, "message": refused or message})


BAD_REQUEST = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError)
"""What a malformed body raises (missing fields, wrong types, deeply nested JSON): 400, as SGLang's."""


@functools.cache
def request_timeout_key():
    """The app's key for the seconds a client has to send a request body (headers: aiohttp's keep-alive timer)."""
    from aiohttp import web

    return web.AppKey("request_timeout_s", float)


def guarded(handler):
    """Bad requests answer 400 with the reason, as SGLang's do; anything else 500 with one line
    (the traceback goes to the server's log, never into a response)."""
    from aiohttp import web

    async def wrapped(request):
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except BAD_REQUEST as err:
            return web.json_response({"success": False, "message": f"{type(err).__name__}: {err}"}, status=400)
        except Exception as err:
            traceback.print_exc()
            message = f"internal error: {one_line(err)}"
            return web.json_response({"success": False, "message": message}, status=500)

    return wrapped


async def json_object(request, limit: int | None = None) -> dict:
    """The request's JSON body, which must be an object (a list, a number or garbage: 400). With
    `limit`: a body over that many bytes is refused (413), a declared length before anything is
    read; otherwise the app's client_max_size bounds it."""
    import json

    from aiohttp import web

    if limit is not None and request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:
        async with asyncio.timeout(request.app[request_timeout_key()]):  # a slow client holds a connection
            raw = await request.read()
    except TimeoutError:
        seconds = request.app[request_timeout_key()]
        raise web.HTTPRequestTimeout(text=f"the request body took over {seconds:g} s") from None
    if limit is not None and len(raw) > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, not {type(body).__name__}")
    return body
