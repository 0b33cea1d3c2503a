"""Plausible wrong solutions of chapter 14's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole. Several pass the visible checks and are caught by what the hidden ones look at:
the order of point-to-point posts (an order gloo runs and NCCL hangs on), the order in which the
passes ran, the activation bytes held at the peak, and on which rank each virtual stage ran.
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("14_pipeline_parallel")


# A send posted on its own with isend as soon as it is ready, the receive posted on its own and
# waited for at once: gloo runs it (isend returns at once); under NCCL two neighbours that both post
# their send first each wait for a receive the other has queued behind its own send.
_SEPARATE_POSTS = '''
def _post(send, recv):
    sends = send if isinstance(send, list) else [] if send is None else [send]
    works = [dist.isend(t.contiguous(), peer) for t, peer in sends]
    if recv is not None:
        dist.irecv(recv[0], recv[1]).wait()
    return works

'''

WRONG = {
    "ex14_1_balanced_partition": {
        "greedy: fill each stage up to the average cost": '''
def balanced_partition(costs, p):
    n = len(costs)
    if not 1 <= p <= n:
        raise ValueError(f"p must be between 1 and {n}, got {p}")
    target = sum(costs) / p
    bounds, start, acc = [], 0, 0.0
    for i, c in enumerate(costs):
        left_stages = p - len(bounds) - 1
        if i > start and acc + c > target and left_stages > 0 and n - i >= left_stages:
            bounds.append((start, i))
            start, acc = i, 0.0
        acc += c
    bounds.append((start, n))
    while len(bounds) < p:  # too few cuts: split the longest stage
        k = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
        s, e = bounds[k]
        bounds[k:k + 1] = [(s, s + 1), (s + 1, e)]
    return bounds
''',
        "equal numbers of layers, costs ignored": '''
def balanced_partition(costs, p):
    n = len(costs)
    if not 1 <= p <= n:
        raise ValueError(f"p must be between 1 and {n}, got {p}")
    edges = [round(k * n / p) for k in range(p + 1)]
    return [(edges[k], edges[k + 1]) for k in range(p)]
''',
        "costs truncated to whole numbers in the prefix sums (right for integer costs only)": _edited(
            "ex1-solution", ("prefix.append(prefix[-1] + float(c))", "prefix.append(prefix[-1] + int(c))")),
        "calls the reference": '''
def balanced_partition(costs, p):
    return pp.balanced_partition(costs, p)
''',
    },
    "ex14_3_measured_bubble": {
        "overlapping spans counted twice": '''
def measured_bubble(timeline, lanes):
    work = [s for s in timeline.spans if s.kind in ("F", "B")]
    if not work:
        raise ValueError("no F or B spans")
    t0, t1 = min(s.start for s in work), max(s.end for s in work)
    return [1.0 - sum(s.end - s.start for s in work if s.lane == lane) / (t1 - t0) for lane in lanes]
''',
        "each lane's window from its own first to its own last span": '''
def measured_bubble(timeline, lanes):
    work = [s for s in timeline.spans if s.kind in ("F", "B")]
    if not work:
        raise ValueError("no F or B spans")
    out = []
    for lane in lanes:
        mine = sorted((s.start, s.end) for s in work if s.lane == lane)
        if not mine:
            out.append(1.0)
            continue
        busy, cur_s, cur_e = 0.0, mine[0][0], mine[0][1]
        for s, e in mine[1:]:
            if s > cur_e:
                busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        out.append(1.0 - busy / (mine[-1][1] - mine[0][0]))
    return out
''',
        "every kind of span counts as busy": _edited(
            "ex3-solution", ('work = [s for s in timeline.spans if s.kind in ("F", "B")]', "work = list(timeline.spans)")),
        "calls the reference": '''
def measured_bubble(timeline, lanes):
    return pp.measured_bubble(timeline, lanes)
''',
    },
    "ex14_4_gpipe_step": {
        "the micro-batch loss not divided by m": _edited(
            "ex4-solution", ("out = loss_fn(out, ys[i]) / m", "out = loss_fn(out, ys[i])")),
        "returns the last micro-batch's loss only": _edited(
            "ex4-solution", ("total = out.detach() if total is None else total + out.detach()", "total = out.detach()")),
        "the loss averaged twice (divided by m, then the sum divided by m)": _edited(
            "ex4-solution", ("    return total\n", "    return None if total is None else total / m\n")),
        "calls the reference": '''
def gpipe_step(stage, batch, m, loss_fn):
    return pp.gpipe_step(stage, batch, m, loss_fn)
''',
    },
    "ex14_5_one_f_one_b_schedule": {
        "one forward too many in the warm-up": _edited(
            "ex5-solution", ("warmup = min(p - 1 - rank, m)", "warmup = min(p - rank, m)")),
        "GPipe's order under 1F1B's name (all m micro-batches in flight)": '''
def one_f_one_b_schedule(p, m, rank):
    if p < 1 or m < 1 or not 0 <= rank < p:
        raise ValueError(f"need p >= 1, m >= 1, 0 <= rank < p; got p={p}, m={m}, rank={rank}")
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
''',
        "the cool-down's backwards newest first": _edited(
            "ex5-solution", ('ops += [("B", i) for i in range(m - warmup, m)]',
                             'ops += [("B", i) for i in reversed(range(m - warmup, m))]')),
        "calls the reference": '''
def one_f_one_b_schedule(p, m, rank):
    return pp.one_f_one_b_schedule(p, m, rank)
''',
    },
    "ex14_6_run_schedule": {
        "isend as soon as ready, irecv waited at once: runs on gloo, hangs under NCCL":
            _SEPARATE_POSTS + _CELLS["ex6-solution"].replace("pp.exchange(", "_post("),
        "all forwards first whatever the schedule (GPipe's memory)": _edited(
            "ex6-solution", ("    for kind, i in schedule:\n",
                             '    for kind, i in sorted(schedule, key=lambda op: op[0] == "B"):\n')),
        "the micro-batch loss not divided by m": _edited(
            "ex6-solution", ("out = loss_fn(out, ys[i]) / m", "out = loss_fn(out, ys[i])")),
        "calls the reference": '''
def run_schedule(stage, schedule, batch, m, loss_fn):
    return pp.run_schedule(stage, schedule, batch, m, loss_fn)
''',
    },
    "ex14_7_interleaved_schedule": {
        "chunks in groups of m, not p (all micro-batches through chunk 0 first)": _edited(
            "ex7-solution", ("        group, q = divmod(k, p * v)\n        return group * p + q % p, q // p\n",
                             "        return k % m, k // m\n")),
        "each micro-batch through all its chunks before the next (not interleaved)": _edited(
            "ex7-solution", ("        group, q = divmod(k, p * v)\n        return group * p + q % p, q // p\n",
                             "        return k // v, k % v\n")),
        "GPipe's order under interleaving's name (every forward first)": _edited(
            "ex7-solution", ("warmup = min(total, 2 * (p - 1 - rank) + (v - 1) * p) if v > 1 else min(m, p - 1 - rank)",
                             "warmup = total")),
        "plain 1F1B's warm-up for every v": _edited(
            "ex7-solution", ("warmup = min(total, 2 * (p - 1 - rank) + (v - 1) * p) if v > 1 else min(m, p - 1 - rank)",
                             "warmup = min(total, p - 1 - rank)")),
        "m not a multiple of p accepted": _edited(
            "ex7-solution", ("    if m % p:\n        raise ValueError(f\"m={m} is not a multiple of p={p}: micro-batches go "
                             "through the chunks in groups of p\")\n", "")),
        "calls the reference": '''
def interleaved_schedule(p, m, v, rank):
    return pp.interleaved_schedule(p, m, v, rank)
''',
    },
    "ex14_8_run_interleaved": {
        "rank r holds chunks r*v .. r*v+v-1 (contiguous, not round-robin)": _edited(
            "ex8-solution", ("        s = c * p + rank\n", "        s = rank * (len(parts) // p) + c\n")),
        "a send posted on its own when the next op receives nothing (run_schedule's rule)": _edited(
            "ex8-solution",
            ("            if s == 0:\n                inp = xs[i]\n",
             "            if s == 0:\n                works += pp.exchange(pending, None)\n                pending = []\n"
             "                inp = xs[i]\n"),
            ("            if s == last:\n                out.backward()\n",
             "            if s == last:\n                works += pp.exchange(pending, None)\n                pending = []\n"
             "                out.backward()\n")),
        "isend as soon as ready, irecv waited at once: runs on gloo, hangs under NCCL":
            _SEPARATE_POSTS + _CELLS["ex8-solution"].replace("pp.exchange(", "_post("),
        "all forwards first whatever the schedule (GPipe's memory)": _edited(
            "ex8-solution", ("    for kind, i, c in schedule:\n",
                             '    for kind, i, c in sorted(schedule, key=lambda op: op[0] == "B"):\n')),
        "the loss divided by m * v (one term per chunk)": _edited(
            "ex8-solution", ("out = loss_fn(out, ys[i]) / m", "out = loss_fn(out, ys[i]) / (m * (len(parts) // p))")),
        "calls the reference": '''
def run_interleaved(parts, schedule, batch, m, loss_fn):
    return pp.run_interleaved(parts, schedule, batch, m, loss_fn)
''',
    },
}
