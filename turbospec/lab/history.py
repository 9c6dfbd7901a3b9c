"""Run history: bench reports kept in one SQLite file, and regressions between two of them.

`record` appends a report (`turbospec bench --db FILE`) with its full environment; `list_runs`, `load_run`,
`resolve` and `compare` read it back (`turbospec bench history` / `turbospec bench compare`, and the web page).

The file: a `runs` table (one line per recorded report: when, kind, turbospec version, git commit, machine, the
environment and settings as JSON, a note) and a `rows` table (every report row as JSON, in order). `PRAGMA
application_id` marks the file as ours and `PRAGMA user_version` is its schema version: a later turbospec
migrates older files on open (`MIGRATIONS`), and refuses files written by a newer one. Reading never creates a
file.

Verdicts compare ranges, not medians: a throughput metric is `slower` only when B's best repetition is below A's
worst (min-max ranges do not overlap), `faster` in the reverse case, else `same (within noise)`; TTFT (lower is
better) the other way round. A metric recorded with a standard deviation but no min/max uses median +- sd as its
range; the acceptance rate without either (the median over repetitions only) is judged on its medians
(lower / higher / same), and a timing without either (a server's decode t/s) gets `no spread recorded`. A
change of the medians under `threshold_pct` (3% by default) is `same` whatever the ranges: three tight
repetitions otherwise call a 1% shift significant.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from turbospec.errors import TurboSpecError

APPLICATION_ID = 0x54535048  # "TSPH": PRAGMA application_id of a turbospec history file
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY,
    created TEXT NOT NULL,
    kind TEXT NOT NULL,
    version TEXT,
    git_commit TEXT,
    machine TEXT,
    env TEXT NOT NULL,
    settings TEXT NOT NULL,
    note TEXT
);
CREATE TABLE rows (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    row TEXT NOT NULL,
    PRIMARY KEY (run_id, idx)
);
CREATE INDEX runs_commit ON runs(git_commit);
"""

# schema version N -> the function that upgrades a version-N file to N+1 (in one transaction)
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {}

# metrics compared: name -> True when higher is better
METRICS: dict[str, bool] = {"prefill_tps": True, "decode_tps": True, "ttft_ms": False, "acc_rate": True}
KEY_FIELDS = ("engine", "config", "depth", "category")

SAME = "same (within noise)"
NO_SPREAD = "no spread recorded"
DEFAULT_THRESHOLD_PCT = 3.0  # compare: smaller changes of the median are "same" even when the ranges do not overlap


# --- the file ---------------------------------------------------------------------------------------------------

def _not_ours(db: Path) -> TurboSpecError:
    return TurboSpecError(f"{db} is not a turbospec history database")


@contextmanager
def _open(db: str | Path, create: bool) -> Iterator[sqlite3.Connection]:
    """A connection to the history file `db`, its schema created (`create`: on first use) or checked and
    migrated; committed on success, rolled back on error, closed either way. Without `create` a missing file
    is an error and nothing is created."""
    path = Path(db)
    if path.is_dir():
        raise TurboSpecError(f"{path} is a directory, not a turbospec history database")
    if not path.exists():
        if not create:
            raise TurboSpecError(f"no history database {path} (record one with `turbospec bench ... --db {path}`)")
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = sqlite3.connect(path, timeout=30)
    except sqlite3.Error as e:
        raise TurboSpecError(f"cannot open history database {path}: {e}") from None
    with closing(con):
        try:
            _prepare(con, path, create)
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "readonly" in str(e):
                raise TurboSpecError(f"history database {path}: {e}") from None
            raise _not_ours(path) from None
        except sqlite3.DatabaseError:
            raise _not_ours(path) from None
        try:
            with con:
                yield con
        except sqlite3.DatabaseError as e:
            raise TurboSpecError(f"history database {path} is damaged or unreadable: {e}") from None


