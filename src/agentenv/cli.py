"""The `agentenv` command: create | exec | fork | snapshot | restore | ls | rm | gc | image (| serve | keys).

State lives in the data directory (`--home`, default `$AGENTENV_HOME` or /var/lib/agentenv) and in the
sandboxes' tool servers, so every invocation is independent: `agentenv create` prints an id that later
`agentenv exec ID -- CMD` calls use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from agentenv import __version__, errors


def _backend(args: argparse.Namespace):
    from agentenv.runtime.local import NamespaceBackend

    return NamespaceBackend(args.home)


def _limits(args: argparse.Namespace):
    from agentenv.limits import Limits, Network

    return Limits(memory_mb=args.memory_mb, pids=args.pids, cpus=args.cpus, disk_mb=args.disk_mb,
                  disk_in_memory=args.disk_in_memory, network=Network(allow=tuple(args.allow)))


def cmd_create(args: argparse.Namespace) -> int:
    print(_backend(args).create(args.source, _limits(args), ttl_s=args.ttl))
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    from agentenv.sandbox import Sandbox

    argv = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not argv:
        raise SystemExit("agentenv exec: give a command after the sandbox id (agentenv exec ID -- CMD ...)")
    sb = Sandbox.connect(args.id, backend=_backend(args))
    cmd: str | list[str] = argv[0] if len(argv) == 1 else argv
    result = sb.exec(cmd, timeout=args.timeout, cwd=args.cwd,
                     on_stdout=lambda s: sys.stdout.write(s), on_stderr=lambda s: sys.stderr.write(s))
    sys.stdout.flush()
    return result.exit_code


def cmd_fork(args: argparse.Namespace) -> int:
    for sid in _backend(args).fork(args.id, args.n, ttl_s=args.ttl):
        print(sid)
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    print(_backend(args).snapshot(args.id))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    print(_backend(args).restore(args.id, ttl_s=args.ttl))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    infos = [i for i in _backend(args).list() if args.all or i.kind in ("sandbox", "snapshot")]
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=1))
        return 0
    print(f"{'ID':<20} {'KIND':<9} {'IMAGE':<10} {'PID':>8} {'AGE s':>8} {'PARENT':<20} ALIVE")
    now = time.time()
    for i in infos:
        print(f"{i.id:<20} {i.kind:<9} {i.image:<10} {i.pid:>8} {now - i.created:>8.0f} {i.parent or '-':<20} "
              f"{'yes' if i.alive else 'no'}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    backend = _backend(args)
    ids = [i.id for i in backend.list() if i.kind in ("sandbox", "snapshot")] if args.all else args.ids
    status = 0
    for sid in ids:
        try:
            backend.destroy(sid)
        except errors.SandboxNotFoundError as e:
            print(f"agentenv rm: {e}", file=sys.stderr)
            status = 1
    return status


def cmd_gc(args: argparse.Namespace) -> int:
    removed = _backend(args).gc(everything=args.all)
    print(json.dumps(removed) if args.json else " ".join(f"{k}={v}" for k, v in removed.items()))
    return 0


def cmd_image(args: argparse.Namespace) -> int:
    backend = _backend(args)
    store = backend.store
    if args.image_cmd == "ls":
        for name in store.image_names():
            manifest = store.load_image(name) or {}
            kind = "template" if manifest.get("template") else "image"
            print(f"{name:<20} {kind:<9} layers={len(manifest.get('layers', []))} usr_bind={manifest.get('usr_bind')}")
        return 0
    if args.image_cmd == "build":
        with _status(f"building image {args.name}"):
            manifest = _build_image(args, store)
        print(f"{args.name}: layers {', '.join(manifest['layers'])}")
        return 0
    if args.image_cmd == "template":
        with _status(f"building template {args.name}"):
            snap = backend.template(args.name, args.image, args.run, timeout_s=args.timeout)
        print(f"{args.name}: template snapshot {snap}")
        return 0
    raise SystemExit("agentenv image: expected build, ls or template")


def _status(message: str):
    """A spinner on stderr while a step of unknown length runs (nothing when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


def _build_image(args: argparse.Namespace, store) -> dict:
    from agentenv.runtime import images

    if args.host:
        return images.build_host(store, args.name)
    if args.debootstrap:
        return images.build_debootstrap(store, args.name, args.suite)
    if args.source:
        return images.build_from_path(store, args.name, Path(args.source), usr_bind=args.usr_bind)
    raise SystemExit("agentenv image build: give --from PATH, --host or --debootstrap")


def cmd_view(args: argparse.Namespace) -> int:
    from agentenv.posttrain.view import write_view

    print(write_view(args.run_dir, args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentenv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=None, help="data directory (default $AGENTENV_HOME or /var/lib/agentenv)")
    parser.add_argument("--version", action="version", version=f"k3-infra {__version__}", help="print the version")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_limits(p: argparse.ArgumentParser) -> None:
        p.add_argument("--memory-mb", type=int, default=512, help="memory limit in MiB (default 512)")
        p.add_argument("--pids", type=int, default=256, help="task (process and thread) limit (default 256)")
        p.add_argument("--cpus", type=float, default=1.0, help="CPU cores, fractional allowed (default 1.0)")
        p.add_argument("--disk-mb", type=int, default=1024, help="size of the writable layer in MiB (default 1024)")
        p.add_argument("--disk-in-memory", action="store_true",
                       help="writable layer in RAM (tmpfs, counted against --memory-mb) instead of on disk")
        p.add_argument("--allow", action="append", default=[], metavar="CIDR[:PORT]",
                       help="opt into egress to this IPv4 destination (repeatable; default: loopback only)")

    p = sub.add_parser("create", help="start a sandbox from an image, template or snapshot; prints its id")
    p.add_argument("source", nargs="?", default="host",
                   help="image name, template name or snapshot id (snap-...); default host")
    p.add_argument("--ttl", type=float, default=None, help="seconds until it stops by itself")
    with_limits(p)
    p.set_defaults(func=cmd_create)
    p = sub.add_parser("exec", help="run a command in a sandbox (streams output, exits with its code)")
    p.add_argument("id", help="sandbox id (sb-...)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the command is killed (default none)")
    p.add_argument("--cwd", default=None, help="working directory inside the sandbox (default /root)")
    p.set_defaults(func=cmd_exec)
    p = sub.add_parser("fork", help="fork a sandbox into N live copies; prints their ids")
    p.add_argument("id", help="sandbox id to fork")
    p.add_argument("-n", type=int, default=1, help="number of copies (default 1)")
    p.add_argument("--ttl", type=float, default=None, help="seconds until each copy stops by itself")
    p.set_defaults(func=cmd_fork)
    p = sub.add_parser("snapshot", help="snapshot a sandbox; prints the snapshot id")
    p.add_argument("id", help="sandbox id to snapshot")
    p.set_defaults(func=cmd_snapshot)
    p = sub.add_parser("restore", help="start a sandbox from a snapshot; prints its id")
    p.add_argument("id", help="snapshot id (snap-...)")
    p.add_argument("--ttl", type=float, default=None, help="seconds until the sandbox stops by itself")
    p.set_defaults(func=cmd_restore)
    p = sub.add_parser("ls", help="list sandboxes and snapshots")
    p.add_argument("--all", action="store_true", help="also seeds and retired tool servers")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("rm", help="destroy sandboxes or snapshots")
    p.add_argument("ids", nargs="*", help="sandbox or snapshot ids")
    p.add_argument("--all", action="store_true", help="every sandbox and snapshot")
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("gc", help="reclaim what dead or expired sandboxes left (--all: stop everything)")
    p.add_argument("--all", action="store_true", help="also stop every live sandbox, snapshot and seed")
    p.add_argument("--json", action="store_true", help="print what was reclaimed as one JSON object")
    p.set_defaults(func=cmd_gc)
    p = sub.add_parser("image", help="build and list images and templates")
    isub = p.add_subparsers(dest="image_cmd", required=True)
    b = isub.add_parser("build", help="build an image")
    b.add_argument("name", help="image name")
    b.add_argument("--from", dest="source", help="a directory or tarball")
    b.add_argument("--host", action="store_true", help="the host's /usr read-only under a generated root")
    b.add_argument("--debootstrap", action="store_true", help="a Debian minbase (needs debootstrap and a mirror)")
    b.add_argument("--suite", default="bookworm", help="Debian suite for --debootstrap (default bookworm)")
    b.add_argument("--usr-bind", action="store_true", help="also bind the host's /usr read-only")
    isub.add_parser("ls", help="list images and templates")
    t = isub.add_parser("template", help="an image plus setup commands, sealed as a snapshot")
    t.add_argument("name", help="template name")
    t.add_argument("--image", default="host", help="image the template starts from (default host)")
    t.add_argument("--run", action="append", default=[], help="a setup command (repeatable)")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds per setup command (default 600)")
    p.set_defaults(func=cmd_image)
    p = sub.add_parser("view", help="write a self-contained HTML page of a post-training run directory")
    p.add_argument("run_dir", help="a post-training run directory")
    p.add_argument("-o", "--out", default=None, help="output file (default RUN_DIR/view.html)")
    p.set_defaults(func=cmd_view)
    from agentenv.server.cli import add_subcommands  # `serve` and `keys`: the E2B-compatible HTTP server

    add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # the commands' own `raise SystemExit("message")`
        if isinstance(e.code, str):
            print(f"agentenv {args.command}: {e.code}", file=sys.stderr)
            return 2
        raise
    except Exception as e:
        if args.debug:
            raise
        message = " | ".join(line for line in str(e).splitlines() if line.strip()) or type(e).__name__
        print(f"agentenv {args.command}: {message} (--debug shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
