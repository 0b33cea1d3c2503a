"""Plausible wrong solutions of chapter 03's exercises (see harness.py)."""

_TIMER_HEAD = '''
import statistics
import time


def time_calls(fn, *, warmup=3, repeat=10, clock=time.perf_counter, sync=None):
    if repeat < 1 or warmup < 0:
        raise ValueError("need repeat >= 1 and warmup >= 0")
'''

_TIMER_LOOP = '''
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        if sync is not None:
            sync()
        times.append(clock() - start)
'''

_GRAPH_HEAD = '''
def graph_step(step, example_inputs, backend, warmup=3):
    static = [x.detach().clone() for x in example_inputs]
    with backend.warmup():
        for _ in range(warmup):
            step(*static)
    graph = backend.new_graph()
    with backend.capture(graph):
        outputs = step(*static)
'''

_STEP_FLOPS_UTILIZATION = '''

def utilization(cfg, batch_size, step_seconds, peak_flops_per_s, checkpointing=False):
    if not (step_seconds > 0 and peak_flops_per_s > 0):
        raise ValueError("need positive step_seconds and peak_flops_per_s")
    model, hardware = step_flops(cfg, batch_size, checkpointing)
    return model / (step_seconds * peak_flops_per_s), hardware / (step_seconds * peak_flops_per_s)
'''

_COUNTER_HEAD = '''
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def op_costs(fn):
    costs = {}
    aten = torch.ops.aten

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
'''

_COUNTER_TAIL = '''
            calls, f, b = costs.get(func._schema.name, (0, 0, 0))
            costs[func._schema.name] = (calls + 1, f + flops, b + moved)
            return out

    with Counter():
        fn()
    return costs
'''

