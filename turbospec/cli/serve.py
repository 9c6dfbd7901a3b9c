"""`turbospec serve`: the server's flags, and serving: build the engine, the default sampling settings and the
`ServerConfig` from the flags, then run the app under uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from turbospec import env
from turbospec.cli.args import (
    add_model_args,
    add_parallel_arg,
    add_sampling_args,
    add_spec_args,
    engine_config,
    sampling_params,
)
from turbospec.engine import build_engine
from turbospec.errors import TurboSpecError
from turbospec.lab.progress import loading
from turbospec.server import BODY_BYTES_PER_TOKEN, DEFAULT_MAX_BODY, body_limit
from turbospec.server.security import binds_beyond_loopback


def register(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_args(s)
    add_parallel_arg(s)
    add_spec_args(s)
    add_sampling_args(s, n_help="the most tokens a request may generate, and the default when it gives no max_tokens "
                                "(a larger max_tokens is clamped: finish_reason length); -1 or 0: no limit but "
                                "the context (default -1, as llama-server)")
    s.set_defaults(n_predict=-1)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: none; also TURBOSPEC_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="accept every key listed in PATH, one per line (blank lines ignored); with --api-key, "
                        "both are accepted")
    p.add_argument("--alias", default=None,
                   help="model name served in the API (default: the model directory name)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"largest accepted request body (default {BODY_BYTES_PER_TOKEN} bytes per context position, "
                        f"at least {DEFAULT_MAX_BODY}: room for a prompt that fills -c)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="sequences decoded together (continuous batching over a paged KV pool of -c positions "
                        "shared by all of them; n-gram and draft-mtp speculation per sequence) (default 1: one at a time)")
    p.add_argument("--cache-mem", type=int, default=None, metavar="MIB",
                   help="-np > 1: memory of the shared KV pool in MiB, prefix cache and hybrid models' recurrent "
                        "states included (default: room for -c positions)")
    p.add_argument("--ctx-checkpoints", type=int, default=3, metavar="N",
                   help="hybrid models: recurrent states kept so that a prompt repeating an earlier one resumes "
                        "where they were kept: before the last token of the last N prompts (-np 1), or N per "
                        "sequence at KV block boundaries, before prompts' last tokens and at the last position "
                        "(-np > 1) (default 3; 0: every prompt is processed in full)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="folder for POST /slots/{id}?action=save|restore files (a slot's context: tokens, K/V, "
                        "recurrent states); without it those actions answer 501")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for the generation worker; more get 503 (default 64)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="per-request limit in seconds: queue wait beyond it -> 503, generation is cut off "
                        "(finish_reason length) (default 600)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds to receive a request body; slower clients get 408 (default 30)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="requests in flight at once (queued, generating or being read); more get 503 (default 256)")
    p.add_argument("--max-concurrent-per-key", type=int, default=0,
                   help="generation requests one API key may have queued or running; more get 429 (default 0: "
                        "no limit)")
    p.add_argument("--stream-interval-ms", type=float, default=50.0,
                   help="a stream writes what it has at most this often; the first token goes out at once "
                        "(default 50; 0 = a write per token)")
    p.add_argument("--reports", action="append", default=[], metavar="DIR",
                   help="lab reports (folders of bench/quality/fit/tco JSON, or files) the web page lists; repeatable")
    p.add_argument("--db", default=None, metavar="FILE",
                   help="a `turbospec bench --db` history the web page lists and compares")
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="no web page at / (chat and reports); the API only")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from turbospec.server import ServerConfig, create_app

    if (a.max_body_bytes is not None and a.max_body_bytes <= 0) or a.max_queue <= 0 or not (a.timeout > 0) \
            or not (a.body_timeout > 0) or a.max_connections <= 0:
        raise TurboSpecError("--max-body-bytes, --max-queue, --max-connections, --timeout and --body-timeout "
                             "must be positive")
    if a.parallel <= 0:
        raise TurboSpecError("--parallel must be positive")
    if a.max_concurrent_per_key < 0 or not (0 <= a.stream_interval_ms <= 1000):
        raise TurboSpecError("--max-concurrent-per-key must be >= 0 and --stream-interval-ms in 0..1000")
    if not (0 < a.port < 65536):
        raise TurboSpecError("--port must be in 1..65535")
    a.n_predict = max(a.n_predict, 0)  # -1 (llama.cpp's "no limit") is 0 here: no cap beyond the context
    defaults = sampling_params(a)
    keys = api_keys(a)
    if not keys and binds_beyond_loopback(a.host):
        print(f"warning: --host {a.host} may be reachable from other machines and no API key is set: anyone who "
              f"can reach port {a.port} can use the server; set --api-key-file (or --api-key)",
              file=sys.stderr, flush=True)
    check_lab_sources(a)
    with loading() as load_bar:
        engine = build_engine(engine_config(a).replace(cache_mem=a.cache_mem, ctx_checkpoints=a.ctx_checkpoints),
                              load_bar)
    max_body = a.max_body_bytes if a.max_body_bytes is not None else body_limit(engine.ctx)
    from turbospec.parallel import tp

    rank, ranks = tp.world()
    if ranks > 1:  # under torchrun: rank 0 serves, the others follow its engine calls (turbospec.parallel.tp)
        if rank != 0:
            from turbospec.engine import slots

            if a.parallel > 1:
                tp.follow_scheduler(engine.new_scheduler(a.parallel), engine, slots.part)
            else:
                tp.follow(engine, slots.part)
            return 0
        engine = tp.Lockstep(engine)
    name = a.alias or Path(engine.model_path).name
    cfg = ServerConfig(model_name=name, api_keys=keys, host=a.host, max_body_bytes=max_body,
                       max_queue=a.max_queue, timeout=a.timeout, defaults=defaults, body_timeout=a.body_timeout,
                       max_per_key=a.max_concurrent_per_key, max_connections=a.max_connections,
                       stream_interval=a.stream_interval_ms / 1e3, parallel=a.parallel,
                       slot_save_path=a.slot_save_path, web_ui=a.webui, reports=tuple(a.reports),
                       history_db=a.db)
    app = create_app(engine, cfg, worker_thread=False)
    # the app answers past --max-connections itself (OpenAI JSON); uvicorn's own limit (plain text) stays a
    # backstop for idle keep-alive connections far beyond it
    http = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level,
                                         limit_concurrency=4 * a.max_connections, timeout_keep_alive=30,
                                         access_log=False, timeout_graceful_shutdown=10))
    origin = f"http://{f'[{a.host}]' if ':' in a.host else a.host}:{a.port}"  # IPv6 addresses in brackets
    page = f"; web page {origin}/" if a.webui else ""
    try:
        return serve_on_main_thread(http, app.state.worker, f"model '{name}' on {origin} "
                                    f"(ctx {engine.ctx}, parallel {a.parallel}, queue {a.max_queue}"
                                    f"{f', {len(keys)} api key(s) accepted' if keys else ''}"
                                    f"{f', tensor parallel {ranks}' if ranks > 1 else ''}){page}")
    finally:
        if isinstance(engine, tp.Lockstep):
            engine.close()


def check_lab_sources(a: argparse.Namespace) -> None:
    """--reports paths must exist and --db must be a turbospec history: said before the model loads, not found out
    as an empty reports list."""
    for path in a.reports:
        if not Path(path).exists():
            raise TurboSpecError(f"--reports {path}: no such folder or file")
    if a.db is not None:
        from turbospec.lab import history

        history.list_runs(a.db)  # a clear error for a missing file or one that is not a history


def serve_on_main_thread(http, worker, banner: str) -> int:
    """HTTP in a thread, generation on this (the main) thread: see `Worker` for why. SIGINT / SIGTERM stop
    both: uvicorn stops accepting and gives open responses up to 10 s (a second signal: none), queued and new
    requests get a 503 (`shutting_down`), the running one stops at its next token (finish reason "abort")."""
    import signal
    import threading

    t = threading.Thread(target=http.run, name="turbospec-http", daemon=True)
    t.start()
    while not http.started:  # uvicorn binds the port, or fails to and the thread ends
        if not t.is_alive():
            raise TurboSpecError("the HTTP server did not start (see the message above)")
        t.join(0.05)
    print(f"turbospec serve: {banner}", flush=True)

    def on_signal(signum, frame) -> None:
        if http.should_exit:  # a second Ctrl-C: close the open streams now instead of after 10 s
            http.force_exit = True
        http.should_exit = True
        worker.stop_soon()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        worker.run(alive=t.is_alive)
    finally:
        http.should_exit = True
        t.join(15)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def api_keys(a: argparse.Namespace) -> tuple[str, ...]:
    """The accepted API keys: --api-key and every key in --api-key-file; $TURBOSPEC_API_KEY when neither flag is
    given. An empty key, an unreadable or empty key file, or a key a header cannot carry is an error."""
    keys: list[str] = []
    if a.api_key is not None:
        keys.append(_check_key(a.api_key, "--api-key"))
    if a.api_key_file is not None:
        keys += read_key_file(a.api_key_file)
    if a.api_key is None and a.api_key_file is None:
        from_env = env.lookup("TURBOSPEC_API_KEY")
        if from_env is not None:
            keys.append(_check_key(from_env, "TURBOSPEC_API_KEY"))
    return tuple(dict.fromkeys(keys))


def read_key_file(path: str) -> list[str]:
    """The keys in `path`, one per line; surrounding whitespace and blank lines are ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise TurboSpecError(f"--api-key-file {path}: cannot read it ({reason})") from None
    keys = [_check_key(line, f"--api-key-file {path} line {i}")
            for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not keys:
        raise TurboSpecError(f"--api-key-file {path} holds no keys")
    return keys


def _check_key(key: str, where: str) -> str:
    key = key.strip()
    if not key:
        raise TurboSpecError(f"{where}: the API key is empty (an empty key would disable authentication)")
    if any(not (33 <= ord(c) < 127) for c in key):
        raise TurboSpecError(f"{where}: an API key must be printable ASCII without spaces")
    return key
