"""The `surge` command line."""

from __future__ import annotations

import argparse
import sys

import msgspec

from surge.config import ConfigError
from surge.config_load import add_arguments, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="surge", description="LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the server (OpenAI API on --host:--port)",
        description="Every option can also be set in the TOML file given by --config "
                    "and by a SURGE_<OPTION> environment variable; flags win.")
    add_arguments(serve)
    admin = commands.add_parser(
        "admin", help="inspect and tune a running server (local only)",
        description="get [NAME ...]: live parameters; set K=V ...: change them at the next step "
                    "(refused whole if any is invalid); stats: a summary; reload: re-read the "
                    "config file (as SIGHUP); drain: finish what is in flight, then stop (as "
                    "SIGTERM); keys add TENANT [--key KEY] | keys remove ID | keys list: the API "
                    "keys (applied by the server without a restart); top: a live view, refreshed "
                    "every second; capacity: the load, the capacity served lately and the arrival "
                    "forecast (what autoscalers read)")
    admin.add_argument("action", choices=["get", "set", "stats", "capacity", "top", "reload",
                                          "drain", "keys"])
    admin.add_argument("values", nargs="*", metavar="ARG",
                       help="get: NAMEs to show only those; set: KEY=VALUE pairs; keys: add "
                            "TENANT, remove ID or list")
    admin.add_argument("--port", type=int, default=None, help="the server's HTTP port")
    admin.add_argument("--runtime-dir", default=None, help="the server's runtime dir")
    admin.add_argument("--persist", action="store_true",
                       help="with set: also write the values into the server's config file "
                            "(refused before anything is applied if it has none)")
    admin.add_argument("--json", action="store_true",
                       help="with get, set and capacity: the reply as JSON, for scripts")
    admin.add_argument("--iterations", type=int, default=None, metavar="N",
                       help="with top: stop after N refreshes (default: until Ctrl-C)")
    admin.add_argument("--keys-file", default=None,
                       help="with keys: this file instead of the running server's")
    admin.add_argument("--key", default=None,
                       help="with keys add: store this key (16+ characters; -: read it from stdin) "
                            "instead of a new one")
    export = commands.add_parser(
        "export-tokenizer", help="write the served tokenizer as a Hugging Face folder",
        description="Writes tokenizer.json, tokenizer_config.json and the chat template of "
                    "--model (or --tokenizer) into DIR, for clients that count tokens "
                    "themselves (guidellm, genai-perf, vllm bench serve: --tokenizer DIR).")
    export.add_argument("folder", metavar="DIR")
    export.add_argument("--model", default="default", help="as for serve (default: default)")
    export.add_argument("--tokenizer", default=None, help="as for serve")
    bench = commands.add_parser(
        "bench", help="load an OpenAI-compatible server and report latency and throughput",
        description="Streams every request; reports TTFT, inter-token latency, TPOT and "
                    "end-to-end latency percentiles, tokens/s, requests/s, errors by status and "
                    "goodput under --slo-ttft/--slo-tpot. Several --concurrency or --rate "
                    "values make a sweep.")
    from surge.bench import add_arguments as bench_arguments

    bench_arguments(bench)
    return parser


def _check_model(model: str) -> None:
    """A model surge cannot find or serve is refused here, in one line, before any process
    starts (not by a traceback in a worker)."""
    from gpu_workers.families import UnsupportedModel, read_family
    from surge.model_files import ModelError, resolve_model, weight_files

    try:
        files = resolve_model(model)
        read_family(files)
        if not files.gguf_file:
            weight_files(files.folder)  # an index naming missing shards
    except (ModelError, UnsupportedModel) as e:
        raise ConfigError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    # argparse stops taking an admin command's ARGs at its first flag (`set --persist K=V`):
    # the ones after it come back here, and count as well as those before.
    if rest and args.command == "admin" and not any(a.startswith("-") for a in rest):
        args.values += rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        try:
            loaded = cfg = load_config(vars(args))
            from gpu_workers.devices import resolve

            _check_model(cfg.model.model)
            # Devices and the number of ranks are settled before any worker touches CUDA.
            cfg = msgspec.structs.replace(cfg, model=resolve(cfg.model))
            if cfg.speculative.has_draft and cfg.model.group_size > 1:
                raise ConfigError("a draft model runs with one rank only: drop --draft-model "
                                  "and --draft-layers (n-gram speculation works with any "
                                  "--tensor-parallel-size and --pipeline-parallel-size)")
            from surge.preflight import preflight

            preflight(cfg)
        except ConfigError as e:
            print(f"surge: {e}", file=sys.stderr)
            return 2
        from surge.supervisor import serve

        return serve(cfg, vars(args), loaded)
    if args.command == "export-tokenizer":
        from surge.model_files import ModelError, tokenizer_files

        try:
            files = tokenizer_files(args.model, args.tokenizer)
        except ModelError as e:
            print(f"surge: {e}", file=sys.stderr)
            return 2
        from server.tokenizer import Tokenizer

        for path in Tokenizer(files).hf.save_pretrained(args.folder):
            print(path)
        return 0
    if args.command == "bench":
        from surge.bench import run_bench

        return run_bench(args)
    if args.command == "admin":
        from surge.admin import run_admin

        return run_admin(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
