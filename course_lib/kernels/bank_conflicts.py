"""Chapter 09: shared-memory banks, and a tile layout whose rows and columns a warp reads without conflicts.

NVIDIA's shared memory is split into 32 banks, each 4 bytes wide: the 4-byte word at byte address
``a`` lives in bank ``(a // 4) % 32``, and each bank delivers one word per pass (CUDA C++
Programming Guide, "Shared Memory"). A warp's request therefore takes as many passes as the most
distinct words any one bank must deliver; lanes that touch the same word share it (a broadcast).

- ``shared_memory_passes``: that count, for the addresses of one warp's request;
- ``tile_offset``: a padded layout of a square tile, conflict-free for row and column reads;
- ``fewest_passes``, ``worst_passes`` (``worst_passes_of_table``): the best a warp can do, and how
  a layout does on every row and every column read of a tile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["BANKS", "BANK_BYTES", "WARP", "shared_memory_passes", "tile_offset", "fewest_passes", "worst_passes",
           "worst_passes_of_table"]

BANKS = 32       # banks of shared memory
BANK_BYTES = 4   # bytes each bank delivers per pass
WARP = 32        # lanes per warp


def shared_memory_passes(addresses: Sequence[int | None], access_bytes: int) -> int:
    """Passes the shared memory needs for one warp request: the most distinct 4-byte words in any one bank.

    ``addresses`` holds the byte address each lane reads or writes (``None``: the lane is inactive);
    each lane moves ``access_bytes`` bytes (1, 2, 4, 8 or 16) from an address aligned to that size,
    so an 8-byte access touches two words in two neighbouring banks. 0 when no lane is active.
    """
    if access_bytes not in (1, 2, 4, 8, 16):
        raise ValueError(f"access_bytes must be 1, 2, 4, 8 or 16, got {access_bytes}")
    words_in_bank: dict[int, set[int]] = {}
    for address in addresses:
        if address is None:
            continue
        if address < 0 or address % access_bytes:
            raise ValueError(f"address {address} is not a non-negative multiple of {access_bytes}")
        first, last = address // BANK_BYTES, (address + access_bytes - 1) // BANK_BYTES
        for word in range(first, last + 1):
            words_in_bank.setdefault(word % BANKS, set()).add(word)
    return max((len(words) for words in words_in_bank.values()), default=0)


def tile_offset(row: int, col: int, width: int, elem_bytes: int) -> int:
    """Byte offset of element (row, col) of a ``width x width`` tile in shared memory, rows padded.

    Each row is followed by ``max(4, elem_bytes)`` unused bytes: one bank's width, or one element
    where elements are wider (so that they stay aligned). Then consecutive rows start one or two
    banks apart, and the 32 elements of a column fall into different banks.
    """
    if not (0 <= row < width and 0 <= col < width):
        raise ValueError(f"element ({row}, {col}) is outside a {width} x {width} tile")
    pad = max(BANK_BYTES, elem_bytes)
    return row * (width * elem_bytes + pad) + col * elem_bytes


def fewest_passes(elem_bytes: int) -> int:
    """The passes a full warp needs at best: 32 lanes of ``elem_bytes`` over 32 banks of 4 bytes."""
    return max(1, WARP * elem_bytes // (BANKS * BANK_BYTES))


def worst_passes(offset: Callable[[int, int, int, int], int], width: int, elem_bytes: int) -> tuple[int, int]:
    """(most passes of any row read, most passes of any column read) of a ``width x width`` tile laid out by ``offset``.

    A row read is 32 consecutive elements of one row starting at a multiple of 32; a column read
    is 32 consecutive rows of one column, likewise. ``width`` is a multiple of 32.
    """
    if width % WARP:
        raise ValueError(f"width must be a multiple of {WARP}, got {width}")
    table = [[offset(r, c, width, elem_bytes) for c in range(width)] for r in range(width)]
    return worst_passes_of_table(table, elem_bytes)


def worst_passes_of_table(table: Sequence[Sequence[int]], elem_bytes: int) -> tuple[int, int]:
    """``worst_passes`` for a layout given as its table of byte offsets (``table[row][col]``)."""
    width = len(table)
    rows = max(shared_memory_passes(table[r][c0:c0 + WARP], elem_bytes)
               for r in range(width) for c0 in range(0, width, WARP))
    cols = max(shared_memory_passes([table[r][c] for r in range(r0, r0 + WARP)], elem_bytes)
               for c in range(width) for r0 in range(0, width, WARP))
    return rows, cols
