"""Chapter 02 (memory math): what training keeps in memory, counted by formula and measured.

Four things fill memory while a model trains: its parameters, their gradients, the optimizer's
states, and the activations that the forward pass saves for the backward pass (plus short-lived
temporary buffers). This module has the formulas (bytes per parameter in each precision regime,
ZeRO's per-GPU sharding, the transformer activation formula of Korthikanti et al. 2022) and the
measurements that check them (autograd's saved tensors, module outputs, optimizer state).

    from course_lib import memory_math as mm
    mm.training_memory(7e9, "mixed_adam").total / 1e9                  # 112.0 (GB)
    mm.zero_memory_per_gpu(7.5e9, stage=3, world_size=64).total / 1e9  # 1.875
    mm.measure_saved_activation_bytes(model, x)                        # what autograd keeps
    mm.saved_bytes_by_module(block, x)                   # {"ln_1": ..., "attn": ...}: who keeps it
    with mm.SavedBytesTracker() as t: loss(model(x)).backward()        # t.peak: live saved bytes
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from course_lib.support.sizes import storage_key, tensor_bytes

__all__ = [
    "OPTIMIZER_STATES",
    "Regime",
    "REGIMES",
    "MemoryBreakdown",
    "bytes_per_param",
    "training_memory",
    "zero_memory_per_gpu",
    "transformer_activation_bytes",
    "linear_weight_grad",
    "is_parameter_storage",
    "SavedTensor",
    "saved_tensors",
    "measure_saved_activation_bytes",
    "saved_bytes_by_module",
    "SavedBytesTracker",
    "forward_hook_activation_bytes",
    "measured_training_memory",
    "cuda_forward_memory",
    "storage_key",  # from course_lib.support.sizes: the identity this chapter counts storages by
]

# Number of fp32 buffers each optimizer keeps per parameter: momentum has a velocity,
# Adam a first and a second moment (AdamW stores the same two).
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}


@dataclass(frozen=True)
class Regime:
    """How a model is trained, as far as memory is concerned.

    ``optimizer`` is a key of OPTIMIZER_STATES. ``mixed_precision`` keeps 16-bit weights and
    gradients for the forward and backward pass and an fp32 master copy of the weights in the
    optimizer. ``fp32_grads`` (mixed precision only) accumulates gradients in fp32 instead.
    """

    name: str
    optimizer: str = "adam"
    mixed_precision: bool = False
    fp32_grads: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")


REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("fp32_sgd", "sgd"),
        Regime("fp32_momentum", "momentum"),
        Regime("fp32_adam", "adam"),
        Regime("mixed_adam", "adam", mixed_precision=True),
        Regime("mixed_adam_fp32_grads", "adam", mixed_precision=True, fp32_grads=True),
    )
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held by parameters, gradients, optimizer states and saved activations; ``total`` adds them."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0

    @property
    def total(self) -> float:
        """Sum of the four parts, in bytes."""
        return self.params + self.grads + self.optimizer + self.activations


def _regime(regime: Regime | str) -> Regime:
    if isinstance(regime, Regime):
        return regime
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; expected a Regime or one of {sorted(REGIMES)}")
    return REGIMES[regime]


# ---- bytes per parameter, training memory, ZeRO --------------------------------------------------

def bytes_per_param(regime: Regime | str) -> MemoryBreakdown:
    """Bytes of weight, gradient and optimizer state that one parameter costs in ``regime``.

    fp32 training: 4 + 4 + 4 per optimizer state. Mixed precision: a 2-byte weight, a 2-byte
    gradient (4 with ``fp32_grads``), and in the optimizer a 4-byte fp32 master weight plus
    4 per state: 2 + 2 + 12 = 16 for Adam (ZeRO paper, Rajbhandari et al. 2020), 18 with fp32 gradients.
    """
    r = _regime(regime)
    states = 4 * OPTIMIZER_STATES[r.optimizer]
    if not r.mixed_precision:
        return MemoryBreakdown(params=4, grads=4, optimizer=states)
    return MemoryBreakdown(params=2, grads=4 if r.fp32_grads else 2, optimizer=4 + states)


def training_memory(num_params: float, regime: Regime | str, activation_bytes: float = 0) -> MemoryBreakdown:
    """Bytes to train ``num_params`` parameters in ``regime`` on one device, with ``activation_bytes`` of saved activations."""
    if num_params < 0 or activation_bytes < 0:
        raise ValueError(f"need num_params >= 0 and activation_bytes >= 0, got {num_params}, {activation_bytes}")
    per = bytes_per_param(regime)
    return MemoryBreakdown(
        params=per.params * num_params,
        grads=per.grads * num_params,
        optimizer=per.optimizer * num_params,
        activations=activation_bytes,
    )


def zero_memory_per_gpu(
    num_params: float, stage: int, world_size: int, regime: Regime | str = "mixed_adam"
) -> MemoryBreakdown:
    """Model-state bytes per GPU under ZeRO ``stage`` (0 = plain data parallel) over ``world_size`` GPUs.

    Stage 1 shards the optimizer states, stage 2 also the gradients, stage 3 also the
    parameters (Rajbhandari et al. 2020). With mixed-precision Adam (K = 12 bytes of optimizer
    state) that is (2+2+K)P, (2+2)P + KP/N, 2P + (2+K)P/N and (2+2+K)P/N bytes.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size}, {num_params}")
    per = bytes_per_param(regime)
    shard = [1.0, 1.0, 1.0]  # fraction of params, grads, optimizer states each GPU holds
    for i in range(3 - stage, 3):
        shard[i] = 1.0 / world_size
    return MemoryBreakdown(
        params=num_params * per.params * shard[0],
        grads=num_params * per.grads * shard[1],
        optimizer=num_params * per.optimizer * shard[2],
    )


