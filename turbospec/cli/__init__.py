"""The `turbospec` command line: flags -> configs -> the library. Nothing below imports this package."""

from turbospec.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
