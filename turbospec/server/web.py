"""The web page at `/`: a chat view over the server's own API and a reports view over the lab's results.

The page is three static files shipped in the package (`turbospec/server/web/`: no build step, no network
fetches). It talks to the OpenAI routes for chat and to these read-only routes for the rest:

- `GET /props`: the model, context and the engine settings a chat message's stats line shows (KV format, drafter);
- `GET /lab/reports`: the reports found under `--reports` folders (every `report.json`, bench / quality / fit /
  tco) and the runs of the `--db` history;
- `GET /lab/reports/{id}`: one report (env, settings, rows) and the names of its plots;
- `GET /lab/plots/{id}/{name}.svg`: one plot, drawn by `turbospec.lab.plots` (cached);
- `GET /lab/compare?a=&b=`: the history's regression table of two runs (`r12`: history run ids).

Report ids name a found file by a hash of its path (`f` + 12 hex digits) or a history run (`r12`): a client
never passes a path. The page and its assets are open without an API key (they hold no data); the routes above are
not (the page sends the key the user typed)."""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from turbospec.errors import TurboSpecError
from turbospec.server.protocol import APIError

ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
PUBLIC_PATHS = ("/", "/favicon.ico", *(f"/web/{name}" for name in ASSETS))
MAX_REPORTS = 500  # .json files listed per folder
SVG_CACHE = 128  # plots kept drawn
NOSNIFF = {"X-Content-Type-Options": "nosniff"}
# the page runs only its own script and style, shows only its own (and blob:) images, and is never framed
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' blob:; object-src 'none'; "
                                           "base-uri 'none'; frame-ancestors 'none'", **NOSNIFF}


@cache
def asset(name: str) -> bytes:
    return resources.files("turbospec.server").joinpath("web", name).read_bytes()


def not_found(what: str) -> APIError:
    return APIError(404, what, "not_found_error", None, "not_found")


