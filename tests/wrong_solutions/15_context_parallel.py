"""Plausible wrong solutions of chapter 15's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole. Several give the right numbers and miss the mechanism: a transfer waited for at
once (no overlap), a non-contiguous buffer handed to a collective, a ring that goes the wrong way
(the same as the right way with 2 ranks).
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("15_context_parallel")


_FWD_WAIT = '''        o_b, l_b = cp.block_attention(q, k, v, scale=scale)
        out, lse = (o_b, l_b) if out is None else cp.merge_partials([out, o_b], [lse, l_b])
        if pending is not None:
            for req in pending:
                req.wait()
            k, v = k_next, v_next
'''
_CAUSAL_POST = "        pending = cp.ring_shift(kv) if step < world - 1 else None\n"
_CAUSAL_WAIT = "        if pending is not None:\n            kv = pending.wait()\n"
_BWD_POST = "        pending = cp.ring_shift(kv) if step < world - 1 else None  # next step's K/V, while this one computes\n"
_BWD_NONE = "    incoming = None  # the dK/dV accumulators of the next block, on their way from rank - 1\n"
_BWD_ZEROS = ("        dkv = [torch.zeros(k.shape, dtype=dt, device=k.device), "
              "torch.zeros(v.shape, dtype=dt, device=v.device)]\n")
_BWD_ADD = ("        if incoming is not None:  # the block's earlier contributions, arrived while this rank computed\n"
            "            for mine, arrived in zip(dkv, incoming.wait()):\n"
            "                mine.add_(arrived)\n")
_BWD_SEND = "        incoming = cp.ring_shift(dkv)  # on to the next rank, not waited for; after the last step: home\n"
_BWD_HOME = "    dk, dv = incoming.wait()\n"
# The accumulators travel and each shift is waited for at once: right gradients, no dK/dV overlap.
_BWD_TRAVELLING = ((_BWD_NONE, _BWD_ZEROS.replace("        ", "    ", 1)), (_BWD_ZEROS, ""),
                   (_BWD_HOME, "    dk, dv = dkv\n"))
_BWD_DKV = "        dkv = cp.ring_shift(dkv).wait()\n"
_BWD_WAIT = "        if pending is not None:\n            kv = pending.wait()\n"
_S2H_BWD = "        return cp.heads_to_sequence(grad)  # the inverse all-to-all, of the gradient\n"
_H2S_BWD = "        return cp.sequence_to_heads(grad)\n"
_STUBS = '''
class SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError()


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError()
'''

WRONG = {
    "ex15_1_merge_lse": {
        "no guard for rows that saw no key anywhere: -inf - (-inf) gives NaN": _edited(
            "ex1-solution", ("    weights = torch.exp(stacked - safe)\n", "    weights = torch.exp(stacked - lse)\n")),
        "weights normalised by their sum without the logsumexp (0/0 for rows with no key)": _edited(
            "ex1-solution", ("    weights = torch.exp(stacked - safe)\n",
                             "    weights = torch.exp(stacked) / torch.exp(stacked).sum(0)\n")),
        "the lse kept in the outputs' dtype": _edited(
            "ex1-solution", ("    dt = torch.float64 if outs[0].dtype == torch.float64 else torch.float32\n",
                             "    dt = outs[0].dtype\n")),
        "calls the reference": '''
def merge_partials(outs, lses):
    return cp.merge_partials(outs, lses)
''',
    },
    "ex15_2_ring_forward": {
        "the exchange posted, then waited for at once, then the compute (no overlap)": _edited(
            "ex2-solution", (_FWD_WAIT, '''        if pending is not None:
            for req in pending:
                req.wait()
        o_b, l_b = cp.block_attention(q, k, v, scale=scale)
        out, lse = (o_b, l_b) if out is None else cp.merge_partials([out, o_b], [lse, l_b])
        if pending is not None:
            k, v = k_next, v_next
''')),
        "blocking send/recv, even ranks sending first (no overlap)": '''
def ring_attention_forward(q, k, v, scale=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    out, lse = None, None
    k, v = k.contiguous(), v.contiguous()
    for step in range(world):
        o_b, l_b = cp.block_attention(q, k, v, scale=scale)
        out, lse = (o_b, l_b) if out is None else cp.merge_partials([out, o_b], [lse, l_b])
        if step < world - 1:
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            if rank % 2 == 0:
                dist.send(k, (rank + 1) % world); dist.send(v, (rank + 1) % world)
                dist.recv(k_next, (rank - 1) % world); dist.recv(v_next, (rank - 1) % world)
            else:
                dist.recv(k_next, (rank - 1) % world); dist.recv(v_next, (rank - 1) % world)
                dist.send(k, (rank + 1) % world); dist.send(v, (rank + 1) % world)
            k, v = k_next, v_next
    return out.to(q.dtype), lse
''',
        "two ring steps whatever the world size (right for 2 ranks only)": _edited(
            "ex2-solution", ("    for step in range(world):\n", "    for step in range(2):\n"),
            ("        if step < world - 1:", "        if step < 1:")),
        "calls the reference": '''
def ring_attention_forward(q, k, v, scale=None):
    return cp.ring_attention_forward(q, k, v, scale=scale)
''',
    },
    "ex15_3_zigzag": {
        "no check that the rank is in range": _edited(
            "ex3-solution", ("    if world_size < 1 or not 0 <= rank < world_size:\n", "    if world_size < 1:\n")),
        "unshard written for 3-D tensors only": _edited(
            "ex3-solution", ("        full[..., zigzag_indices(n, rank, world), :] = shard\n",
                             "        full[:, zigzag_indices(n, rank, world), :] = shard\n")),
        "calls the reference": '''
def zigzag_indices(n, rank, world_size):
    return cp.zigzag_indices(n, rank, world_size)


def zigzag_unshard(shards):
    return cp.zigzag_unshard(shards)
''',
    },
    "ex15_5_causal_ring": {
        "the exchange posted, then waited for at once (no overlap)": _edited(
            "ex5-solution",
            (_CAUSAL_POST, _CAUSAL_POST + "        arrived = pending.wait() if pending is not None else None\n"),
            (_CAUSAL_WAIT, "        if arrived is not None:\n            kv = arrived\n")),
        "the exchange after the compute (no overlap)": _edited(
            "ex5-solution", (_CAUSAL_POST, ""),
            (_CAUSAL_WAIT, "        if step < world - 1:\n            kv = cp.ring_shift(kv).wait()\n")),
        "the block at step s taken from rank + s (right for 2 ranks only)": _edited(
            "ex5-solution", ("        src = (rank - step) % world\n", "        src = (rank + step) % world\n")),
        "calls the reference": '''
def causal_ring_attention_forward(q, k, v, scale=None):
    return cp.causal_ring_attention_forward(q, k, v, scale=scale)
''',
    },
    "ex15_6_ring_backward": {
        "the K/V exchange posted, then waited for at once (no overlap)": _edited(
            "ex6-solution",
            (_BWD_POST, _BWD_POST + "        arrived = pending.wait() if pending is not None else None\n"),
            (_BWD_WAIT, "        if arrived is not None:\n            kv = arrived\n")),
        "dK/dV passed on and waited for at once (only K/V overlapped)": _edited(
            "ex6-solution", *_BWD_TRAVELLING, (_BWD_ADD + _BWD_SEND, _BWD_DKV)),
        "the incoming dK/dV waited for before the step's compute": _edited(
            "ex6-solution", (_BWD_ADD, ""), (_BWD_ZEROS, _BWD_ZEROS + _BWD_ADD)),
        "K, V, dK and dV sent together after the compute": _edited(
            "ex6-solution", *_BWD_TRAVELLING, (_BWD_POST, ""),
            (_BWD_ADD + _BWD_SEND, "        kv_dkv = cp.ring_shift(kv + dkv).wait()\n        kv, dkv = kv_dkv[:2], kv_dkv[2:]\n"),
            (_BWD_WAIT, "")),
        "no homecoming shift: dK/dV stay where the last step left them": _edited(
            "ex6-solution", (_BWD_SEND, "        incoming = cp.ring_shift(dkv) if step < world - 1 else None\n"),
            (_BWD_HOME, "    dk, dv = dkv\n")),
        "dK/dV accumulated on the rank that computed them, never sent": _edited(
            "ex6-solution", *_BWD_TRAVELLING, (_BWD_ADD + _BWD_SEND, "")),
        "the incoming dK/dV never added: each rank sends only its own contribution": _edited(
            "ex6-solution", (_BWD_ADD, "        if incoming is not None:\n            incoming.wait()\n")),
        "dK/dV sent to rank - 1, against K/V (right for 2 ranks only)": _edited(
            "ex6-solution", (_BWD_SEND, '''        back = [torch.empty_like(t) for t in dkv]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, dkv[0], (rank - 1) % world),
                                        dist.P2POp(dist.isend, dkv[1], (rank - 1) % world),
                                        dist.P2POp(dist.irecv, back[0], (rank + 1) % world),
                                        dist.P2POp(dist.irecv, back[1], (rank + 1) % world)])

        class Later:
            def __init__(self, works, got):
                self.works, self.got = works, got

            def wait(self):
                for w in self.works:
                    w.wait()
                return self.got

        incoming = Later(works, back)
''')),
        "the block at step s taken from rank + s (right for 2 ranks only)": _edited(
            "ex6-solution", ("        src = (rank - step) % world\n", "        src = (rank + step) % world\n")),
        "calls the reference": '''
def ring_attention_backward(q, k, v, out, lse, dout, causal=False, scale=None):
    return cp.ring_attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale)
''',
    },
    "ex15_7_ulysses": {
        "a reshape instead of a transpose of heads and sequence (wrong pieces to each rank)": _edited(
            "ex7-solution",
            ("x.reshape(b, m, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()",
             "x.reshape(world, b, m, h // world, d).contiguous()"),
            ("x.reshape(b, world, m, h // world, d).permute(1, 0, 2, 3, 4).contiguous()",
             "x.reshape(world, b, m, h // world, d).contiguous()")),
        "all_to_all on chunks of the head dimension (non-contiguous views)": '''
def ulysses_attention(q, k, v, causal=False, scale=None):
    world = dist.get_world_size()
    b, m, h, d = q.shape
    if h % world:
        raise ValueError(f"heads H={h} must be divisible by P={world}")

    def sequence_to_heads(x):
        received = [torch.empty(b, m, h // world, x.shape[-1], dtype=x.dtype, device=x.device) for _ in range(world)]
        dist.all_to_all(received, list(x.chunk(world, dim=2)))
        return torch.cat(received, dim=1)

    def heads_to_sequence(x):
        received = [torch.empty(b, m, h // world, x.shape[-1], dtype=x.dtype, device=x.device) for _ in range(world)]
        dist.all_to_all(received, list(x.chunk(world, dim=1)))
        return torch.cat(received, dim=2)

    qh, kh, vh = (sequence_to_heads(t).transpose(1, 2) for t in (q, k, v))
    out, _ = cp.block_attention(qh, kh, vh, causal=causal, scale=scale)
    return heads_to_sequence(out.to(q.dtype).transpose(1, 2))
''',
        "no ValueError when P does not divide H": _edited(
            "ex7-solution", ("    if h % world:\n        raise ValueError", "    if False:\n        raise ValueError")),
        "calls the reference": '''
def ulysses_attention(q, k, v, causal=False, scale=None):
    return cp.ulysses_attention(q, k, v, causal=causal, scale=scale)
''',
    },
    "ex15_8_ulysses_backward": {
        "backward reshapes the gradient locally, no communication": _edited(
            "ex8-solution",
            (_S2H_BWD, "        b, n, hp, d = grad.shape\n"
                       "        return grad.reshape(b, n // dist.get_world_size(), hp * dist.get_world_size(), d)\n"),
            (_H2S_BWD, "        b, m, h, d = grad.shape\n"
                       "        return grad.reshape(b, m * dist.get_world_size(), h // dist.get_world_size(), d)\n")),
        "backward makes the same all-to-all as the forward": _edited(
            "ex8-solution", (_H2S_BWD, "        return cp.heads_to_sequence(grad)\n"),
            (_S2H_BWD, "        return cp.sequence_to_heads(grad)\n")),
        "backward hands non-contiguous chunks of the gradient to dist.all_to_all (gloo takes them, NCCL would not)": _edited(
            "ex8-solution",
            (_S2H_BWD, '''        world = dist.get_world_size()
        received = [torch.empty_like(c, memory_format=torch.contiguous_format) for c in grad.chunk(world, dim=1)]
        dist.all_to_all(received, list(grad.chunk(world, dim=1)))  # rank j gets its tokens of my heads
        return torch.cat(received, dim=2)
'''),
            (_H2S_BWD, '''        world = dist.get_world_size()
        received = [torch.empty_like(c, memory_format=torch.contiguous_format) for c in grad.chunk(world, dim=2)]
        dist.all_to_all(received, list(grad.chunk(world, dim=2)))  # rank j gets my tokens of its heads
        return torch.cat(received, dim=1)
''')),
        "backward all-reduces a zero-padded gradient instead of an all-to-all": _edited(
            "ex8-solution", (_S2H_BWD, '''        world, rank = dist.get_world_size(), dist.get_rank()
        b, n, hp, d = grad.shape
        full = grad.new_zeros(b, n, hp * world, d)
        full[:, :, rank * hp:(rank + 1) * hp] = grad
        dist.all_reduce(full)  # every rank now holds every head's gradient of the whole sequence
        return full.tensor_split(world, dim=1)[rank].contiguous()
''')),
        "gradient divided by the world size (a mean reflex)": _edited(
            "ex8-solution", (_S2H_BWD, "        return cp.heads_to_sequence(grad) / dist.get_world_size()\n")),
        "torch.distributed.nn.functional's all-to-all, whose backward is built in": _STUBS + '''

def ulysses_attention_trainable(q, k, v, causal=False, scale=None):
    import torch.distributed.nn.functional as dist_nn
    world = dist.get_world_size()
    b, m, h, d = q.shape

    def to_heads(x):
        send = x.reshape(b, m, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
        received = dist_nn.all_to_all_single(torch.empty_like(send), send)
        return received.permute(1, 0, 2, 3, 4).reshape(b, world * m, h // world, d)

    def to_sequence(x):
        send = x.reshape(b, world, m, h // world, d).permute(1, 0, 2, 3, 4).contiguous()
        received = dist_nn.all_to_all_single(torch.empty_like(send), send)
        return received.permute(1, 2, 0, 3, 4).reshape(b, m, h, d)

    qh, kh, vh = (to_heads(t).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return to_sequence(out.transpose(1, 2))
''',
        "calls the reference": '''
SequenceToHeads = cp.SequenceToHeads
HeadsToSequence = cp.HeadsToSequence


def ulysses_attention_trainable(q, k, v, causal=False, scale=None):
    return cp.ulysses_attention_trainable(q, k, v, causal=causal, scale=scale)
''',
        "the course's Functions used directly, without Functions of one's own": '''
def ulysses_attention_trainable(q, k, v, causal=False, scale=None):
    qh, kh, vh = (cp.SequenceToHeads.apply(t).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return cp.HeadsToSequence.apply(out.transpose(1, 2))
''',
    },
}
