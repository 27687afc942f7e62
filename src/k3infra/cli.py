"""The `k3infra` command: `info`, `demo`, `bench NAME` (one runner per component), `kda dispatch`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from k3infra import __version__
from k3infra.components import COMPONENTS, by_name, probe
from k3infra.demos import DemoRow

BENCHES: dict[str, tuple[str, str | None]] = {
    # name: (runner module, component that must be usable here)
    "kda": ("benchmarks.kda.run", "kda"),
    "ep": ("benchmarks.ep.run", "ep"),
    "env": ("benchmarks.env.run", "env"),
    "rl": ("benchmarks.env.rl", "env"),
    "train": ("benchmarks.train.run", "train"),
    "smoke": ("benchmarks.smoke.run", None),
}
BENCH_NAMES = tuple(BENCHES)


class UsageError(Exception):
    """A command was called wrongly or cannot run here; printed as one line, exit code 2."""


def _device() -> str:
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)))


def info_facts() -> dict:
    """Versions, devices and components of this machine, as `k3infra info` prints them."""
    facts: dict = {"k3-infra": __version__, "python": platform.python_version(), "platform": platform.platform(),
                   "packages": {}, "devices": [], "components": []}
    for name in ("torch", "triton", "fla", "einops"):
        if importlib.util.find_spec(name) is None:
            facts["packages"][name] = None
            continue
        try:
            module = importlib.import_module(name)
            facts["packages"][name] = getattr(module, "__version__", "unknown")
        except Exception as error:  # report, do not crash: info is a diagnostic
            facts["packages"][name] = f"import failed: {error}"
    if importlib.util.find_spec("torch") is not None:
        import torch

        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            p = torch.cuda.get_device_properties(i)
            facts["devices"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30),
                                     "sms": p.multi_processor_count})
    for component in COMPONENTS:
        usable, detail = probe(component)
        facts["components"].append({"name": component.name, "package": component.package, "usable": usable,
                                    "detail": detail})
    return facts


def cmd_info(args: argparse.Namespace) -> int:
    facts = info_facts()
    if args.json:
        print(json.dumps(facts, indent=1))
        return 0
    print(f"k3-infra {facts['k3-infra']}  python {facts['python']}  {facts['platform']}")
    _print_table(["package", "version"], [[k, v or "not installed"] for k, v in facts["packages"].items()])
    print()
    for d in facts["devices"]:
        print(f"cuda:{d['index']}  {d['name']}  {d['memory_gib']} GiB  {d['sms']} SMs")
    if not facts["devices"]:
        print("devices: cpu only (no CUDA device visible)")
    print()
    _print_table(["component", "package", "usable", "detail"],
                 [[c["name"], c["package"], "yes" if c["usable"] else "no", c["detail"]] for c in facts["components"]])
    return 0


def cmd_demo(_: argparse.Namespace) -> int:
    device = _device()
    if device == "cpu":
        # Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before kernels are defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"k3infra demo on {device}")
    rows: list[DemoRow] = []
    for component in COMPONENTS:
        if importlib.util.find_spec(f"k3infra.demos.{component.name}") is None:
            rows.append(DemoRow(component.name, "-", "not built yet: no demo exists for this component", True))
            continue
        usable, detail = probe(component)
        if not usable:
            rows.append(DemoRow(component.name, "-", f"skipped: {detail}", True))
            continue
        demo = importlib.import_module(f"k3infra.demos.{component.name}")
        start = time.perf_counter()
        try:
            with _status(f"demo {component.name}"):
                rows.extend(demo.run(device))
        except Exception as error:  # one broken component must not hide the others' results
            rows.append(DemoRow(component.name, "demo", f"FAILED: {type(error).__name__}: {error}", False))
        print(f"  {component.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    failed = any(not r.ok for r in rows)
    print()
    _print_table(
        ["component", "check", "result", "ok"],
        [[r.component, r.check, r.result, "yes" if r.ok else "NO"] for r in rows],
    )
    return 1 if failed else 0


def _status(message: str):
    """A spinner on stderr while a step runs (nothing when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


def repo_root() -> Path:
    """The checkout that holds `benchmarks/` (benchmarks are not part of the installed package)."""
    candidates = [Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[2]]
    for candidate in candidates:
        if (candidate / "benchmarks" / "harness.py").is_file():
            return candidate
    raise FileNotFoundError(
        "benchmarks/ not found: run `k3infra bench` from a k3-infra source checkout (benchmarks are not installed)"
    )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.component not in BENCHES:
        raise UsageError(f"unknown benchmark {args.component!r}; expected one of {', '.join(BENCHES)}")
    module, needs = BENCHES[args.component]
    if needs is not None:
        usable, detail = probe(by_name(needs))
        if not usable:
            raise UsageError(f"{args.component}: component unusable here: {detail}")
    root = repo_root()
    results_dir = Path(args.results_dir).resolve() if args.results_dir else root / "benchmarks" / "results"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), str(root / "src"), env.get("PYTHONPATH")]))
    env["K3INFRA_RESULTS_DIR"] = str(results_dir)
    if args.quiet or args.json:
        env["K3INFRA_QUIET"] = "1"  # the runners' progress bars (benchmarks.progress) stay off
    before = _results(results_dir)
    # With --json, stdout carries only the JSON: the runner's own lines go to stderr.
    status = subprocess.call([sys.executable, "-m", module, *args.rest], cwd=root, env=env,
                             stdout=sys.stderr if args.json else None)
    written = sorted(set(_results(results_dir)) - set(before))
    if status == 0 and args.update_table:
        if not written:
            raise UsageError(f"{args.component}: --update-table, but the run wrote no results file")
        table = [sys.executable, "-m", "benchmarks.table", *map(str, written)]
        status = subprocess.call(table, cwd=root, env=env, stdout=sys.stderr if args.json else None)
    if args.json:
        print(json.dumps([{"file": str(p), **json.loads(p.read_text())} for p in written], indent=1))
    elif not args.quiet:
        for path in written:
            print(f"results: {path}")
    return status