class Lab:
    """The reports and history the page shows: `--reports` folders (re-scanned on each listing) and a `--db`."""

    def __init__(self, folders: tuple[str, ...] = (), db: str | None = None):
        self.folders = tuple(Path(f) for f in folders)
        self.db = db
        self.files: dict[str, Path] = {}  # id -> file, as of the last scan
        # file -> ((mtime_ns, size), its listing entry or None when not a lab report): a listing reads only new or
        # changed files
        self.entries: dict[Path, tuple[tuple[int, int], dict[str, Any] | None]] = {}
        self.lock = threading.Lock()

    def scan(self) -> dict[str, Path]:
        found: list[Path] = []
        for folder in self.folders:
            if folder.is_file():
                found.append(folder)
            elif folder.is_dir():  # the newest MAX_REPORTS
                found += sorted(folder.rglob("*.json"), key=_mtime_key, reverse=True)[:MAX_REPORTS]
        files = {"f" + hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]: p for p in sorted(set(found))}
        with self.lock:
            self.files = files
        return files

    def listing(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        files = self.scan()
        for rid, path in files.items():
            entry = self.entry(path)
            if entry is not None:
                out.append({"id": rid, **entry})
        present = set(files.values())
        self.entries = {p: e for p, e in self.entries.items() if p in present}
        if self.db:
            from turbospec.lab import history

            try:
                runs = history.list_runs(self.db)
            except TurboSpecError:
                runs = []
            for run in runs:
                summary = run["settings"]
                text, model = summary.get("text", ""), summary.get("model")
                if isinstance(model, str) and "/" in model and "://" not in model:  # a path: its last part
                    text = text.replace(model, Path(model).name)
                out.append({"id": f"r{run['id']}", "source": "history", "kind": run.get("kind", "bench"),
                            "title": f"run {run['id']}: {text}",
                            "created": run.get("created"), "commit": run.get("git_commit"),
                            "rows": run.get("n_rows")})
        return out

    def entry(self, path: Path) -> dict[str, Any] | None:
        """`path`'s listing entry (kind, title, created, commit, rows), or None when it is not a lab report."""
        from turbospec.lab import plots

        try:
            st = path.stat()
        except OSError:
            return None
        version = (st.st_mtime_ns, st.st_size)
        cached = self.entries.get(path)
        if cached is not None and cached[0] == version:
            return cached[1]
        report = _read(path)
        kind = plots.report_kind(report) if report is not None else "unknown"
        entry = None
        if report is not None and kind != "unknown":
            env = report.get("env") or {}
            created = datetime.datetime.fromtimestamp(st.st_mtime).isoformat(timespec="seconds")
            entry = {"source": "file", "kind": kind, "title": _title(path, self.folders), "created": created,
                     "commit": env.get("git_commit") if isinstance(env, dict) else None,
                     "rows": len(rows) if isinstance(rows := report.get("rows"), list) else 0}
        self.entries[path] = (version, entry)
        return entry

    def report(self, rid: str) -> dict[str, Any]:
        """The report with id `rid` (404 when there is none, or when the file is not a lab report: the listing
        leaves those out, and other JSON in a reports folder is not served either)."""
        if rid.startswith("f"):
            from turbospec.lab import plots

            with self.lock:
                path = self.files.get(rid)
            if path is None:
                path = self.scan().get(rid)
            report = _read(path) if path is not None else None
            if report is not None and plots.report_kind(report) != "unknown":
                return report
        elif (run := run_number(rid)) is not None and self.db:
            from turbospec.lab import history

            try:
                return history.load_run(self.db, run)
            except TurboSpecError:
                pass
        raise not_found(f"no report {rid!r}")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _mtime_key(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _title(path: Path, folders: tuple[Path, ...]) -> str:
    for f in folders:
        try:
            rel = path.relative_to(f)
        except ValueError:
            continue
        return str(rel.parent if rel.name == "report.json" and rel.parent != Path(".") else rel)
    return path.name


class Web:
    """The page's routes (see the module docstring)."""

    def __init__(self, engine, model_name: str, lab: Lab):
        self.engine = engine
        self.model_name = model_name
        self.lab = lab
        self.svg_cache: dict[tuple[str, str, float], str] = {}  # oldest first
        self.cache_lock = threading.Lock()  # filled from the event loop and from worker threads

    async def index(self) -> HTMLResponse:
        return HTMLResponse(asset("index.html"), headers={"Cache-Control": "no-cache", **PAGE_HEADERS})

    async def static(self, name: str) -> Response:
        if name not in ASSETS:
            raise not_found(f"no asset {name!r}")
        return Response(asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache", **NOSNIFF})

    async def favicon(self) -> Response:
        return Response(status_code=204)

    async def props(self):
        c = self.engine.config  # KV formats left unset are the model's dtype
        return {"model": self.model_name, "n_ctx": self.engine.ctx, "cache_type_k": c.cache_type_k or c.dtype,
                "cache_type_v": c.cache_type_v or c.dtype, "spec_types": list(c.spec.types),
                "spec_n_max": c.spec.n_max if c.spec.types else None, "dtype": c.dtype, "weights": c.weights,
                "reports": bool(self.lab.folders or self.lab.db), "history": bool(self.lab.db)}

    async def reports(self):
        return {"reports": await run_in_threadpool(self.lab.listing)}

    async def report(self, rid: str):
        from turbospec.lab import plots

        report = await run_in_threadpool(self.lab.report, rid)
        names = await run_in_threadpool(self._draw_all, rid, report)
        return {"id": rid, "kind": plots.report_kind(report), "report": report, "plots": names}

    async def plot(self, rid: str, name: str) -> Response:
        key = (rid, name, self.version(rid))
        text = self.svg_cache.get(key)
        if text is None:  # not drawn by the report's own request, or since evicted
            text = await run_in_threadpool(self._draw, rid, name)
            self._keep(key, text)
        return Response(text, media_type="image/svg+xml", headers=NOSNIFF)

    def _keep(self, key: tuple[str, str, float], text: str) -> None:
        with self.cache_lock:
            if len(self.svg_cache) >= SVG_CACHE:
                self.svg_cache.pop(next(iter(self.svg_cache)))
            self.svg_cache[key] = text

    def _draw_all(self, rid: str, report: dict[str, Any]) -> list[str]:
        """The names of `report`'s plots, each drawn once into the cache the plot requests that follow read."""
        from turbospec.lab import plots

        version = self.version(rid)
        drawn = plots.figures(report)
        for name, fig in drawn:
            self._keep((rid, name, version), plots.svg(fig))
        return [name for name, _ in drawn]

    def version(self, rid: str) -> float:
        """What a cached plot of `rid` depends on: its file's modification time (history runs never change)."""
        with self.lab.lock:
            path = self.lab.files.get(rid)
        return _mtime_key(path) if path is not None else 0.0

    def _draw(self, rid: str, name: str) -> str:
        from turbospec.lab import plots

        for _, fig in plots.figures(self.lab.report(rid), only=(name,)):  # that one figure only
            return plots.svg(fig)
        raise not_found(f"report {rid!r} has no plot {name!r}")

    async def compare(self, request: Request) -> JSONResponse:
        a, b = request.query_params.get("a"), request.query_params.get("b")
        if not self.lab.db:
            raise APIError(501, "run history needs `turbospec serve --db FILE`", "not_supported_error")
        runs = [run_number(x) for x in (a or "", b or "")]
        if runs[0] is None or runs[1] is None:  # ids only: git revisions (`git rev-parse`) stay on the command line
            raise APIError(400, "compare needs ?a=rN&b=rM (history run ids, as /lab/reports lists them)",
                           "invalid_request_error")
        from turbospec.lab import history

        try:
            rows = await run_in_threadpool(history.compare, self.lab.db, str(runs[0]), str(runs[1]))
        except TurboSpecError as e:
            raise APIError(400, str(e), "invalid_request_error") from None
        return JSONResponse({"a": a, "b": b, "rows": rows})


def run_number(rid: str) -> int | None:
    """The run id of a history report id (`r12` -> 12); None for anything else (`r²`, a number SQLite cannot
    hold)."""
    digits = rid[1:]
    if rid.startswith("r") and digits.isascii() and digits.isdigit() and len(digits) <= 18:
        return int(digits)
    return None


def add_routes(app: FastAPI, engine, model_name: str, lab: Lab) -> None:
    web = Web(engine, model_name, lab)
    app.add_api_route("/", web.index, methods=["GET"])
    app.add_api_route("/favicon.ico", web.favicon, methods=["GET"])
    app.add_api_route("/web/{name}", web.static, methods=["GET"])
    app.add_api_route("/props", web.props, methods=["GET"])
    app.add_api_route("/lab/reports", web.reports, methods=["GET"])
    app.add_api_route("/lab/reports/{rid}", web.report, methods=["GET"])
    app.add_api_route("/lab/plots/{rid}/{name}.svg", web.plot, methods=["GET"])
    app.add_api_route("/lab/compare", web.compare, methods=["GET"])