def _prepare(con: sqlite3.Connection, path: Path, create: bool) -> None:
    """Create the schema in a new (empty) file when writing; else check the file is ours and migrate it."""
    con.execute("PRAGMA foreign_keys = ON")
    if create:  # hold the write lock from the check to the schema: two first writers do not both create it
        con.execute("BEGIN IMMEDIATE")
    try:
        app, version = _header(con)
        if app == 0 and version == 0 and not con.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            if not create:
                raise _not_ours(path)
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    con.execute(statement)
            con.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif app != APPLICATION_ID:
            raise _not_ours(path)
        elif version > SCHEMA_VERSION:
            raise TurboSpecError(f"{path} has history schema {version}, newer than this turbospec reads "
                                 f"({SCHEMA_VERSION}): upgrade turbospec")
        elif version < SCHEMA_VERSION:
            if not con.in_transaction:
                con.execute("BEGIN IMMEDIATE")
                version = _header(con)[1]  # another process may have migrated it meanwhile
            for v in range(version, SCHEMA_VERSION):
                if v not in MIGRATIONS:
                    raise TurboSpecError(f"{path}: no migration from history schema {v}")
                MIGRATIONS[v](con)
                con.execute(f"PRAGMA user_version = {v + 1}")
        if con.in_transaction:
            con.commit()
    except BaseException:
        if con.in_transaction:
            con.rollback()
        raise


def _header(con: sqlite3.Connection) -> tuple[int, int]:
    """The file's (application_id, user_version)."""
    app = con.execute("PRAGMA application_id").fetchone()[0]
    return int(app), int(con.execute("PRAGMA user_version").fetchone()[0])


# --- writing and reading runs -----------------------------------------------------------------------------------

def machine_name(env: dict[str, Any]) -> str:
    """The machine a report was measured on, in one line: CPU model, cores, and the GPU if any."""
    parts = [str(env.get("cpu") or "unknown CPU")]
    if env.get("cores"):
        parts.append(f"{env['cores']} cores")
    if env.get("gpu"):
        parts.append(str(env["gpu"]))
    return ", ".join(parts)


def record(db: str | Path, report: dict[str, Any], kind: str = "bench", note: str | None = None) -> int:
    """Append `report` (`{"env", "settings", "rows"}` as `turbospec.lab.bench.run_local` and
    `turbospec.lab.client.run_remote` return it) to the history file `db`, created on first use; the new
    run's id."""
    env = dict(report.get("env") or {})
    settings = report.get("settings") or {}
    rows = list(report.get("rows") or [])
    created = datetime.now().astimezone().isoformat(timespec="seconds")
    with _open(db, create=True) as con:
        cur = con.execute(
            "INSERT INTO runs (created, kind, version, git_commit, machine, env, settings, note) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (created, kind, env.get("turbospec"), env.get("git_commit"), machine_name(env),
             json.dumps(env, default=str), json.dumps(settings, default=str), note))
        run_id = cur.lastrowid
        assert run_id is not None
        con.executemany("INSERT INTO rows (run_id, idx, row) VALUES (?, ?, ?)",
                        [(run_id, i, json.dumps(r, default=str)) for i, r in enumerate(rows)])
    return run_id


