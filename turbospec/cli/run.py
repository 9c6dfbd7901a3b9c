"""`turbospec run`: stream a completion, then one stats line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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
from turbospec.lab.progress import LONG_PROMPT, Progress, loading

DEFAULT_PROMPT = "import os\n\n\nclass FileCache:\n    def __init__(self, path):\n"


def register(sub) -> None:
    r = sub.add_parser("run", help="generate text from a prompt, streaming, then print a stats line")
    add_model_args(r)
    add_parallel_arg(r)
    add_spec_args(r)
    add_sampling_args(r)
    r.add_argument("-p", "--prompt", default=None, help="prompt text (default: a code prompt)")
    r.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--no-echo", action="store_true", help="do not print the prompt before the output")
    r.add_argument("--json-stats", default=None, help="also write the stats as JSON to this file")
    r.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    params = sampling_params(a)
    prompt = a.prompt
    if a.file:
        try:
            prompt = Path(a.file).read_text()
        except OSError as e:
            raise TurboSpecError(f"cannot read prompt file: {e}") from None
    if prompt is None:
        prompt = DEFAULT_PROMPT
    with loading() as load_bar:
        engine = build_engine(engine_config(a), load_bar)
    from turbospec.parallel import tp

    rank, ranks = tp.world()
    if ranks > 1:  # under torchrun: every rank must draw the same tokens; rank 0 alone prints
        params = tp.same_sampling(params)
    out = sys.stdout if rank == 0 else open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the command
    if not a.no_echo and not a.chat:
        out.write(prompt)
        out.flush()
    # a prefill bar for long prompts only (and on a terminal only, as every bar)
    with Progress("prefill", min_total=LONG_PROMPT, unit=" tok", leave=False) as prefill:
        for chunk in engine.stream(prompt, params, chat=a.chat, progress=prefill):
            out.write(chunk.text)
            out.flush()
    out.write("\n")
    st = engine.last_stats
    if a.json_stats:  # under torchrun every rank's own (its memory): FILE from rank 0, FILE.rankN from the others
        Path(a.json_stats + (f".rank{rank}" if rank else "")).write_text(json.dumps(st.to_dict(), indent=2))
    if rank == 0:
        print(st.line(), file=sys.stderr)
    return 0
