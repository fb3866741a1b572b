"""Repeated code in the tracked Python files: pairs of places that share 6 or more lines.

A line is compared as text with its white space folded; blank lines, comments and import
lines (a parenthesised import's lines too) are passed over, so a run may span them. A pair
is two places (in one file or two) whose runs of at least `--min-lines` such lines are the
same; a longer shared run is still one pair. Exits 1 when there are more pairs than
`--budget` (`make lint` runs it), printing each pair, longest first. Standard library only.

    python scripts/check_duplicates.py [--budget 20] [--min-lines 6] [--list]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 20
MIN_LINES = 6
# the same lines in several places are boilerplate, not a copy to take out (a `)` alone, ...)
TOO_COMMON = 8


def code_lines(text: str) -> list[tuple[int, str]]:
    """`(line number, folded text)` of every line that counts."""
    kept: list[tuple[int, str]] = []
    in_import = False
    for number, raw in enumerate(text.splitlines(), 1):
        line = " ".join(raw.split())
        if in_import:
            in_import = ")" not in line
            continue
        if not line or line.startswith("#"):
            continue
        if re.match(r"(from\s+\S+\s+)?import\s", line):
            in_import = "(" in line and ")" not in line
            continue
        if len(line) <= 2 and not line[:1].isalnum():
            continue  # lone punctuation: `)`, `]`, `):`
        kept.append((number, line))
    return kept


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def duplicate_pairs(files: dict[str, list[tuple[int, str]]], min_lines: int) -> list[tuple]:
    """`(shared lines, (file, first, last), (file, first, last))` for each maximal run that
    two places share, longest first."""
    places: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in files.items():
        texts = [t for _, t in lines]
        for i in range(len(texts) - min_lines + 1):
            places[tuple(texts[i : i + min_lines])].append((name, i))
    starts: set[tuple[str, int, str, int]] = set()
    for where in places.values():
        if len(where) < 2 or len(where) > TOO_COMMON:
            continue
        for x in range(len(where)):
            for y in range(x + 1, len(where)):
                (fa, a), (fb, b) = where[x], where[y]
                if fa == fb and abs(a - b) < min_lines:
                    continue  # a run overlapping itself (a repeated line)
                starts.add((fa, a, fb, b))
    pairs = []
    for fa, a, fb, b in starts:
        if (fa, a - 1, fb, b - 1) in starts:
            continue  # not where the shared run begins
        la, lb = files[fa], files[fb]
        n = min_lines
        while a + n < len(la) and b + n < len(lb) and la[a + n][1] == lb[b + n][1]:
            if fa == fb and a + n >= b:
                break
            n += 1
        pairs.append((n, (fa, la[a][0], la[a + n - 1][0]), (fb, lb[b][0], lb[b + n - 1][0])))
    # pairs of places that a longer run already joins are one duplicate, not several
    best: dict[tuple[str, int, str, int], tuple] = {}
    for pair in pairs:
        key = (pair[1][0], pair[1][1], pair[2][0], pair[2][1])
        best[key] = max(best.get(key, pair), pair)
    return sorted(best.values(), key=lambda p: (-p[0], p[1], p[2]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=BUDGET)
    parser.add_argument("--min-lines", type=int, default=MIN_LINES)
    parser.add_argument("--list", action="store_true", help="print every pair, within budget too")
    args = parser.parse_args(argv)
    files = {
        path.relative_to(ROOT).as_posix(): code_lines(path.read_text(errors="replace"))
        for path in tracked_files()
    }
    pairs = duplicate_pairs(files, args.min_lines)
    over = len(pairs) > args.budget
    print(f"duplicates: {len(pairs)} pairs of places share {args.min_lines}+ lines "
          f"in {len(files)} files (budget {args.budget})")  # fmt: skip
    if over or args.list:
        for n, (fa, a1, a2), (fb, b1, b2) in pairs:
            print(f"  {n:3d} lines  {fa}:{a1}-{a2} ~ {fb}:{b1}-{b2}")
    if over:
        print("over budget: take the repeated code into one place it is used from")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
