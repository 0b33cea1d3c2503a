"""Plausible wrong solutions of chapter 07's exercises (see harness.py)."""

# The skeleton of exercise 3's Function as the release hands it out: wrong solutions that never
# write it keep it.
_UNTOUCHED_FUNCTION = '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x, *params):
        raise NotImplementedError()

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError()
'''


# A right Function (CPU inputs), for wrong solutions whose mistake is in checkpointed_sequential.
_RIGHT_FUNCTION = '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.cpu_state = torch.get_rng_state()
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.cpu_state)
            with torch.enable_grad():
                x_again = x.detach().requires_grad_(ctx.needs_input_grad[1])
                y = ctx.run(x_again)
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((x_again, *ctx.params), needs) if need]
        found = iter(torch.autograd.grad(y, wanted, grad_out, allow_unused=True))
        return (None, *(next(found) if need else None for need in needs))
'''

# checkpointed_sequential as the course writes it, for wrong solutions whose mistake is in the Function.
_SEQUENTIAL = '''
def checkpointed_sequential(modules, segments, x):
    modules = list(modules)
    for start, end in ac.segment_bounds(len(modules), segments):
        chunk = modules[start:end]
        def run(t, chunk=chunk):
            for m in chunk:
                t = m(t)
            return t
        x = CheckpointSegment.apply(run, x, *[p for m in chunk for p in m.parameters()])
    return x
'''

# The end of a right backward: gradients of the recomputed segment for the inputs that need them.
_GRADIENTS = '''
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((x_again, *ctx.params), needs) if need]
        found = iter(torch.autograd.grad(y, wanted, grad_out, allow_unused=True))
        return (None, *(next(found) if need else None for need in needs))
'''

