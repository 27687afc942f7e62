"""The ``agentenv serve`` and ``agentenv keys`` verbs.

Wire into the ``agentenv`` CLI with one call: ``agentenv.server.cli.add_subcommands(subparsers)``; each
parser sets ``func`` to a callable taking the parsed args and returning an exit code. The runtime's data
directory comes from the top-level ``--home`` option (``agentenv --home DIR serve``), as for every verb.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve`` and ``keys {create,revoke,list}`` to an argparse subparsers object."""
    serve = subparsers.add_parser("serve", help="serve the E2B-compatible HTTP API on a loopback address")
    serve.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=3000, help="TCP port (default 3000; 0 picks a free one)")
    serve.add_argument("--state-dir", default=None, help="keys and sandbox registry (default <home>/server)")
    serve.add_argument("--kill-on-exit", action="store_true",
                       help="kill every sandbox on shutdown (default: keep them for the next server to adopt)")
    serve.add_argument("--create-key", metavar="NAME", default=None,
                       help="create an API key named NAME at start and print it (for tests and demos)")
    serve.add_argument("--memory-mb", type=int, default=None,
                       help="default memory limit of a new sandbox in MiB (default: agentenv.Limits)")
    serve.add_argument("--pids", type=int, default=None, help="default task limit of a new sandbox")
    serve.add_argument("--key-max-sandboxes", type=int, default=64,
                       help="live-sandbox quota of the --create-key key (0 = unlimited; default 64)")
    serve.add_argument("--exit-with-parent", action="store_true",
                       help="shut down (as on SIGTERM) when the process that started the server dies")
    serve.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level (default INFO)")
    serve.set_defaults(func=cmd_serve)

    keys = subparsers.add_parser("keys", help="manage API keys of `agentenv serve`")
    keys.add_argument("--state-dir", default=None, help="where keys.json lives (default <home>/server)")
    sub = keys.add_subparsers(dest="keys_cmd", required=True)
    create = sub.add_parser("create", help="create a key (printed once)")
    create.add_argument("name", help="a name for the key's owner")
    create.add_argument("--max-sandboxes", type=int, default=64, help="live sandboxes (0 = unlimited)")
    create.add_argument("--max-cpus", type=float, default=0, help="CPU cores over live sandboxes (0 = unlimited)")
    create.add_argument("--max-memory-mb", type=int, default=0, help="MiB over live sandboxes (0 = unlimited)")
    create.set_defaults(func=cmd_keys_create)
    revoke = sub.add_parser("revoke", help="revoke a key by id (key-...) or by the key itself")
    revoke.add_argument("key", help="key id (key-...) or the key")
    revoke.set_defaults(func=cmd_keys_revoke)
    sub.add_parser("list", help="list keys (ids, names, quotas; never the keys)").set_defaults(func=cmd_keys_list)


def _state_dir(args):
    from pathlib import Path

    from agentenv.server.app import default_state_dir

    return Path(args.state_dir) if args.state_dir else default_state_dir(getattr(args, "home", None))


def cmd_serve(args: argparse.Namespace) -> int:
    from agentenv.server.app import Server

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from agentenv.limits import Limits
    from agentenv.server.auth import Quota

    limits = Limits(**{k: v for k, v in (("memory_mb", args.memory_mb), ("pids", args.pids)) if v is not None})
    server = Server(args.host, args.port, state_dir=args.state_dir, home=getattr(args, "home", None), limits=limits)
    if args.create_key:
        key, info = server.keys.create(args.create_key, Quota(max_sandboxes=args.key_max_sandboxes))
        print(json.dumps({"api_key": key, "key_id": info.id}), flush=True)
    rec = server.recovered
    print(json.dumps({"url": server.url, "adopted": rec["adopted"], "gone": rec["gone"],
                      "unrecorded": rec.get("unrecorded", [])}), flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    if args.exit_with_parent:
        _watch_parent()
    try:
        server.registry.start_reaper()
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
        server.registry.stop(kill_all=args.kill_on_exit)
    return 0


def _watch_parent() -> None:
    """SIGTERM ourselves once our parent is gone (a test runner or benchmark killed without clean-up)."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="agentenv-parent-watch", daemon=True).start()


def cmd_keys_create(args: argparse.Namespace) -> int:
    from agentenv.server.auth import KeyStore, Quota

    key, info = KeyStore(_state_dir(args)).create(
        args.name, Quota(args.max_sandboxes, args.max_cpus, args.max_memory_mb))
    print(json.dumps({"api_key": key, "key_id": info.id, "name": info.name, "quota": info.quota.__dict__}))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from agentenv.server.auth import KeyStore

    try:
        info = KeyStore(_state_dir(args)).revoke(args.key)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    print(json.dumps({"revoked": info.id, "name": info.name}))
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from agentenv.server.auth import KeyStore

    for info in KeyStore(_state_dir(args)).list():
        print(json.dumps({"key_id": info.id, "name": info.name, "revoked": info.revoked,
                          "quota": info.quota.__dict__}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m agentenv.server [--home DIR] {serve,keys} ...`` (``serve`` when no arguments are given)."""
    parser = argparse.ArgumentParser(prog="agentenv")
    parser.add_argument("--home", default=None, help="runtime data directory (default $AGENTENV_HOME)")
    add_subcommands(parser.add_subparsers(dest="cmd", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv or ["serve"])
    return args.func(args)
