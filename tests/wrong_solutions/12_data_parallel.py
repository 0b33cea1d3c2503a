"""Plausible wrong solutions of chapter 12's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole.
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("12_data_parallel")


_LAUNCH = "        self.inflight.append((b, flat, dist.all_reduce(flat, async_op=True)))\n"
_ZERO2_HOOK = "            p.register_post_accumulate_grad_hook(lambda p, i=i: self._reduce_scatter(i, p))\n"
_ZERO3_RUN = ("        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):\n"
              "            out = functional_call(self.block, views, (x,))\n")

WRONG = {
    "ex12_1_averaged_shard_gradients": {
        "the whole batch's gradient at once (no shards)": '''
def averaged_shard_gradients(model, loss_fn, x, y, world_size):
    if world_size < 1 or x.shape[0] % world_size:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {world_size} equal shards")
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss_fn(model(x), y), params))
''',
        "each shard's loss divided by the world size, then averaged again": _edited(
            "ex1-solution", ("torch.autograd.grad(loss_fn(model(xs), ys), params)",
                             "torch.autograd.grad(loss_fn(model(xs), ys) / world_size, params)")),
        "the shard gradients summed, not averaged": _edited(
            "ex1-solution", ("    return [t / world_size for t in total]", "    return total")),
        "calls the reference": '''
def averaged_shard_gradients(model, loss_fn, x, y, world_size):
    return dp.averaged_shard_gradients(model, loss_fn, x, y, world_size)
''',
    },
    "ex12_2_average_gradients": {
        "divided by the world size before and after the all-reduce": _edited(
            "ex2-solution", ("            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)\n",
                             "            p.grad.div_(world_size)\n            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)\n")),
        "all-gathers every gradient and averages the copies (N times the bytes)": '''
def average_gradients(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            copies = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(copies, p.grad)
            p.grad.copy_(torch.stack(copies).mean(0))
''',
        "the sum, not the average": _edited("ex2-solution", ("            p.grad.div_(world_size)\n", "")),
        "calls the reference": '''
def average_gradients(model):
    dp.average_gradients(model)
''',
    },
    "ex12_3_assign_buckets": {
        "parameters in forward order": _edited(
            "ex3-solution", ("    for i in reversed(range(len(params))):", "    for i in range(len(params)):")),
        "a bucket closes only once it exceeds the cap": _edited(
            "ex3-solution", ("        if size >= bucket_cap_bytes:", "        if size > bucket_cap_bytes:")),
        "dtypes mixed in one bucket": _edited(
            "ex3-solution", ("        if current and params[i].dtype != params[current[0]].dtype:\n"
                             "            buckets.append(current)\n            current, size = [], 0\n", "")),
        "calls the reference": '''
def assign_buckets(params, bucket_cap_bytes):
    return dp.assign_buckets(params, bucket_cap_bytes)
''',
    },
    "ex12_4_bucketed_ddp": {
        "each bucket's all-reduce waited for right after its launch (no overlap)": _edited(
            "ex4-solution", (_LAUNCH, "        work = dist.all_reduce(flat, async_op=True)\n        work.wait()\n"
                                      "        self.inflight.append((b, flat, work))\n")),
        "no_sync() does not stop the hooks": _edited(
            "ex4-solution", ("        self.sync = False\n        try:\n            yield\n        finally:\n"
                             "            self.sync = True\n", "        yield\n")),
        "rank 0's parameters never broadcast": _edited("ex4-solution", ("        dp.broadcast_parameters(module)\n", "")),
        "calls the reference": '''
class BucketedDDP(dp.BucketedDDP):
    pass
''',
    },
    "ex12_5_zero_stage1": {
        "shards dealt round-robin like DistributedSampler's indices (a strided view to the all-gather)": '''
from course_lib.optimizers import adam_step


class ZeroStage1Optimizer:
    def __init__(self, params, world_size, rank, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.params = [p for p in params if p.requires_grad]
        self.world_size, self.rank = world_size, rank
        self.hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.state = {}
        self.numel = sum(p.numel() for p in self.params)
        self.shard = math.ceil(self.numel / world_size)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        n, total = self.world_size, self.shard * self.world_size
        grads = F.pad(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in self.params]),
                      (0, total - self.numel))
        grad_shard = torch.empty(self.shard, dtype=grads.dtype)
        dist.reduce_scatter_tensor(grad_shard, grads.view(self.shard, n).t().reshape(-1))  # rank r: r, r + n, ...
        grad_shard /= n
        weights = F.pad(torch.cat([p.reshape(-1) for p in self.params]), (0, total - self.numel))
        mine = weights[self.rank::n]
        adam_step(mine, grad_shard, self.state, **self.hyper)
        gathered = torch.empty(total, dtype=weights.dtype)
        dist.all_gather_into_tensor(gathered, mine)
        weights = gathered.view(n, self.shard).t().reshape(-1)
        offset = 0
        for p in self.params:
            p.copy_(weights[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
''',
        "an all-reduce of the whole gradient, then this rank's slice": _edited(
            "ex5-solution", ("        dist.reduce_scatter_tensor(grad_shard, grads)\n",
                             "        dist.all_reduce(grads)\n"
                             "        grad_shard.copy_(grads[self.rank * self.shard:(self.rank + 1) * self.shard])\n")),
        "Adam states for every parameter, not the shard": _edited(
            "ex5-solution", ("        adam_step(param_shard, grad_shard, self.state, **self.hyper)\n"
                             "        dist.all_gather_into_tensor(weights, param_shard)\n",
                             "        weights_all = weights.clone()\n"
                             "        full_grad = torch.empty_like(weights)\n"
                             "        dist.all_gather_into_tensor(full_grad, grad_shard)\n"
                             "        adam_step(weights_all, full_grad, self.state, **self.hyper)\n"
                             "        weights = weights_all\n")),
        "the gradient divided by the world size twice": _edited(
            "ex5-solution", ("        grad_shard /= self.world_size\n", "        grad_shard /= self.world_size ** 2\n")),
        "calls the reference": '''
class ZeroStage1Optimizer(dp.ZeroStage1Optimizer):
    pass
''',
    },
    "ex12_6_zero_stage2": {
        "the full gradients kept until step()": _edited(
            "ex6-solution", ("        p.grad = None  # the full gradient is freed as soon as it is reduce-scattered\n", "")),
        "an all-reduce in the hook, then this rank's slice": _edited(
            "ex6-solution", ("        dist.reduce_scatter_tensor(shard, padded)\n",
                             "        dist.all_reduce(padded)\n"
                             "        shard.copy_(padded[self.rank * size:(self.rank + 1) * size])\n")),
        "the gradient shard of the last micro-batch replaces the others": _edited(
            "ex6-solution",
            ("        self.grad_shards[i] = shard if self.grad_shards[i] is None else self.grad_shards[i] + shard\n",
             "        self.grad_shards[i] = shard\n")),
        "the gradient divided by the world size twice": _edited(
            "ex6-solution", ("        shard /= self.world_size\n", "        shard /= self.world_size ** 2\n")),
        "reduce-scatters in step(), after backward, not from the hooks": _edited(
            "ex6-solution",
            (_ZERO2_HOOK, "            pass\n"),
            ("        for i, p in enumerate(self.params):\n            full, size = self._padded(p)\n",
             "        for i, p in enumerate(self.params):\n            if p.grad is not None:\n"
             "                self._reduce_scatter(i, p)\n            full, size = self._padded(p)\n")),
        "calls the reference": '''
class ZeroStage2Optimizer(dp.ZeroStage2Optimizer):
    pass
''',
    },
    "ex12_7_fully_sharded": {
        "autograd keeps the forward's gathered parameters (no saved-tensor hooks, no gather in backward)": _edited(
            "ex7-solution", (_ZERO3_RUN, "        out = functional_call(self.block, views, (x,))\n"),
            ("        out.register_hook(gather_again)\n", "")),
        "the gathered parameters cached on the block (never resharded)": _edited(
            "ex7-solution", ("        dist.all_gather_into_tensor(full, self.shard.detach())\n        return full\n",
                             "        dist.all_gather_into_tensor(full, self.shard.detach())\n        self.gathered = full\n"
                             "        return full\n")),
        "the backward's gathered parameters never freed": _edited(
            "ex7-solution", ("        ctx.owner.full_for_backward = None  # reshard after the backward pass\n", "")),
        "an all-reduce of the gradient, then this rank's slice": _edited(
            "ex7-solution", ("        dist.reduce_scatter_tensor(grad, grad_full.contiguous())\n",
                             "        total = grad_full.contiguous().clone()\n        dist.all_reduce(total)\n"
                             "        grad.copy_(total[self.rank * grad.numel():(self.rank + 1) * grad.numel()])\n")),
        "the gradient divided by the world size twice": _edited(
            "ex7-solution", ("        return grad / self.world_size\n", "        return grad / self.world_size ** 2\n")),
        "calls the reference": '''
class FullyShardedBlock(dp.FullyShardedBlock):
    pass
''',
    },
}

_HET_SPLIT_HEAD = ("from fractions import Fraction\n\n\n"
                   "def speed_proportional_split(global_batch, speeds):\n")
_HET_AVERAGE = _CELLS["ex8-solution"][_CELLS["ex8-solution"].index("@torch.no_grad()"):]
_HET_SPLIT = _CELLS["ex8-solution"][:_CELLS["ex8-solution"].index("@torch.no_grad()")]

WRONG["ex12_8_heterogeneous_dp"] = {
    "a plain mean over the ranks (no weights)": _edited(
        "ex8-solution", ("    flat *= local_count / global_count\n", "    flat /= dist.get_world_size()\n")),
    "weighted, then divided by the world size as well": _edited(
        "ex8-solution", ("    dist.all_reduce(flat, op=dist.ReduceOp.SUM)\n",
                         "    dist.all_reduce(flat, op=dist.ReduceOp.SUM)\n    flat /= dist.get_world_size()\n")),
    "an equal split whatever the speeds": _HET_SPLIT_HEAD + '''\
    if global_batch < 0 or not speeds or any(not s > 0 for s in speeds):
        raise ValueError("bad arguments")
    n = len(speeds)
    return [global_batch // n + (1 if r < global_batch % n else 0) for r in range(n)]


''' + _HET_AVERAGE,
    "each quota rounded to the nearest integer (need not sum to the batch)": _HET_SPLIT_HEAD + '''\
    if global_batch < 0 or not speeds or any(not s > 0 for s in speeds):
        raise ValueError("bad arguments")
    total = sum(speeds)
    low = 1 if global_batch >= len(speeds) else 0
    return [max(low, round(global_batch * s / total)) for s in speeds]


''' + _HET_AVERAGE,
    "the floors' leftovers to the fastest ranks, not the largest remainders": _edited(
        "ex8-solution", ("    order = sorted(range(n), key=lambda r: (counts[r] - quotas[r], r))"
                         "  # largest remainder first\n",
                         "    order = sorted(range(n), key=lambda r: (-speeds[r], r))\n")),
    "no minimum of one sample per rank": _edited(
        "ex8-solution", ("    for r in range(n):\n        if counts[r] == 0:\n"
                         "            donor = max(range(n), key=lambda d: (counts[d], -d))\n"
                         "            counts[donor] -= 1\n            counts[r] = 1\n", "")),
    "a rank left with none takes its sample from the last of the largest ranks": _edited(
        "ex8-solution", ("            donor = max(range(n), key=lambda d: (counts[d], -d))\n",
                         "            donor = max(range(n), key=lambda d: (counts[d], d))\n")),
    "fewer samples than ranks: the first ranks get one, whatever their speed": _edited(
        "ex8-solution", ("        fastest = sorted(range(n), key=lambda r: (-speeds[r], r))[:global_batch]\n",
                         "        fastest = list(range(global_batch))\n")),
    "one all-reduce per parameter (weighted correctly)": _HET_SPLIT + '''@torch.no_grad()
def weighted_average_gradients(model, local_count, global_count):
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(local_count / global_count)
            dist.all_reduce(p.grad)
''',
    "calls the reference": '''
def speed_proportional_split(global_batch, speeds):
    return dp.speed_proportional_split(global_batch, speeds)


def weighted_average_gradients(model, local_count, global_count):
    dp.weighted_average_gradients(model, local_count, global_count)
''',
}
