"""Every distributed chapter's self-check as one multi-node torchrun job per chapter.

    python -m benchmarks.checks --nnodes 2 --nproc-per-node 1 --small     # two "nodes" on this host (CPU, gloo)
    python -m benchmarks.checks --nnodes 1 --nproc-per-node 4             # one node of 4 GPUs (NCCL)

Each chapter's entry runs under ``nnodes`` torchrun agents started on this host, which find each
other at a c10d rendezvous on the loopback, the way the agents of a cluster's nodes do over the
network (``course_lib.support.torchrun.run_entry``). One line per chapter: its checks, the ranks
and the time the job took; the exit status is 1 when any chapter failed. On a real cluster, start
one agent per node yourself (docs/multi-node.md has the torchrun and SLURM commands).
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.checks import CHAPTERS
from course_lib.support.torchrun import run_entry


def main(argv: list[str] | None = None) -> int:
    """Run the chosen chapters' entries as multi-node jobs; print a line each; 0 when all passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nnodes", type=int, default=2, help="torchrun agents (\"nodes\") on this host (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for gloo ranks on a CPU")
    parser.add_argument("--only", nargs="+", choices=CHAPTERS, default=list(CHAPTERS), metavar="CHAPTER",
                        help=f"some chapters only: {', '.join(CHAPTERS)}")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per chapter (default 600)")
    args = parser.parse_args(argv)
    world = args.nnodes * args.nproc_per_node
    print(f"{args.nnodes} node(s) x {args.nproc_per_node} rank(s) = {world} ranks, c10d rendezvous on 127.0.0.1")
    failed = []
    for chapter in args.only:
        start = time.perf_counter()
        try:
            run = run_entry(f"benchmarks.checks.{chapter}", args.nproc_per_node, *(["--small"] if args.small else []),
                            nnodes=args.nnodes, timeout=args.timeout)
        except RuntimeError as err:
            failed.append(chapter)
            print(f"FAILED {chapter} after {time.perf_counter() - start:.0f} s: {err}")
            continue
        if run.result.get("world_size", world) != world:
            failed.append(chapter)
            print(f"FAILED {chapter}: the job had {run.result['world_size']} ranks, expected {world}")
            continue
        print(f"ok {chapter}: {len(run.checks)} checks on {world} ranks in {time.perf_counter() - start:.0f} s")
    print(f"{len(args.only) - len(failed)} of {len(args.only)} chapters passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
