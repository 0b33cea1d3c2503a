"""Plausible wrong solutions of chapter 02's measuring exercises (see harness.py)."""

_MEASURE = '''
import torch
from torch import nn


def measure_saved_activation_bytes(model, *inputs):
    params = {(p.device, p.untyped_storage().data_ptr()) for p in model.parameters()} if isinstance(model, nn.Module) else set()
    recorded = []

    def pack(t):
        recorded.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
'''

# The ledger with three places to go wrong: how a storage is keyed, whom it is charged to, what it weighs.
_LEDGER = '''
import torch
from torch import nn


def saved_bytes_by_module(model, *inputs):
    def key(t):
        return KEY

    params = {key(p) for p in model.parameters()}
    running = []
    charged = {}
    recorded = []

    def pack(t):
        recorded.append(t)
        if CHARGE_IF:
            charged[key(t)] = (WHO, SIZE)
        return t

    def leave(module, args, output):
        running.pop()

    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda module, args, name=name: running.append(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    ledger = {}
    for name, nbytes in charged.values():
        ledger[name] = ledger.get(name, 0) + nbytes
    return ledger
'''
_RIGHT = {"KEY": "(t.device, t.untyped_storage().data_ptr())",
          "CHARGE_IF": "key(t) not in charged and key(t) not in params",
          "WHO": "running[-1]", "SIZE": "t.untyped_storage().nbytes()"}


def _ledger(**changes: str) -> str:
    source = _LEDGER
    for name, value in {**_RIGHT, **changes}.items():
        source = source.replace(name, value)
    return source


_STACKLESS = '''
import torch
from torch import nn


def saved_bytes_by_module(model, *inputs):
    def key(t):
        return (t.device, t.untyped_storage().data_ptr())

    params = {key(p) for p in model.parameters()}
    current = [""]
    charged = {}
    recorded = []

    def pack(t):
        recorded.append(t)
        if key(t) not in charged and key(t) not in params:
            charged[key(t)] = (current[0], t.untyped_storage().nbytes())
        return t

    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda module, args, name=name: current.__setitem__(0, name)))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    ledger = {}
    for name, nbytes in charged.values():
        ledger[name] = ledger.get(name, 0) + nbytes
    return ledger
'''

WRONG = {
    "ex02_4_saved_activation_bytes": {
        "keyed by the tensor's data_ptr: views of one storage count again": _MEASURE.replace(
            "params = {(p.device, p.untyped_storage().data_ptr())", "params = {(p.device, p.data_ptr())") + '''
    distinct = {(t.device, t.data_ptr()): t.untyped_storage().nbytes()
                for t in recorded if (t.device, t.data_ptr()) not in params}
    return sum(distinct.values())
''',
        "each saved view's own bytes, not its storage's": _MEASURE + '''
    distinct = {}
    for t in recorded:
        k = (t.device, t.untyped_storage().data_ptr())
        if k not in params:
            distinct[k] = t.numel() * t.element_size()
    return sum(distinct.values())
''',
        "parameters counted": _MEASURE + '''
    distinct = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in recorded}
    return sum(distinct.values())
''',
        "every saved tensor, no de-duplication": _MEASURE + '''
    return sum(t.untyped_storage().nbytes() for t in recorded
               if (t.device, t.untyped_storage().data_ptr()) not in params)
''',
    },
    "ex02_5_saved_bytes_by_module": {
        "charged to the last module that saves a storage": _ledger(CHARGE_IF="key(t) not in params"),
        "keyed by the tensor's data_ptr: Q, K and V count three times": _ledger(KEY="(t.device, t.data_ptr())"),
        "parameters charged too": _ledger(CHARGE_IF="key(t) not in charged"),
        "a saved view's own bytes, not its storage's": _ledger(SIZE="t.numel() * t.element_size()"),
        "charged to the top-level child": _ledger(WHO="running[1] if len(running) > 1 else ''"),
        "charged to the outermost module, the model itself": _ledger(WHO="running[0]"),
        "named by class, not by qualified name": _ledger(
            WHO="running[-1]", **{"running.append(name)": "running.append(type(module).__name__)"}),
        "no stack: the module that started last, even after it finished": _STACKLESS,
        "nothing kept alive: a freed storage's address is reused": _ledger().replace("recorded.append(t)", "pass"),
        "hooks never removed": _ledger().replace("handle.remove()", "pass"),
        "hooks removed only when the forward pass succeeds": _ledger().replace(
            "    try:\n", "    if True:\n").replace("    finally:\n", "    if True:\n"),
        "the error of a failing forward pass swallowed": _ledger().replace(
            "            model(*inputs)\n",
            "            try:\n                model(*inputs)\n            except Exception:\n                pass\n"),
        "calls the course's reference": '''
from course_lib import memory_math


def saved_bytes_by_module(model, *inputs):
    return memory_math.saved_bytes_by_module(model, *inputs)
''',
        "the total of Exercise 4 charged to the model itself": '''
from course_lib import memory_math


def saved_bytes_by_module(model, *inputs):
    total = memory_math.measure_saved_activation_bytes(model, *inputs)
    return {"": total} if total else {}
''',
    },
}