WRONG = {
    "ex03_1_time_calls": {
        "the mean of the durations instead of their median": _TIMER_HEAD + '''
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
''' + _TIMER_LOOP + '''
    return sum(times) / len(times), times
''',
        "the middle element of the sorted durations (no average of the middle two)": _TIMER_HEAD + '''
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
''' + _TIMER_LOOP + '''
    return sorted(times)[len(times) // 2], times
''',
        "no wait for the device after the warm-up": _TIMER_HEAD + '''
    for _ in range(warmup):
        fn()
''' + _TIMER_LOOP + '''
    return statistics.median(times), times
''',
    },
    "ex03_2_top_ops": {
        "a dict by name: a name in two rows keeps one of them": '''
def top_ops(rows, by="self_cpu_time_total", k=5):
    if k < 1:
        raise ValueError("k must be at least 1")
    values = {row.key: getattr(row, by) for row in rows}
    return sorted(values.items(), key=lambda pair: (-pair[1], pair[0]))[:k]
''',
        "sorted in reverse: equal values in reverse alphabetical order": '''
def top_ops(rows, by="self_cpu_time_total", k=5):
    if k < 1:
        raise ValueError("k must be at least 1")
    pairs = sorted(((row.key, getattr(row, by)) for row in rows), key=lambda pair: (pair[1], pair[0]), reverse=True)
    return pairs[:k]
''',
        "calls the reference": '''
from course_lib import profiling


def top_ops(rows, by="self_cpu_time_total", k=5):
    return profiling.top_ops(list(rows), by=by, k=k)
''',
    },
    "ex03_3_op_costs": {
        "FLOPs for aten::mm only (addmm, bmm and baddbmm forgotten)": _COUNTER_HEAD + '''
            if func.is_view:
                return out
            flops = 2 * args[0].numel() * args[1].shape[-1] if func.overloadpacket is aten.mm else 0
            moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
''' + _COUNTER_TAIL,
        "tensors inside list arguments not counted": _COUNTER_HEAD + '''
            if func.is_view:
                return out
            factors = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2)}
            flops = 0
            if func.overloadpacket in factors:
                i, j = factors[func.overloadpacket]
                flops = 2 * args[i].numel() * args[j].shape[-1]
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in tensors)
''' + _COUNTER_TAIL,
        "views counted as if they moved their tensors": _COUNTER_HEAD + '''
            factors = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2)}
            flops = 0
            if func.overloadpacket in factors:
                i, j = factors[func.overloadpacket]
                flops = 2 * args[i].numel() * args[j].shape[-1]
            moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
''' + _COUNTER_TAIL,
    },
    "ex03_4_roofline_gaps": {
        "ranked by measured time, not by the time above the roof": '''
def roofline_gaps(costs, seconds, peak_flops_per_s, peak_bytes_per_s):
    rows = []
    for name in set(costs) & set(seconds):
        _, f, b = costs[name]
        compute_s, memory_s = f / peak_flops_per_s, b / peak_bytes_per_s
        rows.append((name, "compute" if compute_s >= memory_s else "memory", seconds[name] - max(compute_s, memory_s)))
    rows.sort(key=lambda row: (-seconds[row[0]], row[0]))
    return rows
''',
        "a tie between the roofs called memory-bound": '''
def roofline_gaps(costs, seconds, peak_flops_per_s, peak_bytes_per_s):
    rows = []
    for name in set(costs) & set(seconds):
        _, f, b = costs[name]
        compute_s, memory_s = f / peak_flops_per_s, b / peak_bytes_per_s
        rows.append((name, "compute" if compute_s > memory_s else "memory", seconds[name] - max(compute_s, memory_s)))
    rows.sort(key=lambda row: (-row[2], row[0]))
    return rows
''',
        "every counted operator looked up in the times (KeyError for one never timed)": '''
def roofline_gaps(costs, seconds, peak_flops_per_s, peak_bytes_per_s):
    rows = []
    for name, (_, f, b) in costs.items():
        compute_s, memory_s = f / peak_flops_per_s, b / peak_bytes_per_s
        rows.append((name, "compute" if compute_s >= memory_s else "memory", seconds[name] - max(compute_s, memory_s)))
    rows.sort(key=lambda row: (-row[2], row[0]))
    return rows
''',
    },
    "ex03_5_step_flops": {
        "N from the model's 2-d weights that are not embeddings (a tied LM head is then missed)": '''
from course_lib.models import GPT


def step_flops(cfg, batch_size, checkpointing=False):
    h, layers, t = cfg.d_model, cfg.n_layer, cfg.seq_len
    tokens = batch_size * t
    n = sum(p.numel() for name, p in GPT(cfg).named_parameters() if p.dim() == 2 and "emb" not in name)
    model = (6 * n + 12 * layers * t * h) * tokens
    hardware = model + 2 * layers * t * h * tokens
    if checkpointing:
        block = (4 + 2 * cfg.mlp_ratio) * h * h
        hardware += (2 * layers * block + 4 * layers * t * h) * tokens
    return model, hardware
''' + _STEP_FLOPS_UTILIZATION,
        "6N alone, no attention term": '''
def step_flops(cfg, batch_size, checkpointing=False):
    h, layers, t, r, v = cfg.d_model, cfg.n_layer, cfg.seq_len, cfg.mlp_ratio, cfg.vocab_size
    tokens = batch_size * t
    n = layers * (4 + 2 * r) * h * h + v * h
    model = 6 * n * tokens
    hardware = model
    if checkpointing:
        hardware += 2 * layers * (4 + 2 * r) * h * h * tokens
    return model, hardware
''' + _STEP_FLOPS_UTILIZATION,
        "backward counted as much as the forward pass (4N, not 6N)": '''
def step_flops(cfg, batch_size, checkpointing=False):
    h, layers, t, r, v = cfg.d_model, cfg.n_layer, cfg.seq_len, cfg.mlp_ratio, cfg.vocab_size
    tokens = batch_size * t
    n = layers * (4 + 2 * r) * h * h + v * h
    model = (4 * n + 8 * layers * t * h) * tokens
    hardware = model + 2 * layers * t * h * tokens
    if checkpointing:
        hardware += (2 * layers * (4 + 2 * r) * h * h + 4 * layers * t * h) * tokens
    return model, hardware
''' + _STEP_FLOPS_UTILIZATION,
        "hardware FLOPs without the attention's recomputed scores": '''
def step_flops(cfg, batch_size, checkpointing=False):
    h, layers, t, r, v = cfg.d_model, cfg.n_layer, cfg.seq_len, cfg.mlp_ratio, cfg.vocab_size
    tokens = batch_size * t
    n = layers * (4 + 2 * r) * h * h + v * h
    model = (6 * n + 12 * layers * t * h) * tokens
    hardware = model
    if checkpointing:
        hardware += (2 * layers * (4 + 2 * r) * h * h + 4 * layers * t * h) * tokens
    return model, hardware
''' + _STEP_FLOPS_UTILIZATION,
    },
    "ex03_6_graph_step": {
        "new static inputs made at every call (the graph reads the old ones)": _GRAPH_HEAD + '''

    def run(*inputs):
        static[:] = [x.detach().clone() for x in inputs]
        graph.replay()
        return outputs

    return run
''',
        "no check of the inputs' shapes and dtypes (copy_ broadcasts and casts)": _GRAPH_HEAD + '''

    def run(*inputs):
        for buffer, x in zip(static, inputs):
            buffer.copy_(x)
        graph.replay()
        return outputs

    return run
''',
        "copies of the outputs returned": _GRAPH_HEAD + '''

    def run(*inputs):
        if len(inputs) != len(static):
            raise ValueError("wrong number of inputs")
        for buffer, x in zip(static, inputs):
            if x.shape != buffer.shape or x.dtype != buffer.dtype:
                raise ValueError("wrong shape or dtype")
            buffer.copy_(x)
        graph.replay()
        if isinstance(outputs, tuple):
            return tuple(o.clone() for o in outputs)
        return outputs.clone()

    return run
''',
        "no warm-up: the first step is captured (lazy optimizer state inside the graph)": '''
def graph_step(step, example_inputs, backend, warmup=3):
    static = [x.detach().clone() for x in example_inputs]
    graph = backend.new_graph()
    with backend.capture(graph):
        outputs = step(*static)

    def run(*inputs):
        if len(inputs) != len(static):
            raise ValueError("wrong number of inputs")
        for buffer, x in zip(static, inputs):
            if x.shape != buffer.shape or x.dtype != buffer.dtype:
                raise ValueError("wrong shape or dtype")
            buffer.copy_(x)
        graph.replay()
        return outputs

    return run
''',
    },
}
