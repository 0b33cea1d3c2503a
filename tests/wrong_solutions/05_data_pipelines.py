"""Plausible wrong solutions of chapter 05's exercises (see harness.py)."""

_PREFETCHER_BODY = '''
    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        kind, item = self._queue.get()
        if kind == "end":
            self.close()
            raise StopIteration
        if kind == "error":
            self.close()
            raise item
        self._after_take()
        return item

    def close(self):
        self._done = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
'''

_CUDA_PREFETCHER_INIT = '''
class CudaPrefetcher:
    def __init__(self, loader, device, ops=None):
        self.loader = loader
        self.device = torch.device(device)
        if ops is None and self.device.type == "cuda" and torch.cuda.is_available():
            ops = dp.CudaOps(self.device)
        self.ops = ops
'''

_TOKEN_BATCHES = '''
class TokenBatches:
    def __init__(self, tokens, seq_len, batch_size, rank=0, world_size=1, seed=0):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.windows = (len(tokens) - 1) // seq_len
        self.per_rank = self.windows // world_size
        self.epoch, self.step = 0, 0

    def __len__(self):
        return self.per_rank // self.batch_size

    def _order(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.windows)
        return order[self.rank:self.per_rank * self.world_size:self.world_size]

    def _batch(self, picked):
        rows = np.stack([self.tokens[j * self.seq_len:(j + 1) * self.seq_len + 1] for j in picked])
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def __iter__(self):
        if self.step >= len(self):
            self.epoch, self.step = self.epoch + 1, 0
        mine = self._order()
        while self.step < len(self):
            picked = mine[self.step * self.batch_size:(self.step + 1) * self.batch_size]
            self.step += 1
            yield self._batch(picked)

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["step"]
'''


def _token_batches(old: str, new: str) -> str:
    """The right TokenBatches with one piece replaced (the piece must be there)."""
    assert old in _TOKEN_BATCHES, old
    return _TOKEN_BATCHES.replace(old, new)