def transformer_activation_bytes(
    s: int, b: int, h: int, a: int, L: int = 1, *, attention_scores: bool = True, dropout: bool = True
) -> int:
    """Activation bytes a transformer of ``L`` layers saves, 16-bit values and 1-byte dropout masks.

    Korthikanti et al. (2022): s b h (34 + 5 a s / h) bytes per layer for sequence length s,
    micro-batch b, width h and a heads. 34 s b h are the linear-size tensors (32 without the two
    dropout masks); 5 a s^2 b are softmax output, dropout mask and dropout output of the attention
    scores (2 a s^2 b without dropout). ``attention_scores=False`` models kernels that never store
    the s x s scores (FlashAttention, PyTorch's SDPA) or recompute them (selective recomputation).
    """
    if min(s, b, h, a, L) < 0:
        raise ValueError(f"sizes must not be negative, got s={s}, b={b}, h={h}, a={a}, L={L}")
    linear = (34 if dropout else 32) * s * b * h
    scores = (5 if dropout else 2) * a * s * s * b if attention_scores else 0
    return L * (linear + scores)


# ---- why activations are kept --------------------------------------------------------------------

def linear_weight_grad(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """dL/dW of y = x W^T + b from the layer's input x (..., in) and dL/dy (..., out): grad_out^T @ x, shape (out, in)."""
    return grad_out.reshape(-1, grad_out.shape[-1]).T @ x.reshape(-1, x.shape[-1])


# ---- measuring what is kept ----------------------------------------------------------------------

def _parameter_keys(model: Callable[..., Any] | None) -> set[tuple[str, int]]:
    if isinstance(model, nn.Module):
        return {storage_key(p) for p in model.parameters()}
    return set()


def is_parameter_storage(t: torch.Tensor, parameter_keys: Collection[tuple[str, int]] = ()) -> bool:
    """True when ``t`` lives in a parameter's memory: a Parameter, a view of one, or a storage in ``parameter_keys``.

    Autograd often saves a parameter as a view (a Linear saves ``weight.t()``), so the test looks
    at the tensor a view was taken from, not only at the tensor itself; it works for any callable,
    not only for an ``nn.Module`` whose parameters can be listed. A *copy* of a parameter (the
    bfloat16 weight that autocast makes) is not the parameter's memory and is not matched.
    """
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or storage_key(t) in parameter_keys


@dataclass(frozen=True)
class SavedTensor:
    """One tensor that autograd saved for the backward pass, as the pack hook saw it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int
    storage: tuple[str, int]
    is_parameter: bool
    produced_by: str  # the grad_fn that made it; "leaf" (an input or parameter that requires grad) or "no grad"


def saved_tensors(model: Callable[..., Any], *inputs: Any, **kwargs: Any) -> list[SavedTensor]:
    """Run ``model(*inputs, **kwargs)`` once and list every tensor autograd saves for backward, in order."""
    params = _parameter_keys(model)
    found: list[SavedTensor] = []
    keep: list[torch.Tensor] = []  # holds each storage alive, so that no address is reused meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        key = storage_key(t)
        origin = t.grad_fn.name() if t.grad_fn is not None else ("leaf" if t.requires_grad else "no grad")
        found.append(
            SavedTensor(tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), key, is_parameter_storage(t, params), origin)
        )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs, **kwargs)
    del out  # the graph, and with it autograd's references to the saved tensors
    keep.clear()
    return found


def measure_saved_activation_bytes(model: Callable[..., Any], *inputs: Any) -> int:
    """Bytes of the distinct storages autograd saves in one forward pass of ``model``, parameters excluded."""
    distinct = {r.storage: r.storage_bytes for r in saved_tensors(model, *inputs) if not r.is_parameter}
    return sum(distinct.values())


def saved_bytes_by_module(model: nn.Module, *inputs: Any) -> dict[str, int]:
    """Saved activation bytes of one forward pass, by the innermost module running when each storage was first saved.

    Keys are the names of ``model.named_modules()`` (``""`` for ``model`` itself, for what its own
    forward computes outside its submodules); modules that saved nothing are left out. Storages
    count once, at full size, parameters excluded, as in ``measure_saved_activation_bytes``: the
    values add up to its result. Every hook is removed on return, also when the forward pass raises.
    """
    params = _parameter_keys(model)
    running: list[str] = []  # names of the modules whose forward is under way, innermost last
    charged: dict[tuple[str, int], tuple[str, int]] = {}  # storage -> (module, bytes)
    keep: list[torch.Tensor] = []  # holds each storage alive, so that no address is reused meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        key = storage_key(t)
        if key not in charged and not is_parameter_storage(t, params):
            charged[key] = (running[-1], t.untyped_storage().nbytes())
        return t

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        running.pop()  # a forward hook that returns something replaces the module's output: return None

    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda _m, _a, name=name: running.append(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
        del out
    finally:
        for handle in handles:
            handle.remove()
    ledger: dict[str, int] = {}
    for name, nbytes in charged.values():
        ledger[name] = ledger.get(name, 0) + nbytes
    keep.clear()
    return ledger


class _Held:
    """What the tracker's pack hook hands autograd instead of a saved tensor; freed with the saved variable."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytesTracker:
    """Context manager: live and peak bytes of the tensors autograd holds for backward, parameters excluded.

    Use it around a forward *and* a backward pass. Each saved tensor is counted by its storage
    (views of one storage count once) from the moment autograd saves it until autograd lets it go:
    the pack hook returns a small holder, and the holder's finalizer subtracts the bytes when the
    backward pass (or the end of the graph) frees it. ``live`` is the current total, ``peak`` its
    largest value so far.

    ``torch.utils.checkpoint`` pushes saved-tensor hooks of its own, which hide from an outer hook
    the tensors it recomputes during the backward pass. So while the tracker is active it also
    wraps the pack hook of every saved-tensor hook context entered inside it (checkpoint's
    included): a tensor that such a hook keeps as a tensor counts until that tensor is freed; one
    it swaps for something else (checkpoint's placeholder in the forward pass) does not count.
    Parameters are recognised by ``is_parameter_storage``, plus the parameters of ``model``.
    """

    def __init__(self, model: Callable[..., Any] | None = None) -> None:
        self.live = 0
        self.peak = 0
        self._parameter_keys = _parameter_keys(model)
        self._refs: dict[tuple[str, int], int] = {}
        self._bytes: dict[tuple[str, int], int] = {}
        self._lock = threading.RLock()  # a finalizer may run while this thread holds it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._original_push = torch._C._autograd._push_saved_tensors_default_hooks  # replaced by __enter__

    def _count(self, t: torch.Tensor, anchor: object) -> None:
        if is_parameter_storage(t, self._parameter_keys):
            return
        key, nbytes = storage_key(t), t.untyped_storage().nbytes()
        with self._lock:
            if self._refs.get(key, 0) == 0:
                self._bytes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(anchor, self._release, key)

    def _release(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live -= self._bytes.pop(key)

    def _pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        self._count(t, held)
        return held

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _wrap(self, pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        def counting_pack(t: torch.Tensor) -> Any:
            try:
                kept = pack(t)
            except Exception:
                # checkpoint's recomputation hook stores the last tensor it needs (a detached copy we
                # cannot see), then stops the recomputation by raising: count it while its memory lives
                self._count(t, t.untyped_storage())
                raise
            if isinstance(kept, (torch.Tensor, _Held)):  # _Held: a tracker inside this one
                self._count(t, kept)
            return kept

        return counting_pack

    def __enter__(self) -> SavedBytesTracker:
        self._hooks.__enter__()
        original = self._original_push = torch._C._autograd._push_saved_tensors_default_hooks

        def push(pack_hook: Callable[[torch.Tensor], Any], unpack_hook: Callable[[Any], torch.Tensor]) -> None:
            original(self._wrap(pack_hook), unpack_hook)

        torch._C._autograd._push_saved_tensors_default_hooks = push
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks = self._original_push
        self._hooks.__exit__(exc_type, exc, tb)


def forward_hook_activation_bytes(model: nn.Module, *inputs: Any) -> int:
    """Rough activation count: bytes of what each leaf module returns, summed over the modules without de-duplication."""
    total = 0

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal total
        total += tensor_bytes(output)

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return total


def measured_training_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryBreakdown:
    """Bytes that ``model``'s parameters, their ``.grad`` tensors and ``optimizer``'s state occupy right now."""
    params = list(model.parameters())
    return MemoryBreakdown(
        params=tensor_bytes(params),
        grads=tensor_bytes([p.grad for p in params]),
        optimizer=0 if optimizer is None else tensor_bytes(optimizer.state),
    )


def cuda_forward_memory(model: Callable[..., Any], *inputs: Any) -> tuple[int, int]:
    """On a CUDA device: (bytes still allocated after ``model(*inputs)``, peak bytes during it), both above the start.

    The first number holds the saved activations and the outputs; the second adds the
    temporary buffers that lived only inside the forward pass. One warm-up call runs first, so
    that one-time allocations (such as cuBLAS's workspace) are not counted.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_forward_memory needs a CUDA device")
    warm = model(*inputs)
    del warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = model(*inputs)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return held, peak