WRONG = {
    "ex07_1_accumulation_step": {
        "the mean of micro-batch means (each micro-batch's mean loss divided by k)": '''
def accumulation_step(model, optimizer, micro_batches, ignore_index=-100):
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for inputs, targets in micro_batches:
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)
        (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    optimizer.step()
    return float(total)
''',
        "each micro-batch's mean weighted by its share of the tokens (NaN for a micro-batch of padding)": '''
def accumulation_step(model, optimizer, micro_batches, ignore_index=-100):
    counts = [int((t != ignore_index).sum()) for _, t in micro_batches]
    total = sum(counts)
    if total == 0:
        raise ValueError("no target")
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for (inputs, targets), n in zip(micro_batches, counts):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)
        (loss * n / total).backward()
        loss_sum += loss.detach() * n
    optimizer.step()
    return float(loss_sum) / total
''',
        "ignore_index -100 written into the loss instead of the argument": '''
def accumulation_step(model, optimizer, micro_batches, ignore_index=-100):
    total = sum(int((t != -100).sum()) for _, t in micro_batches)
    if total == 0:
        raise ValueError("no target")
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for inputs, targets in micro_batches:
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        (loss / total).backward()
        loss_sum += loss.detach()
    optimizer.step()
    return float(loss_sum) / total
''',
        "one backward pass at the end (every micro-batch's graph kept at once)": '''
def accumulation_step(model, optimizer, micro_batches, ignore_index=-100):
    total = sum(int((t != ignore_index).sum()) for _, t in micro_batches)
    if total == 0:
        raise ValueError("no target")
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    for inputs, targets in micro_batches:
        logits = model(inputs)
        loss = loss + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                      ignore_index=ignore_index, reduction="sum")
    (loss / total).backward()
    optimizer.step()
    return float(loss) / total
''',
        "divides by every target position, padding included": '''
def accumulation_step(model, optimizer, micro_batches, ignore_index=-100):
    total = sum(t.numel() for _, t in micro_batches)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for inputs, targets in micro_batches:
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
        (loss / total).backward()
        loss_sum += loss.detach()
    optimizer.step()
    return float(loss_sum) / total
''',
    },
    "ex07_2_peak_saved_bytes": {
        "never subtracts: the total of everything saved": '''
def peak_saved_bytes(fn, x):
    seen, total = set(), 0
    def pack(t):
        nonlocal total
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x).sum().backward()
    return total
''',
        "hooks around the forward pass only (the recomputation is not seen)": '''
def peak_saved_bytes(fn, x):
    live, peak, users = 0, 0, {}
    class Held:
        def __init__(self, t):
            self.t = t
    def release(key, nbytes):
        nonlocal live
        users[key] -= 1
        if users[key] == 0:
            del users[key]
            live -= nbytes
    def pack(t):
        nonlocal live, peak
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        key, nbytes = (str(t.device), t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()
        if key not in users:
            users[key] = 0
            live += nbytes
            peak = max(peak, live)
        users[key] += 1
        held = Held(t)
        weakref.finalize(held, release, key, nbytes)
        return held
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t if isinstance(h, Held) else h):
        out = fn(x).sum()
    out.backward()
    return peak
''',
        "bytes of each saved tensor (numel x element size), every save counted": '''
def peak_saved_bytes(fn, x):
    live, peak = 0, 0
    class Held:
        def __init__(self, t):
            self.t = t
    def release(nbytes):
        nonlocal live
        live -= nbytes
    def pack(t):
        nonlocal live, peak
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        nbytes = t.numel() * t.element_size()
        live += nbytes
        peak = max(peak, live)
        held = Held(t)
        weakref.finalize(held, release, nbytes)
        return held
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t if isinstance(h, Held) else h):
        fn(x).sum().backward()
    return peak
''',
        "released when the backward pass unpacks a tensor, not when autograd frees it": '''
def peak_saved_bytes(fn, x):
    live, peak, users = 0, 0, {}
    def pack(t):
        nonlocal live, peak
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        key, nbytes = (str(t.device), t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()
        if key not in users:
            users[key] = 0
            live += nbytes
            peak = max(peak, live)
        users[key] += 1
        return (key, nbytes, t)
    def unpack(packed):
        nonlocal live
        if not isinstance(packed, tuple):
            return packed
        key, nbytes, t = packed
        if key in users:
            users[key] -= 1
            if users[key] == 0:
                del users[key]
                live -= nbytes
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        fn(x).sum().backward()
    return peak
''',
        "only nn.Parameter itself left out (its views, such as weight.t(), counted)": '''
def peak_saved_bytes(fn, x):
    live, peak, users = 0, 0, {}
    class Held:
        def __init__(self, t):
            self.t = t
    def release(key, nbytes):
        nonlocal live
        users[key] -= 1
        if users[key] == 0:
            del users[key]
            live -= nbytes
    def pack(t):
        nonlocal live, peak
        if isinstance(t, nn.Parameter):
            return t
        key, nbytes = (str(t.device), t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()
        if key not in users:
            users[key] = 0
            live += nbytes
            peak = max(peak, live)
        users[key] += 1
        held = Held(t)
        weakref.finalize(held, release, key, nbytes)
        return held
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t if isinstance(h, Held) else h):
        fn(x).sum().backward()
    return peak
''',
        "the course's meter (mm.SavedBytesTracker)": '''
def peak_saved_bytes(fn, x):
    with mm.SavedBytesTracker() as tracker:
        fn(x).sum().backward()
    return tracker.peak
''',
    },
    "ex07_3_checkpointed_sequential": {
        "a loop around torch.utils.checkpoint (use_reentrant=False)": _UNTOUCHED_FUNCTION + '''
def checkpointed_sequential(modules, segments, x):
    modules = list(modules)
    def run(chunk, t):
        for m in chunk:
            t = m(t)
        return t
    for start, end in ac.segment_bounds(len(modules), segments):
        x = torch.utils.checkpoint.checkpoint(run, modules[start:end], x, use_reentrant=False)
    return x
''',
        "a loop around torch.utils.checkpoint (use_reentrant=True)": _UNTOUCHED_FUNCTION + '''
def checkpointed_sequential(modules, segments, x):
    from torch.utils.checkpoint import checkpoint
    modules = list(modules)
    def run(chunk, t):
        for m in chunk:
            t = m(t)
        return t
    for start, end in ac.segment_bounds(len(modules), segments):
        x = checkpoint(run, modules[start:end], x, use_reentrant=True)
    return x
''',
        "torch.utils.checkpoint inside the Function's backward": '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x_again = x.detach().requires_grad_(ctx.needs_input_grad[1])
            y = torch.utils.checkpoint.checkpoint(ctx.run, x_again, use_reentrant=False)
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((x_again, *ctx.params), needs) if need]
        found = iter(torch.autograd.grad(y, wanted, grad_out, allow_unused=True))
        return (None, *(next(found) if need else None for need in needs))

def checkpointed_sequential(modules, segments, x):
    modules = list(modules)
    for start, end in ac.segment_bounds(len(modules), segments):
        chunk = modules[start:end]
        def run(t, chunk=chunk):
            for m in chunk:
                t = m(t)
            return t
        x = CheckpointSegment.apply(run, x, *[p for m in chunk for p in m.parameters()])
    return x
''',
        "a Function that does not save and replay the random state": '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x_again = x.detach().requires_grad_(ctx.needs_input_grad[1])
            y = ctx.run(x_again)''' + _GRADIENTS + _SEQUENTIAL,
        "the random state set back without fork_rng (the rest of training is rewound)": '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.cpu_state = torch.get_rng_state()
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        torch.set_rng_state(ctx.cpu_state)
        with torch.enable_grad():
            x_again = x.detach().requires_grad_(ctx.needs_input_grad[1])
            y = ctx.run(x_again)''' + _GRADIENTS + _SEQUENTIAL,
        "the random state saved after the segment ran": '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.save_for_backward(x)
        y = run(x)
        ctx.cpu_state = torch.get_rng_state()
        return y

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_state)
            x_again = x.detach().requires_grad_(ctx.needs_input_grad[1])
            y = ctx.run(x_again)''' + _GRADIENTS + _SEQUENTIAL,
        "a Function that keeps the segment's graph (all activations saved)": '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.params = params
        with torch.enable_grad():
            ctx.x_again = x.detach().requires_grad_(x.requires_grad)
            ctx.y = run(ctx.x_again)
        return ctx.y.detach()

    @staticmethod
    def backward(ctx, grad_out):
        x_again, y = ctx.x_again, ctx.y''' + _GRADIENTS + _SEQUENTIAL,
        "x the only input of the node (the first segment's parameters lost when x needs no grad)": '''
class CheckpointSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.cpu_state = torch.get_rng_state()
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.cpu_state)
            with torch.enable_grad():
                x_again = x.detach().requires_grad_()
                y = ctx.run(x_again)
        torch.autograd.backward(y, grad_out)
        return None, x_again.grad

