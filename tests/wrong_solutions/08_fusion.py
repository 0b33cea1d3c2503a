"""Plausible wrong solutions of chapter 08's exercises (see harness.py)."""

_ADD_KERNEL = '''
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)
'''

_BIAS_GELU = '''
@triton.jit
def bias_gelu_kernel(x_ptr, b_ptr, out_ptr, n, n_cols, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets % n_cols, mask=mask, other=0.0).to(tl.float32)
    z = x + b
    y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
'''

_SOFTMAX_KERNEL = '''
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * n_cols + cols, (e / tl.sum(e, axis=0)).to(out_ptr.dtype.element_ty), mask=mask)
'''

_SOFTMAX_BACKWARD_KERNEL = '''
@triton.jit
def softmax_backward_kernel(y_ptr, dy_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + row * n_cols + cols, (y * (dy - tl.sum(dy * y, axis=0))).to(dx_ptr.dtype.element_ty), mask=mask)
'''

_CE_FORWARD_LAUNCHER = '''

def cross_entropy_forward(logits, targets, ignore_index=-100, block_size=1024):
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    block = min(block_size, triton.next_power_of_2(n_cols))
    cross_entropy_fwd_kernel[(n_rows,)](logits, targets, losses, lse, n_cols, ignore_index, BLOCK=block)
    return losses, lse
'''


def _ce_forward(body: str, launcher: str = _CE_FORWARD_LAUNCHER) -> str:
    """A forward kernel with the signature of the exercise and ``body``, and a launcher."""
    return ('''
@triton.jit
def cross_entropy_fwd_kernel(logits_ptr, targets_ptr, loss_ptr, lse_ptr, n_cols, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * n_cols
''' + body + launcher)


_CE_FORWARD_TAIL = '''
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    x_target = tl.load(base + target, mask=valid, other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_target, 0.0))
    tl.store(lse_ptr + row, lse)
'''

_CE_BACKWARD_KERNEL = '''
ce_forward_any = use_or_fallback(cross_entropy_forward, fusion.cross_entropy_forward)


@triton.jit
def cross_entropy_bwd_kernel(logits_ptr, targets_ptr, lse_ptr, scale_ptr, dlogits_ptr, n_cols, ignore_index,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.where(target != ignore_index, tl.load(scale_ptr), 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(logits_ptr + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
        d = (SOFTMAX - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(dlogits_ptr + row * n_cols + cols, d.to(dlogits_ptr.dtype.element_ty), mask=mask)
'''


def _ce(forward: str, backward: str, kernel_softmax: str = "tl.exp(x - lse)") -> str:
    """A full solution cell of exercise 6: the backward kernel, the Function with these bodies, the wrapper."""
    return (_CE_BACKWARD_KERNEL.replace("SOFTMAX", kernel_softmax) + '''

class CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, block_size):
''' + forward + '''
    @staticmethod
    def backward(ctx, grad_loss):
''' + backward + '''

def cross_entropy(logits, targets, ignore_index=-100, block_size=1024):
    return CrossEntropy.apply(logits, targets, ignore_index, block_size)
''')


_CE_FORWARD_BODY = '''        losses, lse = ce_forward_any(logits, targets, ignore_index=ignore_index, block_size=block_size)
        count = (targets != ignore_index).sum()
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.ignore_index, ctx.block_size = ignore_index, block_size
        return losses.sum() / count
'''

_CE_BACKWARD_BODY = '''        logits, targets, lse, count = ctx.saved_tensors
        scale = (grad_loss / count).to(torch.float32).reshape(1)
        n_rows, n_cols = logits.shape
        dlogits = torch.empty_like(logits)
        block = min(ctx.block_size, triton.next_power_of_2(n_cols))
        cross_entropy_bwd_kernel[(n_rows,)](logits, targets, lse, scale, dlogits, n_cols, ctx.ignore_index, BLOCK=block)
        return dlogits, None, None, None
'''

