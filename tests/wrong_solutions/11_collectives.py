"""Plausible wrong solutions of chapter 11's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole. Several give the right values on gloo and are caught by their mechanism: a
non-contiguous buffer handed to a transfer (gloo copes, NCCL does not), an all-reduce of the whole
tensor where only a shard should cross the nodes, a reference called in place of the answer.
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("11_collectives")


WRONG = {
    "ex11_1_broadcast_p2p": {
        "sends t as it is (non-contiguous on NCCL)": _edited(
            "ex1-solution", ("dist.send(t.contiguous(), dst)", "dist.send(t, dst)")),
        "receives straight into a non-contiguous t": _edited(
            "ex1-solution", ("buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)",
                             "buf = t")),
        "the root sends only to the next rank": _edited(
            "ex1-solution", ("        for dst in range(world):\n            if dst != src:\n",
                             "        for dst in [(src + 1) % world]:\n            if dst != src:\n")),
        "calls the reference": '''
def broadcast_p2p(t, src=0):
    return coll.broadcast_p2p(t, src)
''',
    },
    "ex11_2_reduce_p2p": {
        "sends t as it is (non-contiguous on NCCL)": _edited(
            "ex2-solution", ("dist.send(t.contiguous(), dst)", "dist.send(t, dst)")),
        "receive buffer keeps t's layout (empty_like)": _edited(
            "ex2-solution", ("buf = torch.empty_like(t, memory_format=torch.contiguous_format)", "buf = torch.empty_like(t)")),
        "sums in float32 (integers and float64 lose exactness)": _edited(
            "ex2-solution", ("    total = t.clone()\n", "    total = t.clone().float()\n")),
        "calls the reference": '''
def reduce_p2p(t, dst=0):
    return coll.reduce_p2p(t, dst)
''',
    },
    "ex11_3_all_gather_p2p": {
        "blocking send then recv around the ring (deadlocks under gloo)": '''
def all_gather_p2p(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = [None] * world
    pieces[rank] = t.clone(memory_format=torch.contiguous_format)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(t, memory_format=torch.contiguous_format)
        if t.numel() > 0:
            dist.send(pieces[send_i], right)
            dist.recv(buf, left)
        pieces[recv_i] = buf
    return pieces
''',
        "its own piece kept with t's layout (sent non-contiguous)": _edited(
            "ex3-solution", ("pieces[rank] = t.clone(memory_format=torch.contiguous_format)", "pieces[rank] = t.clone()")),
        "calls the reference": '''
def all_gather_p2p(t):
    return coll.all_gather_p2p(t)
''',
    },
    "ex11_4_ring_reduce_scatter": {
        "off by one in the receive index: -step + 2 (right on 2 and 4 ranks, wrong on 3)": _edited(
            "ex4-solution", ("recv_i = (rank - step - 1) % world, (rank - step - 2) % world",
                             "recv_i = (rank - step - 1) % world, (rank - step + 2) % world")),
        "blocking send then recv (deadlocks under gloo)": _edited(
            "ex4-solution", ("""        ops = []
        if buf.numel() > 0:
            ops.append(dist.P2POp(dist.irecv, buf, left))
        if acc[send_i].numel() > 0:
            ops.append(dist.P2POp(dist.isend, acc[send_i], right))
        if ops:  # batch_isend_irecv needs at least one operation
            for req in dist.batch_isend_irecv(ops):
                req.wait()
""", """        if acc[send_i].numel() > 0:
            dist.send(acc[send_i], right)
        if buf.numel() > 0:
            dist.recv(buf, left)
""")),
        "chunks cloned with their layout (non-contiguous buffers)": _edited(
            "ex4-solution", ("acc = [c.clone(memory_format=torch.contiguous_format) for c in torch.tensor_split(t, world)]",
                             "acc = [c.clone() for c in torch.tensor_split(t, world)]")),
        "assumes even chunks (chunk(), not tensor_split)": _edited(
            "ex4-solution", ("for c in torch.tensor_split(t, world)]", "for c in torch.chunk(t, world)] + [t[:0]] * world")),
        "calls the reference": '''
def ring_reduce_scatter(t):
    return coll.ring_reduce_scatter(t)
''',
    },
    "ex11_5_ring_all_gather": {
        "left neighbour hard-coded as rank + 3 (right on 2 and 4 ranks, wrong on 3)": _edited(
            "ex5-solution", ("right, left = (rank + 1) % world, (rank - 1) % world",
                             "right, left = (rank + 1) % world, (rank + 3) % world")),
        "assumes equal chunks (sizes[rank] for every part)": _edited(
            "ex5-solution", ("    parts = torch.split(out, list(sizes))\n",
                             "    parts = [out[i * sizes[rank]:(i + 1) * sizes[rank]] for i in range(world)]\n")),
        "sends its own chunk as given (non-contiguous)": _edited(
            "ex5-solution", ("            ops.append(dist.P2POp(dist.isend, parts[send_i], right))",
                             "            ops.append(dist.P2POp(dist.isend, chunk if send_i == rank else parts[send_i],"
                             " right))")),
        "calls the reference": '''
def ring_all_gather(chunk, sizes):
    return coll.ring_all_gather(chunk, sizes)
''',
    },
    "ex11_6_all_to_all_p2p": {
        "blocking send then recv in each step (deadlocks under gloo)": _edited(
            "ex6-solution", ("""        ops = []
        if out[frm].numel() > 0:
            ops.append(dist.P2POp(dist.irecv, out[frm], frm))
        if chunks[to].numel() > 0:
            ops.append(dist.P2POp(dist.isend, chunks[to].contiguous(), to))
        if ops:  # batch_isend_irecv needs at least one operation
            for req in dist.batch_isend_irecv(ops):
                req.wait()
