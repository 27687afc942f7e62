"""The `k3infra` command: `demo`, `bench <component>`, `info`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from k3infra import __version__
from k3infra.components import COMPONENTS, by_name, probe
from k3infra.demos import DemoRow

BENCH_NAMES = ("kda", "ep", "env", "train", "smoke")


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


def cmd_info(_: argparse.Namespace) -> int:
    print(f"k3-infra {__version__}  python {platform.python_version()}  {platform.platform()}")
    rows = []
    for name in ("torch", "triton", "fla", "einops"):
        if importlib.util.find_spec(name) is None:
            rows.append([name, "not installed"])
            continue
        try:
            module = importlib.import_module(name)
            rows.append([name, getattr(module, "__version__", "unknown")])
        except Exception as error:  # report, do not crash: info is a diagnostic
            rows.append([name, f"import failed: {error}"])
    _print_table(["package", "version"], rows)
    print()
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                print(f"cuda:{i}  {p.name}  {p.total_memory / 2**30:.0f} GiB  {p.multi_processor_count} SMs")
        else:
            print("devices: cpu only (no CUDA device visible)")
    else:
        print("devices: cpu only (torch not installed)")
    print()
    rows = []
    for component in COMPONENTS:
        usable, detail = probe(component)
        rows.append([component.name, component.package, "yes" if usable else "no", detail])
    _print_table(["component", "package", "usable", "detail"], rows)
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
    if args.component not in BENCH_NAMES:
        raise SystemExit(f"k3infra bench: unknown component {args.component!r}; expected one of {BENCH_NAMES}")
    if args.component != "smoke":
        usable, detail = probe(by_name(args.component))
        if not usable:
            raise SystemExit(f"k3infra bench {args.component}: component unusable here: {detail}")
    root = repo_root()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), str(root / "src"), env.get("PYTHONPATH")]))
    module = f"benchmarks.{args.component}.run"
    if not (root / "benchmarks" / args.component / "run.py").is_file():
        raise SystemExit(f"k3infra bench {args.component}: no benchmark exists yet for this component")
    return subprocess.call([sys.executable, "-m", module, *args.rest], cwd=root, env=env)


def cmd_kda_dispatch(args: argparse.Namespace) -> int:
    from flashkda.dispatch import dispatch_report

    print(dispatch_report(args.arch))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3infra", description=__doc__)
    parser.add_argument("--version", action="version", version=f"k3-infra {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run every component that exists here and print a summary table").set_defaults(
        func=cmd_demo
    )
    sub.add_parser("info", help="versions, devices and which optional parts are usable").set_defaults(func=cmd_info)
    bench = sub.add_parser("bench", help="run a component's benchmark (baseline and ours in one run)")
    bench.add_argument("component", help=f"one of {', '.join(BENCH_NAMES)}")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark runner")
    bench.set_defaults(func=cmd_bench)
    kda = sub.add_parser("kda", help="FlashKDA tools").add_subparsers(dest="kda_command", required=True)
    dispatch = kda.add_parser("dispatch", help="which backend serves fla's chunk_kda per common shape, and why")
    dispatch.add_argument("--arch", default=None,
                          help="GPU architecture to report on, e.g. sm_90 (default: this machine's GPU, else sm_90)")
    dispatch.set_defaults(func=cmd_kda_dispatch)
    importlib.import_module("k3infra.train.cli").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
