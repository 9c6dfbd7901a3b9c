"""`turbospec export-gguf MODEL OUT.gguf`: a checkpoint directory as a llama.cpp GGUF file."""

from __future__ import annotations

import argparse

from turbospec.engine import model_path
from turbospec.lab.progress import Progress


def register(sub) -> None:
    p = sub.add_parser("export-gguf", help="write a checkpoint (dense, Qwen3-MoE, Qwen3.5 or Qwen3.5-MoE, MTP "
                                           "included) as a llama.cpp GGUF file")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--type", default="f16", help="matrix type: f32, f16, bf16, q8_0, q4_0, q4_k (default f16)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)


def cmd_export(a: argparse.Namespace) -> int:
    from turbospec.model.gguf_export import export_gguf

    with Progress("export", quiet=a.quiet, unit=" tensors", leave=False) as progress:
        out = export_gguf(model_path(a.model), a.out, a.type.lower(), progress)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0
