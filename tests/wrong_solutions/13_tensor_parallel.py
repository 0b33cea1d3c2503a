"""Plausible wrong solutions of chapter 13's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole.
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("13_tensor_parallel")


_ALL_REDUCED = ("        total = {0}.clone(memory_format=torch.contiguous_format)\n"
                "        dist.all_reduce(total)\n        return total\n")
_SPLIT_CHECK = ("        if linear.out_features % world_size:\n"
                "            raise ValueError(f\"out_features={linear.out_features} does not split over {world_size} ranks\")\n")
_QKV_ROWS = ("        weight = torch.cat([w[feats] for w in attn.qkv.weight.split(h)])\n"
             "        bias = None if attn.qkv.bias is None else torch.cat([b[feats] for b in attn.qkv.bias.split(h)])\n")

WRONG = {
    "ex13_1_f_and_g": {
        "f's backward forgets the all-reduce": _edited(
            "ex1-solution",
            (_ALL_REDUCED.format("grad"), "        return grad\n")),
        "all-reduce in place on the caller's tensor": _edited(
            "ex1-solution",
            (_ALL_REDUCED.format("x"), "        dist.all_reduce(x)\n        return x.view_as(x)\n")),
        "averages instead of summing": _edited(
            "ex1-solution",
            (_ALL_REDUCED.format("grad"),
             "        total = grad.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total)\n"
             "        return total / dist.get_world_size()\n")),
        "calls the reference": '''
class CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return tp.CopyToParallelRegion.forward(ctx, x)

    @staticmethod
    def backward(ctx, grad):
        return tp.CopyToParallelRegion.backward(ctx, grad)[0]


class ReduceFromParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return tp.ReduceFromParallelRegion.forward(ctx, x)

    @staticmethod
    def backward(ctx, grad):
        return grad
''',
    },
    "ex13_2_column_parallel": {
        "no f: the input gradient is this rank's part only": _edited(
            "ex2-solution", ("y = F.linear(tp.copy_to_parallel_region(x), self.weight, self.bias)",
                             "y = F.linear(x, self.weight, self.bias)")),
        "the bias kept whole": _edited(
            "ex2-solution", ("bias = None if linear.bias is None else linear.bias[rows]",
                             "bias = None if linear.bias is None else linear.bias[rows.start:rows.start + 1].expand(part)")),
        "no check that the features split evenly": _edited(
            "ex2-solution", (_SPLIT_CHECK, "")),
        "calls the reference": '''
class ColumnParallelLinear(tp.ColumnParallelLinear):
    pass
''',
    },
    "ex13_3_row_parallel": {
        "bias added before the all-reduce (counted n times)": _edited(
            "ex3-solution", ("        y = tp.reduce_from_parallel_region(F.linear(x, self.weight))\n"
                             "        return y if self.bias is None else y + self.bias\n",
                             "        return tp.reduce_from_parallel_region(F.linear(x, self.weight, self.bias))\n")),
        "the full input used as if it were the slice": _edited(
            "ex3-solution", ("            x = tp.scatter_to_parallel_region(x)\n",
                             "            x = x[..., :self.weight.shape[1]]\n")),
        "calls the reference": '''
class RowParallelLinear(tp.RowParallelLinear):
    pass
''',
    },
    "ex13_5_parallel_attention": {
        "contiguous rows of qkv instead of this rank's heads in q, k and v": _edited(
            "ex5-solution", (_QKV_ROWS,
                             "        weight = attn.qkv.weight.chunk(world_size)[rank]\n"
                             "        bias = None if attn.qkv.bias is None else attn.qkv.bias.chunk(world_size)[rank]\n")),
        "the output bias split with proj's columns": _edited(
            "ex5-solution", ("proj = tp.RowParallelLinear(attn.proj.weight[:, feats], attn.proj.bias)",
                             "proj = tp.RowParallelLinear(attn.proj.weight[:, feats], "
                             "None if attn.proj.bias is None else attn.proj.bias / world_size)")),
        "calls the reference": '''
class ParallelAttention(tp.ParallelAttention):
    pass
''',
    },
    "ex13_6_sequence_regions": {
        "non-contiguous sequence slices handed to reduce_scatter (fine on gloo)": _edited(
            "ex6-sp-solution",
            ("        parts = [p.contiguous() for p in x.chunk(dist.get_world_size(), dim=1)]\n",
             "        parts = list(x.chunk(dist.get_world_size(), dim=1))\n"),
            ("        parts = [p.contiguous() for p in grad.chunk(dist.get_world_size(), dim=1)]\n",
             "        parts = list(grad.chunk(dist.get_world_size(), dim=1))\n")),
        "reduce-scatter as an all-reduce and a slice": _edited(
            "ex6-sp-solution",
            ("        parts = [p.contiguous() for p in x.chunk(dist.get_world_size(), dim=1)]\n"
             "        out = torch.empty_like(parts[0])\n        dist.reduce_scatter(out, parts)\n        return out\n",
             "        total = x.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total)\n"
             "        return total.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()\n")),
        "gather's backward keeps this rank's slice without summing": _edited(
            "ex6-sp-solution",
            ("        parts = [p.contiguous() for p in grad.chunk(dist.get_world_size(), dim=1)]\n"
             "        out = torch.empty_like(parts[0])\n        dist.reduce_scatter(out, parts)\n        return out\n",
             "        return grad.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()\n")),
        "shards concatenated along the batch": _edited(
            "ex6-sp-solution",
            ("        dist.all_gather(parts, x)\n        return torch.cat(parts, dim=1)\n",
             "        dist.all_gather(parts, x)\n        return torch.cat(parts, dim=0).reshape(x.shape[0], -1, x.shape[-1])\n")),
        "calls the reference": '''
class GatherFromSequenceParallelRegion(tp.GatherFromSequenceParallelRegion):
    pass


class ReduceScatterToSequenceParallelRegion(tp.ReduceScatterToSequenceParallelRegion):
    pass
''',
    },
    "ex13_7_parallel_sublayer": {
        "dropout keyed on local positions (every rank drops like rank 0)": _edited(
            "ex7-sub-solution",
            ("            start, total = dist.get_rank() * x.shape[1], dist.get_world_size() * x.shape[1]\n",
             "            start, total = 0, x.shape[1]\n")),
        "dropout seeded per rank (ranks disagree on replicated activations)": _edited(
            "ex7-sub-solution",
            ("        return x + tp.sequence_dropout(self.inner(h), self.p, self.seed, start, total)\n",
             "        return x + tp.sequence_dropout(self.inner(h), self.p, self.seed + dist.get_rank(), start, total)\n")),
        "LayerNorm gradients not summed over the ranks": _edited(
            "ex7-sub-solution",
            ("            weight = tp.copy_to_parallel_region(weight)\n"
             "            bias = None if bias is None else tp.copy_to_parallel_region(bias)\n", "")),
        "LayerNorm gradients summed also when replicated": _edited(
            "ex7-sub-solution",
            ("        if self.sequence_parallel:\n            weight = tp.copy_to_parallel_region(weight)\n"
             "            bias = None if bias is None else tp.copy_to_parallel_region(bias)\n",
             "        weight = tp.copy_to_parallel_region(weight)\n"
             "        bias = None if bias is None else tp.copy_to_parallel_region(bias)\n"
             "        if self.sequence_parallel:\n")),
        "torch's own dropout (another mask than the single process's)": _edited(
            "ex7-sub-solution",
            ("        return x + tp.sequence_dropout(self.inner(h), self.p, self.seed, start, total)\n",
             "        torch.manual_seed(self.seed)\n        return x + F.dropout(self.inner(h), self.p)\n")),
        "calls the reference": '''
class ParallelSublayer(tp.ParallelSublayer):
    def __init__(self, ln, inner, p=0.0, seed=0, sequence_parallel=False):
        super().__init__(ln, inner, p, seed, sequence_parallel)
''',
    },
    "ex13_8_vocab_cross_entropy": {
        "all-gathers the logits, then the usual softmax": '''
class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, vocab_start):
        parts = [torch.empty_like(local_logits) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local_logits.contiguous())
        full = torch.cat(parts, dim=-1)
        ctx.save_for_backward(full.softmax(-1), targets)
        ctx.cols = (vocab_start, vocab_start + local_logits.shape[-1])
        return F.cross_entropy(full.reshape(-1, full.shape[-1]), targets.reshape(-1), reduction="none").reshape(targets.shape)

    @staticmethod
    def backward(ctx, grad):
        softmax, targets = ctx.saved_tensors
        g = softmax - F.one_hot(targets, softmax.shape[-1]).to(softmax.dtype)
        return (g * grad.unsqueeze(-1))[..., ctx.cols[0]:ctx.cols[1]], None, None
''',
        "no maximum subtracted (overflows for large logits)": _edited(
            "ex8-ce-solution",
            ("        peak = local_logits.max(dim=-1).values.contiguous()\n        dist.all_reduce(peak, op=dist.ReduceOp.MAX)\n",
             "        peak = torch.zeros(local_logits.shape[:-1], dtype=local_logits.dtype, device=local_logits.device)\n")),
        "a target on the upper edge counted by two ranks": _edited(
            "ex8-ce-solution", ("mine = (local_t >= 0) & (local_t < width)", "mine = (local_t >= 0) & (local_t <= width)")),
        "assumes slices of equal width": _edited(
            "ex8-ce-solution", ("        local_t = targets - vocab_start\n",
                                "        local_t = targets - dist.get_rank() * width\n")),
        "backward all-reduces the gradient": _edited(
            "ex8-ce-solution",
            ("        return grad_logits * grad.unsqueeze(-1), None, None\n",
             "        total = grad.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total)\n"
             "        return grad_logits * (total / dist.get_world_size()).unsqueeze(-1), None, None\n")),
        "calls the reference": '''
class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, vocab_start):
        ctx.loss_input = local_logits.detach().requires_grad_(True)
        with torch.enable_grad():
            ctx.loss = tp.vocab_parallel_cross_entropy(ctx.loss_input, targets, vocab_start, reduction="none")
        return ctx.loss.detach()

    @staticmethod
    def backward(ctx, grad):
        (g,) = torch.autograd.grad(ctx.loss, ctx.loss_input, grad)
        return g, None, None
''',
    },
}
