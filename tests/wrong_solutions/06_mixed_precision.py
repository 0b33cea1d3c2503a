"""Plausible wrong solutions of chapter 06's exercises (see harness.py)."""

WRONG = {
    "ex06_1_underflow_fraction": {
        "zeros counted in the total": '''
def underflow_fraction(grads, dtype):
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    parts = [g.detach().reshape(-1) for g in grads if g is not None]
    if not parts:
        return 0.0
    x = torch.cat(parts)
    if x.numel() == 0:
        return 0.0
    return float(((x != 0) & (x.to(dtype) == 0)).sum()) / x.numel()
''',
        "a strict threshold: half the smallest subnormal survives (ties to even round it to 0)": '''
def underflow_fraction(grads, dtype):
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    half_sub = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2  # half the smallest subnormal
    flushed, nonzero = 0, 0
    for g in grads:
        if g is None:
            continue
        g = g.detach().reshape(-1).double()
        nz = g != 0
        nonzero += int(nz.sum())
        flushed += int((nz & (g.abs() < half_sub)).sum())
    return flushed / nonzero if nonzero else 0.0
''',
    },
    "ex06_2_update_scale": {
        "grows without checking that the scale stays finite in fp32": '''
def update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return float(np.float32(scale * backoff_factor)), 0
    if growth_tracker + 1 == growth_interval:
        return float(np.float32(scale * growth_factor)), 0
    return scale, growth_tracker + 1
''',
        "keeps counting after growing (the tracker is not reset)": '''
def update_scale(scale, growth_tracker, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return float(np.float32(scale * backoff_factor)), 0
    growth_tracker += 1
    if growth_tracker % growth_interval == 0:
        grown = float(np.float32(scale * growth_factor))
        return (grown if math.isfinite(grown) else scale), growth_tracker
    return scale, growth_tracker
''',
    },
    "ex06_3_mixed_precision_step": {
        "never copies the master weights back into the 16-bit model": '''
def mixed_precision_step(model_lowp, master_params, optimizer, scaler, loss_fn):
    model_lowp.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model_lowp)
    (loss if scaler is None else scaler.scale(loss)).backward()
    for p, m in zip(model_lowp.parameters(), master_params):
        m.grad = torch.zeros_like(m) if p.grad is None else p.grad.float()
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return loss.item()
''',
        "unscales, then steps the optimizer whether or not a gradient overflowed": '''
def mixed_precision_step(model_lowp, master_params, optimizer, scaler, loss_fn):
    model_lowp.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model_lowp)
    (loss if scaler is None else scaler.scale(loss)).backward()
    for p, m in zip(model_lowp.parameters(), master_params):
        m.grad = torch.zeros_like(m) if p.grad is None else p.grad.float()
    if scaler is not None:
        scaler.unscale_(optimizer)
        scaler.update()
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model_lowp.parameters(), master_params):
            p.copy_(m)
    return loss.item()
''',
    },
    "ex06_4_clipped_scaled_step": {
        "clips the scaled gradients, then unscales": '''
def clipped_scaled_step(loss_fn, optimizer, state, max_norm, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=2000):
    optimizer.zero_grad(set_to_none=True)
    (loss_fn() * state["scale"]).backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    found_inf = any(not bool(torch.isfinite(g).all()) for g in grads)
    norm = None
    if not found_inf:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) / state["scale"]
    inv = 1.0 / state["scale"]
    with torch.no_grad():
        for g in grads:
            g.mul_(inv)
    if not found_inf:
        optimizer.step()
    state["scale"], state["growth_tracker"] = mp.update_scale(
        state["scale"], state["growth_tracker"], found_inf, growth_factor, backoff_factor, growth_interval)
    return norm
''',
        "looks for inf but not NaN": '''
def clipped_scaled_step(loss_fn, optimizer, state, max_norm, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=2000):
    optimizer.zero_grad(set_to_none=True)
    (loss_fn() * state["scale"]).backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    found_inf = False
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                found_inf = found_inf or bool(torch.isinf(p.grad).any())
                p.grad.mul_(1.0 / state["scale"])
    norm = None
    if not found_inf:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        optimizer.step()
    state["scale"], state["growth_tracker"] = mp.update_scale(
        state["scale"], state["growth_tracker"], found_inf, growth_factor, backoff_factor, growth_interval)
    return norm
''',
        "returns early on an overflow: the scale never backs off": '''
def clipped_scaled_step(loss_fn, optimizer, state, max_norm, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=2000):
    optimizer.zero_grad(set_to_none=True)
    (loss_fn() * state["scale"]).backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                if not bool(torch.isfinite(p.grad).all()):
                    return None
                p.grad.mul_(1.0 / state["scale"])
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    optimizer.step()
    state["scale"], state["growth_tracker"] = mp.update_scale(
        state["scale"], state["growth_tracker"], False, growth_factor, backoff_factor, growth_interval)
    return norm
''',
        "only the first parameter group": '''
def clipped_scaled_step(loss_fn, optimizer, state, max_norm, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=2000):
    optimizer.zero_grad(set_to_none=True)
    (loss_fn() * state["scale"]).backward()
    params = optimizer.param_groups[0]["params"]
    found_inf = False
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                found_inf = found_inf or not bool(torch.isfinite(p.grad).all())
                p.grad.mul_(1.0 / state["scale"])
    norm = None
    if not found_inf:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        optimizer.step()
    state["scale"], state["growth_tracker"] = mp.update_scale(
        state["scale"], state["growth_tracker"], found_inf, growth_factor, backoff_factor, growth_interval)
    return norm
''',
    },
    "ex06_5_autocast_step": {
        "converts the model to the 16-bit dtype instead of autocasting": '''
def autocast_step(model, optimizer, inputs, targets, dtype=None, scaler=None):
    optimizer.zero_grad(set_to_none=True)
    if dtype is not None:
        model.to(dtype)
    _, loss = model(inputs, targets)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item()
''',
        "ignores the scaler": '''
def autocast_step(model, optimizer, inputs, targets, dtype=None, scaler=None):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    return loss.item()
''',
        "never calls scaler.update()": '''
def autocast_step(model, optimizer, inputs, targets, dtype=None, scaler=None):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(inputs, targets)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
    return loss.item()
''',
    },
    "ex06_6_fp8": {
        "scale from the mean magnitude instead of the amax": '''
def to_fp8(x, dtype=torch.float8_e4m3fn, amax=None):
    largest = torch.finfo(dtype).max
    x32 = x.detach().float()
    amax = x32.abs().mean() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    scale = torch.where(amax > 0, largest / amax, torch.ones_like(amax)).float()
    return (x32 * scale).clamp(-largest, largest).to(dtype), scale


def fp8_matmul(a, b, out_dtype=torch.float32):
    qa, sa = to_fp8(a)
    qb, sb = to_fp8(b)
    if fp8.has_fp8_matmul(a.device):
        return fp8.scaled_mm(qa, qb, sa, sb, out_dtype)
    return ((qa.float() @ qb.float()) / sa / sb).to(out_dtype)
''',
        "no saturation: relies on the cast": '''
def to_fp8(x, dtype=torch.float8_e4m3fn, amax=None):
    largest = torch.finfo(dtype).max
    x32 = x.detach().float()
    amax = x32.abs().max() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    scale = torch.where(amax > 0, largest / amax, torch.ones_like(amax)).float()
    return (x32 * scale).to(dtype), scale


def fp8_matmul(a, b, out_dtype=torch.float32):
    qa, sa = to_fp8(a)
    qb, sb = to_fp8(b)
    if fp8.has_fp8_matmul(a.device):
        return fp8.scaled_mm(qa, qb, sa, sb, out_dtype)
    return ((qa.float() @ qb.float()) / sa / sb).to(out_dtype)
''',
        "an all-zero tensor divides by zero": '''
def to_fp8(x, dtype=torch.float8_e4m3fn, amax=None):
    largest = torch.finfo(dtype).max
    x32 = x.detach().float()
    amax = x32.abs().max() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    scale = (largest / amax).float()
    return (x32 * scale).clamp(-largest, largest).to(dtype), scale


def fp8_matmul(a, b, out_dtype=torch.float32):
    qa, sa = to_fp8(a)
    qb, sb = to_fp8(b)
    if fp8.has_fp8_matmul(a.device):
        return fp8.scaled_mm(qa, qb, sa, sb, out_dtype)
    return ((qa.float() @ qb.float()) / sa / sb).to(out_dtype)
''',
        "scales 16-bit inputs in their own dtype": '''
def to_fp8(x, dtype=torch.float8_e4m3fn, amax=None):
    largest = torch.finfo(dtype).max
    x = x.detach()
    amax = x.abs().max().float() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    scale = torch.where(amax > 0, largest / amax, torch.ones_like(amax)).float()
    return (x * scale).clamp(-largest, largest).to(dtype), scale


def fp8_matmul(a, b, out_dtype=torch.float32):
    qa, sa = to_fp8(a)
    qb, sb = to_fp8(b)
    if fp8.has_fp8_matmul(a.device):
        return fp8.scaled_mm(qa, qb, sa, sb, out_dtype)
    return ((qa.float() @ qb.float()) / sa / sb).to(out_dtype)
''',
        "the amax of the values, not of their magnitudes": '''
def to_fp8(x, dtype=torch.float8_e4m3fn, amax=None):
    largest = torch.finfo(dtype).max
    x32 = x.detach().float()
    amax = x32.max() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    scale = torch.where(amax > 0, largest / amax, torch.ones_like(amax)).float()
    return (x32 * scale).clamp(-largest, largest).to(dtype), scale


def fp8_matmul(a, b, out_dtype=torch.float32):
    qa, sa = to_fp8(a)
    qb, sb = to_fp8(b)
    if fp8.has_fp8_matmul(a.device):
        return fp8.scaled_mm(qa, qb, sa, sb, out_dtype)
    return ((qa.float() @ qb.float()) / sa / sb).to(out_dtype)
''',
        "fp8_matmul quantises with bf16 instead of fp8": '''
def to_fp8(x, dtype=torch.float8_e4m3fn, amax=None):
    largest = torch.finfo(dtype).max
    x32 = x.detach().float()
    amax = x32.abs().max() if amax is None else torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    scale = torch.where(amax > 0, largest / amax, torch.ones_like(amax)).float()
    return (x32 * scale).clamp(-largest, largest).to(dtype), scale


def fp8_matmul(a, b, out_dtype=torch.float32):
    return (a.bfloat16().float() @ b.bfloat16().float()).to(out_dtype)
''',
    },
}