def checkpointed_sequential(modules, segments, x):
    modules = list(modules)
    for start, end in ac.segment_bounds(len(modules), segments):
        chunk = modules[start:end]
        def run(t, chunk=chunk):
            for m in chunk:
                t = m(t)
            return t
        x = CheckpointSegment.apply(run, x)
    return x
''',
        "a closure over the loop variables (every backward recomputes the last segment)": _RIGHT_FUNCTION + '''
def checkpointed_sequential(modules, segments, x):
    modules = list(modules)
    for start, end in ac.segment_bounds(len(modules), segments):
        def run(t):
            for m in modules[start:end]:
                t = m(t)
            return t
        x = CheckpointSegment.apply(run, x, *[p for m in modules[start:end] for p in m.parameters()])
    return x
''',
        "the last segment left unchecked, as checkpoint_sequential does": _RIGHT_FUNCTION + '''
def checkpointed_sequential(modules, segments, x):
    modules = list(modules)
    bounds = ac.segment_bounds(len(modules), segments)
    for start, end in bounds[:-1]:
        chunk = modules[start:end]
        def run(t, chunk=chunk):
            for m in chunk:
                t = m(t)
            return t
        x = CheckpointSegment.apply(run, x, *[p for m in chunk for p in m.parameters()])
    for m in modules[bounds[-1][0]:]:
        x = m(x)
    return x
''',
    },
    "ex07_4_fit_plan": {
        "measures every configuration first, then picks": '''
def fit_plan(measure, n_layers, batch_size, budget):
    table = {(k, s): measure(batch_size // k, s)
             for k in range(1, batch_size + 1) if batch_size % k == 0 for s in range(n_layers + 1)}
    for (k, s), peak in sorted(table.items()):
        if peak <= budget:
            return k, s
    raise ValueError("nothing fits")
''',
        "the segment count with the smallest peak, not the fewest that fit": '''
def fit_plan(measure, n_layers, batch_size, budget):
    for k in range(1, batch_size + 1):
        if batch_size % k:
            continue
        b = batch_size // k
        if measure(b, 0) <= budget:
            return k, 0
        peaks = {s: measure(b, s) for s in range(1, n_layers + 1)}
        best = min(peaks, key=lambda s: (peaks[s], s))
        if peaks[best] <= budget:
            return k, best
    raise ValueError("nothing fits")
''',
        "a peak equal to the budget taken as not fitting": '''
def fit_plan(measure, n_layers, batch_size, budget):
    for k in range(1, batch_size + 1):
        if batch_size % k:
            continue
        for s in range(n_layers + 1):
            if measure(batch_size // k, s) < budget:
                return k, s
    raise ValueError("nothing fits")
''',
        "every micro-batch count, divisor or not": '''
def fit_plan(measure, n_layers, batch_size, budget):
    for k in range(1, batch_size + 1):
        for s in range(n_layers + 1):
            if measure(batch_size // k, s) <= budget:
                return k, s
    raise ValueError("nothing fits")
''',
        "checkpointing tried first, plain training last": '''
def fit_plan(measure, n_layers, batch_size, budget):
    for k in range(1, batch_size + 1):
        if batch_size % k:
            continue
        for s in list(range(1, n_layers + 1)) + [0]:
            if measure(batch_size // k, s) <= budget:
                return k, s
    raise ValueError("nothing fits")
''',
    },
}