WRONG = {
    "ex05_1_prefetcher": {
        "bound by queue.Queue(maxsize=depth) alone: the producer holds one more item": '''
import queue
import weakref


class Prefetcher:
    def __init__(self, iterable, depth=2):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError("depth must be a positive int")

        def produce(source, out, stop):
            try:
                for item in source:
                    while not stop.is_set():
                        try:
                            out.put(("item", item), timeout=0.05)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                out.put(("end", None))
            except BaseException as exc:
                out.put(("error", exc))

        def stop_thread(stop, thread):
            stop.set()
            if thread is not threading.current_thread():
                thread.join(timeout=10)

        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._after_take = lambda: None
        self._thread = threading.Thread(target=produce, args=(iterable, self._queue, self._stop), daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, stop_thread, self._stop, self._thread)
''' + _PREFETCHER_BODY,
        "no thread: pulls each item when asked (nothing runs ahead)": '''
class Prefetcher:
    def __init__(self, iterable, depth=2):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError("depth must be a positive int")
        self._it = iter(iterable)
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            return next(self._it)
        except StopIteration:
            self._done = True
            raise

    def close(self):
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
''',
        "the thread runs a bound method: a dropped prefetcher is never collected": '''
import queue
import weakref


class Prefetcher:
    def __init__(self, iterable, depth=2):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError("depth must be a positive int")
        self.depth = depth
        self._source = iterable
        self._queue = queue.Queue()
        self._room = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._done = False
        self._after_take = self._room.release
        self._thread = threading.Thread(target=self._produce, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._shutdown)

    def _produce(self):
        try:
            it = iter(self._source)
            while not self._stop.is_set():
                while not self._room.acquire(timeout=0.05):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                try:
                    item = next(it)
                except StopIteration:
                    self._queue.put(("end", None))
                    return
                self._queue.put(("item", item))
        except BaseException as exc:
            self._queue.put(("error", exc))

    def _shutdown(self):
        self._stop.set()
        self._room.release(self.depth)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
''' + _PREFETCHER_BODY,
    },
    "ex05_2_simulate_loader": {
        "workers run ahead without the bound of w * prefetch_factor batches in flight": '''
def simulate_loader(load_times, compute_time, num_workers, prefetch_factor=2):
    if num_workers < 0 or (num_workers and prefetch_factor < 1) or compute_time < 0 or any(t < 0 for t in load_times):
        raise ValueError("bad arguments")
    starts, end = [], 0.0
    free = [0.0] * num_workers
    for k, load in enumerate(load_times):
        if num_workers == 0:
            ready = end + load
        else:
            w = k % num_workers
            free[w] += load
            ready = free[w]
        starts.append(float(max(ready, end)))
        end = starts[-1] + compute_time
    return starts
''',
        "hands out the next index when a step ends, not when the loop takes a batch": '''
def simulate_loader(load_times, compute_time, num_workers, prefetch_factor=2):
    if num_workers < 0 or (num_workers and prefetch_factor < 1) or compute_time < 0 or any(t < 0 for t in load_times):
        raise ValueError("bad arguments")
    starts, end = [], 0.0
    free = [0.0] * num_workers
    ahead = num_workers * prefetch_factor
    for k, load in enumerate(load_times):
        if num_workers == 0:
            ready = end + load
        else:
            handed = starts[k - ahead] + compute_time if k >= ahead else 0.0
            w = k % num_workers
            free[w] = max(handed, free[w]) + load
            ready = free[w]
        starts.append(float(max(ready, end)))
        end = starts[-1] + compute_time
    return starts
''',
        "the steady-state formula instead of the schedule": '''
def simulate_loader(load_times, compute_time, num_workers, prefetch_factor=2):
    if num_workers < 0 or (num_workers and prefetch_factor < 1) or compute_time < 0 or any(t < 0 for t in load_times):
        raise ValueError("bad arguments")
    if not load_times:
        return []
    load = sum(load_times) / len(load_times)
    if num_workers == 0:
        return [float(k * (load + compute_time) + load) for k in range(len(load_times))]
    step = max(load / num_workers, compute_time)
    return [float(load + k * step) for k in range(len(load_times))]
''',
    },
    "ex05_3_bottleneck": {
        "the accelerator's idle fraction of the whole timeline (start-up and loaders' tail included)": '''
def bottleneck(timeline, tol=0.1):
    if len(timeline.of("accelerator", "compute")) < 2:
        raise ValueError("need two steps")
    if timeline.idle_fraction("accelerator", "compute") <= tol:
        return "compute"
    spans = [s for s in timeline.spans if s.lane != "accelerator"]
    if not any(s.kind in ("load", "preprocess") for s in spans):
        return "data"
    load = sum(s.end - s.start for s in spans if s.kind == "load")
    prep = sum(s.end - s.start for s in spans if s.kind == "preprocess")
    return "storage" if load >= prep else "preprocess"
''',
        "step 0 counted: the start-up looks like waiting for data": '''
def bottleneck(timeline, tol=0.1):
    steps = timeline.of("accelerator")
    if len({s.label for s in steps}) < 2:
        raise ValueError("need two steps")
    wait = sum(s.end - s.start for s in steps if s.kind == "wait")
    compute = sum(s.end - s.start for s in steps if s.kind == "compute")
    if wait <= tol * (wait + compute):
        return "compute"
    spans = [s for s in timeline.spans if s.lane != "accelerator"]
    if not any(s.kind in ("load", "preprocess") for s in spans):
        return "data"
    load = sum(s.end - s.start for s in spans if s.kind == "load")
    prep = sum(s.end - s.start for s in spans if s.kind == "preprocess")
    return "storage" if load >= prep else "preprocess"
''',
        "counts the loaders' spans instead of adding up their durations": '''
def bottleneck(timeline, tol=0.1):
    steady = [s for s in timeline.of("accelerator") if s.label != "0"]
    if not steady:
        raise ValueError("need two steps")
    wait = sum(s.end - s.start for s in steady if s.kind == "wait")
    compute = sum(s.end - s.start for s in steady if s.kind == "compute")
    if wait <= tol * (wait + compute):
        return "compute"
    spans = [s for s in timeline.spans if s.lane != "accelerator"]
    loads = sum(1 for s in spans if s.kind == "load")
    preps = sum(1 for s in spans if s.kind == "preprocess")
    if loads + preps == 0:
        return "data"
    return "storage" if loads >= preps else "preprocess"
''',
    },
    "ex05_4_token_batches": {
        "each rank shuffles with its own seed: shares overlap": _token_batches(
            "np.random.default_rng((self.seed, self.epoch))", "np.random.default_rng((self.seed + self.rank, self.epoch))"),
        "load_state_dict restores the epoch and restarts it from its first batch": _token_batches(
            'self.epoch, self.step = state["epoch"], state["step"]', 'self.epoch, self.step = state["epoch"], 0'),
        "the same order every epoch (the seed alone)": _token_batches(
            "np.random.default_rng((self.seed, self.epoch))", "np.random.default_rng(self.seed)"),
        "the step is counted after the batch is handed out: a resumed run repeats one": _token_batches(
            "            self.step += 1\n            yield self._batch(picked)",
            "            yield self._batch(picked)\n            self.step += 1"),
        "the last rank takes the leftover windows: unequal shares": _token_batches(
            "        self.per_rank = self.windows // world_size\n",
            "        self.per_rank = self.windows // world_size + (self.windows % world_size if rank == world_size - 1 else 0)\n",
        ).replace("return order[self.rank:self.per_rank * self.world_size:self.world_size]",
                  "base = self.windows // self.world_size\n"
                  "        return order[self.rank * base:self.rank * base + self.per_rank]"),
        "the whole stream converted to int64 up front": _token_batches(
            "self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size",
            "self.tokens, self.seq_len, self.batch_size = np.array(tokens, dtype=np.int64), seq_len, batch_size"),
    },
    "ex05_5_cuda_prefetcher": {
        "a synchronous loop: no side stream, nothing overlaps": '''
class CudaPrefetcher:
    def __init__(self, loader, device, ops=None):
        self.loader = loader
        self.device = torch.device(device)
        self.ops = ops

    def __iter__(self):
        for b in self.loader:
            yield dp.to_device(b, self.device)
''',
        "copies on the compute (default) stream": _CUDA_PREFETCHER_INIT + '''
    def __iter__(self):
        ops = self.ops
        if ops is None:
            for batch in self.loader:
                yield dp.to_device(batch, self.device)
            return
        compute = ops.current_stream()
        it = iter(self.loader)
        try:
            nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), compute, True), next(it))
        except StopIteration:
            return
        while True:
            batch = nxt
            for t in dp.tensors_of(batch):
                ops.record_stream(t, compute)
            try:
                nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), compute, True), next(it))
            except StopIteration:
                yield batch
                return
            yield batch
''',
        "forgets to make the compute stream wait for the copy": _CUDA_PREFETCHER_INIT + '''
    def __iter__(self):
        ops = self.ops
        if ops is None:
            for batch in self.loader:
                yield dp.to_device(batch, self.device)
            return
        side, compute = ops.new_stream(), ops.current_stream()
        it = iter(self.loader)
        try:
            nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), next(it))
        except StopIteration:
            return
        while True:
            batch = nxt
            for t in dp.tensors_of(batch):
                ops.record_stream(t, compute)
            try:
                nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), next(it))
            except StopIteration:
                yield batch
                return
            yield batch
''',
        "copies each batch on the side stream just before handing it out (nothing ahead)": _CUDA_PREFETCHER_INIT + '''
    def __iter__(self):
        ops = self.ops
        if ops is None:
            for batch in self.loader:
                yield dp.to_device(batch, self.device)
            return
        side, compute = ops.new_stream(), ops.current_stream()
        for batch in self.loader:
            moved = dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), batch)
            ops.wait_stream(compute, side)
            for t in dp.tensors_of(moved):
                ops.record_stream(t, compute)
            yield moved
''',
        "waits after queuing the next copy: each step waits for the next batch too": _CUDA_PREFETCHER_INIT + '''
    def __iter__(self):
        ops = self.ops
        if ops is None:
            for batch in self.loader:
                yield dp.to_device(batch, self.device)
            return
        side, compute = ops.new_stream(), ops.current_stream()
        it = iter(self.loader)
        try:
            nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), next(it))
        except StopIteration:
            return
        while True:
            batch = nxt
            for t in dp.tensors_of(batch):
                ops.record_stream(t, compute)
            try:
                nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), next(it))
            except StopIteration:
                ops.wait_stream(compute, side)
                yield batch
                return
            ops.wait_stream(compute, side)
            yield batch
''',
        "never records the batch on the compute stream": _CUDA_PREFETCHER_INIT + '''
    def __iter__(self):
        ops = self.ops
        if ops is None:
            for batch in self.loader:
                yield dp.to_device(batch, self.device)
            return
        side, compute = ops.new_stream(), ops.current_stream()
        it = iter(self.loader)
        try:
            nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), next(it))
        except StopIteration:
            return
        while True:
            ops.wait_stream(compute, side)
            batch = nxt
            try:
                nxt = dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), next(it))
            except StopIteration:
                yield batch
                return
            yield batch
''',
        "copies from pageable memory (no pin)": _CUDA_PREFETCHER_INIT + '''
    def __iter__(self):
        ops = self.ops
        if ops is None:
            for batch in self.loader:
                yield dp.to_device(batch, self.device)
            return
        side, compute = ops.new_stream(), ops.current_stream()
        it = iter(self.loader)
        try:
            nxt = dp.map_tensors(lambda t: ops.copy(t, side, True), next(it))
        except StopIteration:
            return
        while True:
            ops.wait_stream(compute, side)
            batch = nxt
            for t in dp.tensors_of(batch):
                ops.record_stream(t, compute)
            try:
                nxt = dp.map_tensors(lambda t: ops.copy(t, side, True), next(it))
            except StopIteration:
                yield batch
                return
            yield batch
''',
    },
}
