#!/usr/bin/env python
"""Speed benchmarks, the one entry point. Each ``scripts/benchmarks/bench_*.py`` module defines
``BENCHMARKS = {name: fn}`` where ``fn(quick: bool) -> dict`` runs one benchmark (baseline and
optimised side by side in the same process) and returns its figures.

    python scripts/benchmark.py                      # all benchmarks, human-readable
    python scripts/benchmark.py --only sat_train --json
    python scripts/benchmark.py --quick              # smaller sizes, a smoke run

Absolute times on shared machines are noisy: compare the ratios measured in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def discover() -> dict:
    found = {}
    for path in sorted((HERE / "benchmarks").glob("bench_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        found.update(getattr(mod, "BENCHMARKS", {}))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run just this benchmark (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object {name: figures}")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--list", action="store_true", help="list benchmark names")
    args = parser.parse_args(argv)
    benches = discover()
    if args.list:
        print("\n".join(sorted(benches)))
        return 0
    unknown = [n for n in args.only if n not in benches]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(sorted(benches))}", file=sys.stderr)
        return 2
    results = {}
    for name in args.only or sorted(benches):
        t0 = time.perf_counter()
        results[name] = benches[name](args.quick)
        if not args.json:
            figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in results[name].items())
            print(f"{name}: {figures}  ({time.perf_counter() - t0:.1f}s)", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
