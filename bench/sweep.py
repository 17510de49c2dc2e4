"""The fault sweep: bad inputs and faults tried as users and operators meet them, each outcome classified.

Every case runs real processes (a script, ``autopar launch``, ``msrun``, the CLI) in a fresh directory, with the
short timeouts of the ``AUTOPAR_*_TIMEOUT`` variables, and is classified from what the user sees and what is left:

- ``clear error``  non-zero exit with one ``error:`` line, no traceback, within the case's time bound
- ``warned``       a bad input accepted with a warning (the flags autopar cannot honour)
- ``held``         a fault the job survives as promised (resume exact, nothing left, one world formed)
- ``vague``        one error line, but it does not name what the case needs named (the file, the tensor and both
                   shapes, the missing rank, the operation)
- ``traceback``    a Python traceback, a C++ stack dump, ``terminate called``, SIGABRT, or a failure with no error line
- ``hang``         still running at the case's time bound (killed then), or slower than it promised
- ``accepted``     a bad input that ran as if it were fine
- ``lost``         progress or data silently lost or mixed (checkpoints)
- ``left behind``  a process of the case still alive after it ended

    python bench/sweep.py [--only CATEGORY ...] [--src SRC_DIR] [--json OUT] [--list]

``--src`` runs the cases against another tree (e.g. an older commit's ``src``); cases of features that tree lacks
(``new=True``) are skipped there. Counts by outcome are printed; the JSON holds every case with its outcome,
seconds and the last lines it printed.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported: the siblings resolve

import sweep_cases  # noqa: F401 - registers the cases
from sweep_core import CASES, OUTCOMES, ROOT, run_case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="categories (or case names) to run")
    ap.add_argument("--src", default=str(ROOT / "src"), help="the autopar tree to test")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    src = Path(args.src).resolve()
    older = src != (ROOT / "src").resolve()
    cases = [c for c in CASES if args.only is None or c.category in args.only or c.name in args.only]
    if args.list:
        for c in cases:
            print(f"{c.category:12} {c.name}")
        return 0
    results = []
    for i, c in enumerate(cases, 1):
        if older and c.new:
            continue
        r = run_case(c, src)
        results.append(r)
        print(f"[{i:3}/{len(cases)}] {c.category:12} {r['outcome']:12} {r['seconds']:6.1f}s  {c.name}"
              + (f"  ({r['note']})" if r["note"] else ""), flush=True)
    counts = Counter(r["outcome"] for r in results)
    print("\noutcomes: " + ", ".join(f"{o}: {counts[o]}" for o in OUTCOMES if counts[o]) + f" (of {len(results)})")
    by_cat: dict[str, Counter] = {}
    for r in results:
        by_cat.setdefault(r["category"], Counter())[r["outcome"]] += 1
    for cat, cnt in by_cat.items():
        print(f"  {cat:12} " + ", ".join(f"{o}: {cnt[o]}" for o in OUTCOMES if cnt[o]))
    if args.json:
        Path(args.json).write_text(json.dumps({"src": str(src), "counts": dict(counts),
                                               "by_category": {k: dict(v) for k, v in by_cat.items()},
                                               "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