def settings_summary(settings: dict[str, Any], env: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a run measured, in short: model (or the server URLs), sweep, depths, n_prompt, n_gen, repetitions,
    categories, and all of it as one line in `text`."""
    env = env or {}
    engine: dict[str, Any] = settings["engine"] if isinstance(settings.get("engine"), dict) else {}
    urls = settings.get("url")
    model = ", ".join(urls) if urls else settings.get("model") or engine.get("model") or env.get("model")
    sweep = list(settings.get("sweep") or [])
    depth = settings.get("depth", settings.get("depths"))
    if isinstance(depth, list | tuple):
        depth = ",".join(str(d) for d in depth)
    out = {"model": model, "sweep": sweep, "depth": depth, "n_prompt": settings.get("n_prompt"),
           "n_gen": settings.get("n_gen"), "repetitions": settings.get("repetitions"),
           "categories": settings.get("categories")}
    parts = [str(model or "bundled model")] + [f"--sweep {s}" for s in sweep]
    if depth not in (None, "", "0", 0):
        parts.append(f"-d {depth}")
    for flag, key in (("-p", "n_prompt"), ("-n", "n_gen"), ("-r", "repetitions"), ("--categories", "categories")):
        if out[key] is not None:
            parts.append(f"{flag} {out[key]}")
    return {**out, "text": " ".join(parts)}


def list_runs(db: str | Path) -> list[dict[str, Any]]:
    """Every run in `db`, newest first: id, created, kind, version, git_commit, machine, note, n_rows and
    `settings` (`settings_summary`: model, sweep, ..., `text`)."""
    with _open(db, create=False) as con:
        runs = con.execute(
            "SELECT id, created, kind, version, git_commit, machine, note, env, settings, "
            "(SELECT count(*) FROM rows WHERE rows.run_id = runs.id) FROM runs ORDER BY id DESC").fetchall()
    out = []
    for rid, created, kind, version, commit, machine, note, env, settings, n_rows in runs:
        out.append({"id": rid, "created": created, "kind": kind, "version": version, "git_commit": commit,
                    "machine": machine, "note": note, "n_rows": n_rows,
                    "settings": settings_summary(json.loads(settings), json.loads(env))})
    return out


def load_run(db: str | Path, run_id: int) -> dict[str, Any]:
    """Run `run_id` of `db` as recorded: the report (env, settings, rows) plus id, created, kind, version,
    git_commit, machine and note."""
    with _open(db, create=False) as con:
        run = con.execute("SELECT id, created, kind, version, git_commit, machine, note, env, settings "
                          "FROM runs WHERE id = ?", (int(run_id),)).fetchone()
        if run is None:
            raise TurboSpecError(f"no run {run_id} in {db}")
        rows = [json.loads(r) for (r,) in
                con.execute("SELECT row FROM rows WHERE run_id = ? ORDER BY idx", (int(run_id),))]
    rid, created, kind, version, commit, machine, note, env, settings = run
    return {"id": rid, "created": created, "kind": kind, "version": version, "git_commit": commit,
            "machine": machine, "note": note, "env": json.loads(env), "settings": json.loads(settings),
            "rows": rows}


# --- finding runs -----------------------------------------------------------------------------------------------

def resolve(db: str | Path, ref: str | int) -> int:
    """The run `ref` names in `db`: a run id (`12`, or `#12`), or a git revision: a commit hash prefix (4+ hex
    digits) matched against the recorded commits, else any name git knows in the current directory (`HEAD~1`,
    a tag, a branch), resolved by `git rev-parse`. A commit names its newest run. A number that is a run id is
    that run."""
    text = str(ref).strip()
    if not text:
        raise TurboSpecError("empty run reference")
    with _open(db, create=False) as con:
        m = re.fullmatch(r"#?([0-9]{1,18})", text)  # an id SQLite can hold (not `\d`: other scripts' digits)
        if m and con.execute("SELECT 1 FROM runs WHERE id = ?", (int(m[1]),)).fetchone():
            return int(m[1])
        if text.startswith("#"):
            raise TurboSpecError(f"no run {text} in {db}")
        stored = [c for (c,) in con.execute("SELECT DISTINCT git_commit FROM runs WHERE git_commit IS NOT NULL")]
        hits: list[str] = []
        if re.fullmatch(r"[0-9a-fA-F]{4,64}", text):
            hits = _match_commit(db, text, text.lower(), stored)
        full = None
        if not hits:
            full = _git_rev_parse(text)
            if full is not None:
                hits = _match_commit(db, text, full, stored)
        if not hits:
            n, lo, hi = con.execute("SELECT count(*), min(id), max(id) FROM runs").fetchone()
            have = f"runs {lo}-{hi}" if n else "no runs"
            listing = f"`turbospec bench history --db {db}` lists them"
            if full is not None:
                raise TurboSpecError(f"{text} is commit {full[:12]}, but no run in {db} was recorded at it "
                                     f"({db} has {have}; {listing})")
            raise TurboSpecError(f"unknown run {text!r}: not a run id, a recorded commit or a git revision "
                                 f"({db} has {have}; {listing})")
        marks = ",".join("?" * len(hits))
        return int(con.execute(f"SELECT max(id) FROM runs WHERE git_commit IN ({marks})", hits).fetchone()[0])


def _match_commit(db: str | Path, ref: str, commit: str, stored: list[str]) -> list[str]:
    """The recorded hashes of the one commit that `commit` (a hash prefix, or a full hash from git) names:
    those it prefixes or that prefix it (git's short hashes grow with the repository, so one commit may be
    recorded at several lengths). Hashes of different commits are an error: `ref` is ambiguous."""
    hits = [c for c in stored if len(c) >= 4 and (c.lower().startswith(commit) or commit.startswith(c.lower()))]
    longest = max(hits, key=len, default="").lower()
    if any(not longest.startswith(c.lower()) for c in hits):
        raise TurboSpecError(f"{ref!r} is ambiguous in {db}: it matches commits {', '.join(sorted(hits))}; "
                             "give more hash digits or a run id")
    return hits


def _git_rev_parse(ref: str) -> str | None:
    """The full hash of the commit git names `ref` in the current directory; None without git or a match."""
    if ref.startswith("-"):
        return None
    try:
        r = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], check=False,
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    out = r.stdout.strip().lower()
    return out if r.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", out) else None


# --- comparing runs ---------------------------------------------------------------------------------------------

def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(k) for k in KEY_FIELDS)


def _keyed(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Rows by (engine, config, depth, category); a repeated key gets its occurrence number appended."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    seen: Counter[tuple[Any, ...]] = Counter()
    for r in rows:
        k = _key(r)
        seen[k] += 1
        out[k if seen[k] == 1 else (*k, seen[k])] = r
    return out


def _band(row: dict[str, Any], metric: str) -> tuple[float | None, float | None, str | None]:
    """A metric's range in one row: (low, high, how): min-max when recorded, else median +- sd, else none."""
    lo, hi, med, sd = (row.get(metric + s) for s in ("_min", "_max", "", "_sd"))
    if isinstance(lo, int | float) and isinstance(hi, int | float):
        return float(lo), float(hi), "min-max"
    if isinstance(med, int | float) and isinstance(sd, int | float) and sd > 0:
        return float(med) - sd, float(med) + sd, "sd"
    return None, None, None


def verdict(metric: str, a: dict[str, Any], b: dict[str, Any], threshold_pct: float = 0.0) -> str:
    """B vs A on one metric of one row pair (see the module doc): slower / faster / same (within noise), and
    for the acceptance rate lower / higher / same; `no spread recorded` for a timing whose medians differ
    but whose range one of the rows lacks. A change of the medians under `threshold_pct` percent is the same
    whatever the ranges (a few tight repetitions make small shifts look significant)."""
    higher_better = METRICS.get(metric, True)
    same = "same" if metric == "acc_rate" else SAME
    am, bm = float(a[metric]), float(b[metric])
    if am and abs(bm - am) < threshold_pct / 100.0 * abs(am):
        return same
    a_lo, a_hi, _ = _band(a, metric)
    b_lo, b_hi, _ = _band(b, metric)
    if a_lo is None or b_lo is None or a_hi is None or b_hi is None:  # no spread: medians
        a_lo = a_hi = am
        b_lo = b_hi = bm
        if abs(bm - am) <= 1e-9 * max(1.0, abs(am)):
            return same
        if metric != "acc_rate":
            return NO_SPREAD
    if b_hi < a_lo:
        worse = higher_better
    elif b_lo > a_hi:
        worse = not higher_better
    else:
        return same
    if metric == "acc_rate":
        return "lower" if worse else "higher"
    return "slower" if worse else "faster"


def compare(db: str | Path, a: str | int, b: str | int, threshold_pct: float = DEFAULT_THRESHOLD_PCT
            ) -> list[dict[str, Any]]:
    """Run `b` against run `a` (run ids or git revisions, see `resolve`): one line per matched row (by engine,
    config, depth, category) and metric (prefill_tps, decode_tps, ttft_ms, acc_rate, those recorded), with
    a_median, a_min, a_max, b_median, b_min, b_max (the ranges the verdict used; None when unrecorded),
    band ('min-max', 'sd' or None), change_pct (B vs A) and verdict. A row in one run only is one line with
    metric None and verdict 'only in A' / 'only in B'; a metric in one row of a pair only, likewise."""
    return compare_runs(load_run(db, resolve(db, a)), load_run(db, resolve(db, b)), threshold_pct)


def compare_runs(run_a: dict[str, Any], run_b: dict[str, Any], threshold_pct: float = DEFAULT_THRESHOLD_PCT
                 ) -> list[dict[str, Any]]:
    """`compare` of two runs already loaded (`load_run`)."""
    rows_a, rows_b = _keyed(run_a["rows"]), _keyed(run_b["rows"])
    out: list[dict[str, Any]] = []
    for key in list(rows_a) + [k for k in rows_b if k not in rows_a]:
        ra, rb = rows_a.get(key), rows_b.get(key)
        base = dict(zip(KEY_FIELDS, key))
        if ra is None or rb is None:
            out.append({**base, "metric": None, "verdict": "only in A" if rb is None else "only in B"})
            continue
        for metric in METRICS:
            in_a, in_b = ra.get(metric) is not None, rb.get(metric) is not None
            if not (in_a or in_b):
                continue
            line: dict[str, Any] = {**base, "metric": metric}
            if not (in_a and in_b):
                out.append({**line, "verdict": "only in A" if in_a else "only in B"})
                continue
            a_lo, a_hi, a_how = _band(ra, metric)
            b_lo, b_hi, b_how = _band(rb, metric)
            am, bm = float(ra[metric]), float(rb[metric])
            band = None if a_how is None or b_how is None else "min-max" if a_how == b_how == "min-max" else "sd"
            line.update(a_median=am, a_min=a_lo, a_max=a_hi, b_median=bm, b_min=b_lo, b_max=b_hi, band=band,
                        change_pct=100.0 * (bm - am) / am if am else None, verdict=verdict(metric, ra, rb, threshold_pct))
            out.append(line)
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two loaded runs (`load_run`) besides the code: machine, model, torch, the
    TURBOSPEC_* switches and the measurement settings; one line each, empty when they match."""
    out = []
    if a.get("machine") != b.get("machine"):
        out.append(f"machine: {a.get('machine')} vs {b.get('machine')}")
    for key in ("model", "model_sha256_16", "torch", "python", "turbospec_env", "gpu"):
        va, vb = a["env"].get(key), b["env"].get(key)
        if va != vb:
            out.append(f"{key}: {va} vs {vb}")
    ignore = {"out", "quiet", "db", "note", "func"}
    sa, sb = a["settings"], b["settings"]
    for key in sorted((set(sa) | set(sb)) - ignore):
        if sa.get(key) != sb.get(key):
            out.append(f"{key}: {sa.get(key)} vs {sb.get(key)}")
    return out


def summary(lines: list[dict[str, Any]]) -> str:
    """A comparison's verdicts counted in one line: 'S slower, F faster, N same' plus any others."""
    counts = Counter(line["verdict"] for line in lines)
    same = counts.pop(SAME, 0) + counts.pop("same", 0)
    parts = [f"{counts.pop('slower', 0)} slower", f"{counts.pop('faster', 0)} faster", f"{same} same"]
    if counts.get("lower"):
        parts.append(f"{counts.pop('lower')} lower acceptance")
    if counts.get("higher"):
        parts.append(f"{counts.pop('higher')} higher acceptance")
    parts += [f"{n} {v}" for v, n in counts.items() if n]
    return ", ".join(parts)
