"""The `loraplex` command line: argument parsing (main), the commands, the demo setup."""
from loraplex.platform.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
