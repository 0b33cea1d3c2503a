"""What runs the course without being taught in it: import from here, do not copy.

- ``dist``: start ranks from a notebook or a test (``launch``), pick their device and backend.
- ``torchrun``: the same code under ``torchrun`` on a multi-GPU host; the one ``CHECK``/``RESULT``
  report of the self-check entries in ``benchmarks/checks``.
- ``fallback``: lecture cells use the reference while an exercise is not done (``use_or_fallback``).
- ``sizes``: bytes of tensors (``tensor_bytes``, each storage once) and ``human_bytes``.
- ``timeline``: spans on a shared clock (``Timeline``) and their Gantt chart (``plot_gantt``).
- ``comm``: a recorder of the ``torch.distributed`` calls made inside a block (count, bytes, spans, forbid).
- ``timing``: timing a call made by all ranks together (``time_in_ranks``).
- ``records``: the committed records of GPU runs that notebooks render their GPU figures from.
- ``launches``: the Triton launches of a block (compiled or interpreted; guarded, or skipped) and
  the PyTorch operators it runs beside them (``watch_launches``, ``watch_torch``).
"""

__all__ = ["comm", "dist", "fallback", "launches", "records", "sizes", "timeline", "timing", "torchrun"]