_ADAM_KERNEL_HEAD = '''
@triton.jit
def adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, weight_decay,
                step_size, bias_correction2_sqrt, DECOUPLED: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask)
    g = tl.load(g_ptr + offsets, mask=mask)
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)
'''

_ADAM_LAUNCHER = '''

def adam_step_(params, grads, exp_avg, exp_avg_sq, *, step, lr, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, decoupled=False, block_size=128):
    n = params.numel()
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    adam_kernel[(triton.cdiv(n, block_size),)](
        params, grads, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, weight_decay,
        step_size, bias_correction2_sqrt, DECOUPLED=decoupled, BLOCK=block_size)
'''

_ADAM_UPDATE = '''
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(p_ptr + offsets, p, mask=mask)
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
'''

_ADAM_DECAY = '''    if DECOUPLED:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
'''

WRONG = {
    "ex08_1_add": {
        "the kernel is launched, but the wrapper returns x + y computed by PyTorch": _ADD_KERNEL + '''

def add(x, y, block_size=64):
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block_size),)](x, y, out, n, BLOCK=block_size)
    return x + y
''',
        "the grid counts x.shape[0] instead of x.numel(): a 2-D input is cut short": _ADD_KERNEL + '''

def add(x, y, block_size=64):
    out = torch.empty_like(x)
    n = x.shape[0]
    add_kernel[(triton.cdiv(n, block_size),)](x, y, out, n, BLOCK=block_size)
    return out
''',
        "no mask: the last program reads and writes past the end": '''
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


def add(x, y, block_size=64):
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block_size),)](x, y, out, n, BLOCK=block_size)
    return out
''',
        "block_size is ignored: blocks of 64 whatever the caller asks": _ADD_KERNEL + '''

def add(x, y, block_size=64):
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, 64),)](x, y, out, n, BLOCK=64)
    return out
''',
    },
    "ex08_2_bias_gelu": {
        "the bias is added in PyTorch, the kernel only applies GELU": '''
@triton.jit
def bias_gelu_kernel(x_ptr, b_ptr, out_ptr, n, n_cols, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    z = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu(x, bias, block_size=128):
    z = x + bias
    out = torch.empty_like(x)
    n = x.numel()
    bias_gelu_kernel[(triton.cdiv(n, block_size),)](z, bias, out, n, x.shape[-1], BLOCK=block_size)
    return out
''',
        "the row width is taken as x.shape[1]: right for 2-D inputs only": _BIAS_GELU + '''

def bias_gelu(x, bias, block_size=128):
    out = torch.empty_like(x)
    n = x.numel()
    n_cols = x.shape[1] if x.dim() > 1 else x.shape[0]
    bias_gelu_kernel[(triton.cdiv(n, block_size),)](x, bias, out, n, n_cols, BLOCK=block_size)
    return out
''',
        "the tanh approximation of GELU": '''
@triton.jit
def bias_gelu_kernel(x_ptr, b_ptr, out_ptr, n, n_cols, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    z = tl.load(x_ptr + offsets, mask=mask, other=0.0) + tl.load(b_ptr + offsets % n_cols, mask=mask, other=0.0)
    inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
    t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    tl.store(out_ptr + offsets, 0.5 * z * (1.0 + t), mask=mask)


def bias_gelu(x, bias, block_size=128):
    out = torch.empty_like(x)
    n = x.numel()
    bias_gelu_kernel[(triton.cdiv(n, block_size),)](x, bias, out, n, x.shape[-1], BLOCK=block_size)
    return out
''',
    },
    "ex08_3_softmax": {
        "the output is allocated like x: a transposed input gets a transposed buffer": _SOFTMAX_KERNEL + '''

def softmax(x):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x)
    n_rows, n_cols = x2.shape
    softmax_kernel[(n_rows,)](x2, out, n_cols, BLOCK=triton.next_power_of_2(n_cols))
    return out
''',
        "a view's rows are assumed packed (reshape without contiguous)": _SOFTMAX_KERNEL + '''

def softmax(x):
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    n_rows, n_cols = x2.shape
    softmax_kernel[(n_rows,)](x2, out, n_cols, BLOCK=triton.next_power_of_2(n_cols))
    return out.view(x.shape)
''',
        "in place: the softmax overwrites the input": _SOFTMAX_KERNEL + '''

def softmax(x):
    x2 = x.view(-1, x.shape[-1])
    n_rows, n_cols = x2.shape
    softmax_kernel[(n_rows,)](x2, x2, n_cols, BLOCK=triton.next_power_of_2(n_cols))
    return x
''',
        "the maximum is not subtracted": '''
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    e = tl.exp(tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf")))
    tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


def softmax(x):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    softmax_kernel[(x2.shape[0],)](x2, out, x2.shape[1], BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape)
''',
    },
    "ex08_4_softmax_backward": {
        "dy is reshaped but not made contiguous: a transposed or sliced gradient is read wrongly": _SOFTMAX_BACKWARD_KERNEL + '''

def softmax_backward(y, dy):
    n_cols = y.shape[-1]
    y2, dy2 = y.reshape(-1, n_cols), dy.reshape(-1, n_cols)
    dx = torch.empty_like(y2)
    softmax_backward_kernel[(y2.shape[0],)](y2, dy2, dx, n_cols, BLOCK=triton.next_power_of_2(n_cols))
    return dx.view(y.shape)
''',
        "the row sums are computed in PyTorch, the kernel only does the element-wise part": '''
@triton.jit
def softmax_backward_kernel(y_ptr, dy_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0)
    tl.store(dx_ptr + row * n_cols + cols, y * dy, mask=mask)


def softmax_backward(y, dy):
    n_cols = y.shape[-1]
    shifted = (dy - (dy * y).sum(-1, keepdim=True)).reshape(-1, n_cols).contiguous()
    y2 = y.reshape(-1, n_cols)
    dx = torch.empty_like(y2)
    softmax_backward_kernel[(y2.shape[0],)](y2, shifted, dx, n_cols, BLOCK=triton.next_power_of_2(n_cols))
    return dx.view(y.shape)
''',
    },
    "ex08_5_cross_entropy_forward": {
        "no maximum: log(sum(exp(x))) overflows on large logits": _ce_forward('''
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        s += tl.sum(tl.exp(x), axis=0)
    m = 0.0
''' + _CE_FORWARD_TAIL),
        "the whole row in one block, block_size ignored": _ce_forward('''
    cols = tl.arange(0, BLOCK)
    x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
''' + _CE_FORWARD_TAIL, _CE_FORWARD_LAUNCHER.replace("min(block_size, triton.next_power_of_2(n_cols))",
                                                      "triton.next_power_of_2(n_cols)")),
        "a row is ignored when its target is negative, whatever ignore_index is": _ce_forward('''
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
''' + _CE_FORWARD_TAIL.replace("valid = target != ignore_index", "valid = target >= 0")),
        "the running sum is not rescaled when the maximum grows": _ce_forward('''
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
        s += tl.sum(tl.exp(x - m), axis=0)
''' + _CE_FORWARD_TAIL),
        "one running max and sum per lane, without a guard for lanes that only ever saw -inf": _ce_forward('''
    m_lane = tl.full((BLOCK,), -float("inf"), tl.float32)
    s_lane = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m_lane, x)
        s_lane = s_lane * tl.exp(m_lane - m_new) + tl.exp(x - m_new)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    s = tl.sum(s_lane * tl.exp(m_lane - m), axis=0)
''' + _CE_FORWARD_TAIL),
        "the logsumexp is taken by torch.logsumexp in the launcher": '''
@triton.jit
def cross_entropy_fwd_kernel(logits_ptr, targets_ptr, loss_ptr, lse_ptr, n_cols, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    x_target = tl.load(logits_ptr + row * n_cols + target, mask=valid, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_target, 0.0))


def cross_entropy_forward(logits, targets, ignore_index=-100, block_size=1024):
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    lse = torch.logsumexp(logits.float(), dim=-1)
    cross_entropy_fwd_kernel[(n_rows,)](logits, targets, losses, lse, n_cols, ignore_index, BLOCK=64)
    return losses, lse
''',
    },
    "ex08_6_cross_entropy": {
        "the upstream gradient is taken to be 1": _ce(_CE_FORWARD_BODY, _CE_BACKWARD_BODY.replace(
            "scale = (grad_loss / count).to(torch.float32).reshape(1)", "scale = (1.0 / count).to(torch.float32).reshape(1)")),
        "the count of rows assumes ignore_index is -100": _ce(_CE_FORWARD_BODY.replace(
            "count = (targets != ignore_index).sum()", "count = (targets != -100).sum()"), _CE_BACKWARD_BODY),
        "the softmax in the backward kernel is exp(x) / exp(lse), which overflows": _ce(
            _CE_FORWARD_BODY, _CE_BACKWARD_BODY, kernel_softmax="tl.exp(x) / tl.exp(lse)"),
        "the gradient is computed by PyTorch in backward, after the kernel": _ce(_CE_FORWARD_BODY, '''
        logits, targets, lse, count = ctx.saved_tensors
        scale = (grad_loss / count).to(torch.float32).reshape(1)
        n_rows, n_cols = logits.shape
        dlogits = torch.empty_like(logits)
        block = min(ctx.block_size, triton.next_power_of_2(n_cols))
        cross_entropy_bwd_kernel[(n_rows,)](logits, targets, lse, scale, dlogits, n_cols, ctx.ignore_index, BLOCK=block)
        keep = (targets != ctx.ignore_index).unsqueeze(1)
        grad = torch.softmax(logits.float(), dim=-1) - F.one_hot(targets.clamp(min=0), n_cols)
        return (grad * keep * scale).to(logits.dtype), None, None, None
'''),
        "the forward saves the softmax probabilities for the backward": _ce('''
        losses, lse = ce_forward_any(logits, targets, ignore_index=ignore_index, block_size=block_size)
        count = (targets != ignore_index).sum()
        probs = torch.exp(logits.float() - lse[:, None])
        ctx.save_for_backward(probs, targets, torch.zeros_like(lse), count)
        ctx.ignore_index, ctx.block_size = ignore_index, block_size
        return losses.sum() / count
''', _CE_BACKWARD_BODY, kernel_softmax="x"),
    },
    "ex08_7_adam": {
        "eps is added before dividing by the bias correction": _ADAM_KERNEL_HEAD + _ADAM_DECAY + '''
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / ((tl.sqrt(v) + eps) / bias_correction2_sqrt)
    tl.store(p_ptr + offsets, p, mask=mask)
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
''' + _ADAM_LAUNCHER,
        "the weight-decayed gradient is written back into grads": _ADAM_KERNEL_HEAD + _ADAM_DECAY + '''
    tl.store(g_ptr + offsets, g, mask=mask)
''' + _ADAM_UPDATE + _ADAM_LAUNCHER,
        "Adam and AdamW weight decay swapped": _ADAM_KERNEL_HEAD + '''
    if DECOUPLED:
        g = g + weight_decay * p
    else:
        p = p * (1.0 - lr * weight_decay)
''' + _ADAM_UPDATE + _ADAM_LAUNCHER,
        "the step is done with PyTorch operations; the kernel is launched on copies": _ADAM_KERNEL_HEAD + _ADAM_DECAY
        + _ADAM_UPDATE + '''

def adam_step_(params, grads, exp_avg, exp_avg_sq, *, step, lr, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, decoupled=False, block_size=128):
    n = params.numel()
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    scratch = [t.clone() for t in (params, grads, exp_avg, exp_avg_sq)]
    adam_kernel[(triton.cdiv(n, block_size),)](*scratch, n, lr, beta1, beta2, eps, weight_decay,
                                               step_size, bias_correction2_sqrt, DECOUPLED=decoupled, BLOCK=block_size)
    g = grads + weight_decay * params if not decoupled else grads
    if decoupled:
        params.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    params.addcdiv_(exp_avg, exp_avg_sq.sqrt() / bias_correction2_sqrt + eps, value=-step_size)
''',
    },
}