""", """        if chunks[to].numel() > 0:
            dist.send(chunks[to].contiguous(), to)
        if out[frm].numel() > 0:
            dist.recv(out[frm], frm)
""")),
        "sends the chunk meant for the sender of this step (wrong peer, right on 2 ranks)": _edited(
            "ex6-solution", ("ops.append(dist.P2POp(dist.isend, chunks[to].contiguous(), to))",
                             "ops.append(dist.P2POp(dist.isend, chunks[frm].contiguous(), to))"),
            ("        if chunks[to].numel() > 0:\n", "        if chunks[frm].numel() > 0:\n")),
        "receive buffers sized like its own chunks (ignores recv_sizes)": _edited(
            "ex6-solution", ("out[frm] = torch.empty((recv_sizes[frm], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)",
                             "out[frm] = torch.empty_like(chunks[frm], memory_format=torch.contiguous_format)")),
        "sends the chunks as given (non-contiguous on NCCL)": _edited(
            "ex6-solution", ("ops.append(dist.P2POp(dist.isend, chunks[to].contiguous(), to))",
                             "ops.append(dist.P2POp(dist.isend, chunks[to], to))")),
        "posts an empty batch when a pair has nothing to exchange": _edited(
            "ex6-solution", ("        if ops:  # batch_isend_irecv needs at least one operation\n            for req",
                             "        if True:\n            for req")),
        "calls the reference": '''
def all_to_all_p2p(chunks, recv_sizes):
    return coll.all_to_all_p2p(chunks, recv_sizes)
''',
    },
    "ex11_7_hierarchical_all_reduce": {
        "a full all-reduce in each phase (inside the node, then across)": _edited(
            "ex7-solution", ("""    dist.reduce_scatter_tensor(shard, full, group=node)
    dist.all_reduce(shard, group=cross)
    dist.all_gather_into_tensor(full, shard, group=node)
""", """    dist.all_reduce(full, group=node)
    dist.all_reduce(full, group=cross)
""")),
        "all-reduce inside the node, the shard across, then all-gather": _edited(
            "ex7-solution", ("    dist.reduce_scatter_tensor(shard, full, group=node)\n",
                             "    dist.all_reduce(full, group=node)\n"
                             "    shard.copy_(full[dist.get_rank(node) * shard_len:(dist.get_rank(node) + 1) * shard_len])\n")),
        "no padding: assumes the length divides by ranks_per_node": _edited(
            "ex7-solution", ("    shard_len = -(-flat.numel() // p)  # ceil: pad to a multiple of p\n",
                             "    shard_len = flat.numel() // p\n"),
            ("    full[:flat.numel()] = flat\n", "    full[:] = flat[:shard_len * p]\n")),
        "the shard all-reduced over the whole world": _edited(
            "ex7-solution", ("dist.all_reduce(shard, group=cross)", "dist.all_reduce(shard)")),
        "node and cross-node groups swapped (strided nodes)": _edited(
            "ex7-solution", ("        _GROUPS[world, p] = (nodes[rank // p], crosses[rank % p])\n",
                             "        _GROUPS[world, p] = (crosses[rank % p], nodes[rank // p])\n")),
        "calls the reference": '''
def hierarchical_all_reduce(t, ranks_per_node):
    return coll.hierarchical_all_reduce(t, ranks_per_node)
''',
    },
    "ex11_8_hierarchical_allreduce_cost": {
        "the flat ring over all ranks on the inter-node link": '''
def hierarchical_allreduce_cost(n_bytes, nodes, per_node, intra, inter):
    n = nodes * per_node
    return 2 * (n - 1) * (inter[0] + n_bytes / n * inter[1])
''',
        "the intra-node phase counted once (reduce-scatter, no all-gather)": _edited(
            "ex8-solution", ("    return reduce_scatter + across + all_gather\n", "    return reduce_scatter + across\n")),
        "the whole tensor all-reduced across nodes (not the shard)": _edited(
            "ex8-solution", ("    across = 2 * (m - 1) * (alpha_out + shard / m * beta_out)\n",
                             "    across = 2 * (m - 1) * (alpha_out + n_bytes / m * beta_out)\n")),
        "intra and inter links swapped": _edited(
            "ex8-solution", ("    (alpha_in, beta_in), (alpha_out, beta_out) = intra, inter\n",
                             "    (alpha_in, beta_in), (alpha_out, beta_out) = inter, intra\n")),
        "calls the reference": '''
def hierarchical_allreduce_cost(n_bytes, nodes, per_node, intra, inter):
    return coll.hierarchical_allreduce_cost(n_bytes, nodes, per_node, intra, inter)
''',
    },
}
