"""Command line of the site builder: ``build`` the site, ``record`` an edition from a GPU run, ``check`` a built site."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from website.build import build
from website.check import main as check_main
from website.editions import EDITIONS_DIR, record

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command."""
    parser = argparse.ArgumentParser(prog="python -m website", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("build", help="build the site into build/site/html")
    make.add_argument("--chapters", nargs="+", default=[], metavar="CHAPTER", help="only these chapters (folder names)")
    make.add_argument("--cpu-from", type=Path, help="reuse this benchmarks.notebooks run as the CPU edition")
    make.add_argument("--h200-from", type=Path, help=f"the H200 record to use (default {EDITIONS_DIR / 'h200'})")
    make.add_argument("--allow-missing-h200", action="store_true", help="a draft: build without (all of) the H200 edition")
    make.add_argument("--jobs", type=int, default=2, help="Sphinx's parallel processes")

    rec = commands.add_parser("record", help="write an edition record from a benchmarks.notebooks run")
    rec.add_argument("--executed", type=Path, nargs="+", required=True,
                     help="the --out folder(s) of python -m benchmarks.notebooks (runs side by side on one machine)")
    rec.add_argument("--edition", default="h200", help="the edition's key (default h200)")
    rec.add_argument("--machine", required=True, help='what ran it, in words (e.g. "Lambda 1x H200 SXM")')
    rec.add_argument("--out", type=Path, help="where to write it (default website/editions/<edition>)")

    commands.add_parser("check", add_help=False, help="check a built site (python -m website check --help)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        return check_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.chapters, args.cpu_from, args.h200_from, args.allow_missing_h200, args.jobs)
    else:
        out = record(args.executed, args.out or EDITIONS_DIR / args.edition, args.machine, args.edition)
        print(f"wrote {out}: commit it with the site (it holds no solutions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
