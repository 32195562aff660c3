"""The `surge` command line."""

from __future__ import annotations

import argparse
import sys

from surge.config import ConfigError, add_arguments, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="surge", description="LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the server (OpenAI API on --host:--port)",
        description="Every option can also be set in the TOML file given by --config "
                    "and by a SURGE_<OPTION> environment variable; flags win.")
    add_arguments(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        try:
            cfg = load_config(vars(args))
        except ConfigError as e:
            print(f"surge: {e}", file=sys.stderr)
            return 2
        from surge.supervisor import serve

        return serve(cfg)
    return 2


if __name__ == "__main__":
    sys.exit(main())
