"""`tetrad ps`: the models a running `tetrad serve` holds loaded (its /api/ps, as `ollama ps`
shows them): each one's memory (weights and KV cache, counted at load), where it runs and when
it unloads."""

from __future__ import annotations

import argparse
import http.client
import json
import os
from datetime import datetime, timezone

from tetrad.errors import TetradError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("ps", help="list the models a running server has loaded",
                                   description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="the server's address (default "
                                                            "127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="its port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("TETRAD_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $TETRAD_API_KEY)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the answer (default %(default)g)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for row in table(loaded_models(args)):
        print(row)
    return 0


def loaded_models(args: argparse.Namespace) -> list[dict]:
    where = f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        connection = http.client.HTTPConnection(args.host, args.port, timeout=args.timeout)
        connection.request("GET", "/api/ps", headers=headers)
        response = connection.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as error:
        raise TetradError(f"no answer from a server at {where} ({error}): `tetrad serve "
                          f"--port {args.port}` starts one") from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if response.status != 200 or not isinstance(answer, dict) or \
            not isinstance(answer.get("models"), list):
        raise TetradError(f"{where}/api/ps answered {response.status} "
                          f"{body[:200].decode(errors='replace')!r}: not a tetrad server?")
    return answer["models"]


def table(models: list[dict], now: datetime | None = None) -> list[str]:
    rows = [("NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL")]
    for model in models:
        size = model.get("size", 0)
        processor = "GPU" if model.get("size_vram") else "CPU"
        rows.append((model.get("name", "?"), f"{size / 2**20:.1f} MiB", processor,
                     str(model.get("context_length", "")), until(model.get("expires_at"), now)))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]


def until(expires_at: str | None, now: datetime | None = None) -> str:
    """When a model unloads, as `ollama ps` says it: "Forever", or how long from now."""
    if expires_at is None:
        return "Forever"
    moment = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    seconds = (moment - (now or datetime.now(timezone.utc))).total_seconds()
    if seconds <= 0:
        return "Stopping..."
    for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count != 1 else ''} from now"
    return "less than a second from now"