def _results(results_dir: Path) -> list[Path]:
    return sorted(results_dir.glob("*.json")) if results_dir.is_dir() else []


def cmd_kda_dispatch(args: argparse.Namespace) -> int:
    from flashkda.dispatch import dispatch_report, report_rows

    if args.json:
        print(json.dumps([{"shape": r.shape.label(), "served_by": r.backend, "reason": r.decision.reason}
                          for r in report_rows(args.arch, device=args.device)], indent=1))
    else:
        print(dispatch_report(args.arch, device=args.device))
    return 0


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark: baseline and ours in one run, results as JSON",
                           description="Run a benchmark runner (benchmarks/<component>/run.py) with the arguments "
                           "after the name; results go to benchmarks/results/*.json. BENCHMARKS.md changes only "
                           "with --update-table. See benchmarks/README.md.")
    bench.add_argument("component", help=f"which benchmark: {', '.join(BENCHES)}")
    bench.add_argument("--update-table", action="store_true",
                       help="after a successful run, regenerate this benchmark's BENCHMARKS.md section and chart "
                       "from the results files the run wrote")
    bench.add_argument("--results-dir", default=None, help="where results JSON goes (default benchmarks/results)")
    bench.add_argument("--quiet", action="store_true", help="no progress bars, no result paths")
    bench.add_argument("--json", action="store_true", help="print the results files' content as JSON on stdout")
    bench.add_argument("rest", nargs="*", metavar="RUNNER_ARGS",
                       help="arguments for the runner (after --, or any option k3infra does not know; see "
                       "`python -m benchmarks.<name>.run --help`)")
    bench.set_defaults(func=cmd_bench)


def _add_kda(sub) -> None:
    kda = sub.add_parser("kda", help="FlashKDA tools").add_subparsers(dest="kda_command", required=True)
    dispatch = kda.add_parser("dispatch", help="which backend serves fla's chunk_kda per common shape, and why")
    dispatch.add_argument("--arch", default=None,
                          help="GPU architecture to report on, e.g. sm_90 (default: this machine's GPU, else sm_90)")
    dispatch.add_argument("--device", default=None,
                          help="GPU name whose own calibration table to use when one is shipped, e.g. "
                               "'NVIDIA H100 80GB HBM3' (default: this machine's GPU; else the architecture's table)")
    dispatch.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    dispatch.set_defaults(func=cmd_kda_dispatch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3infra", description=__doc__)
    parser.add_argument("--version", action="version", version=f"k3-infra {__version__}", help="print the version")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run every component that exists here and print a summary table").set_defaults(
        func=cmd_demo
    )
    info = sub.add_parser("info", help="versions, devices and which optional parts are usable")
    info.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
    info.set_defaults(func=cmd_info)
    _add_bench(sub)
    _add_kda(sub)
    from k3infra.plan.cli import add_plan_parser

    add_plan_parser(sub)
    importlib.import_module("k3infra.train.cli").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bench":  # the runner's own options, in the order given
        args.rest = [*unknown, *args.rest]
        if "--" in args.rest:
            args.rest.remove("--")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        message = " | ".join(line for line in str(e).splitlines() if line.strip()) or type(e).__name__
        hint = "" if isinstance(e, UsageError) else " (--debug shows the traceback)"
        print(f"k3infra {args.command}: {message}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
