"""Move a CPU model's weights once into one aligned, huge-page-backed block of memory (same values, same objects).

Why: a model loaded from safetensors (transformers maps the file) keeps its weights where the file put them — at
offsets aligned to 8 bytes only, so on SmolLM2 every weight row starts 40 bytes into a 64-byte cache line and every
512-bit load of the verify kernel straddles two lines — and in 4 KiB pages. Measured (2026-12-04, Intel Xeon, one
model whose parameters are swapped between the mapped and the placed storage every round, four interleaved rounds):
the torch backend's passes 1.5-2.5 % faster at every size, 1 and 2 threads (one position, 1 thread: 47.7 -> 46.9 ms);
a matrix held in L2 runs 28 % slower misaligned, so models that stay in cache gain more.

:func:`place_weights` copies every CPU parameter into one anonymous mapping, each tensor at a 4 KiB boundary, the
mapping advised ``MADV_HUGEPAGE`` (Linux with transparent huge pages set to ``madvise`` or ``always``; elsewhere the
advice is skipped and only the alignment remains), and points the parameter at its copy (``param.data``). The
Parameter objects stay the same, so tied weights stay tied, and no value changes. The file mapping is released when
nothing else holds it.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

PAGE = 4096
HUGE_PAGE = 2 << 20
_PLACED = "_kangaroo_weights_placed"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def place_weights(model: torch.nn.Module) -> int:
    """Copy ``model``'s CPU parameters into one aligned huge-page arena (once per model); returns how many moved."""
    if getattr(model, _PLACED, False):
        return 0
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.numel()]  # tied weights appear once
    if not params:
        return 0
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total = _round_up(total + p.numel() * p.element_size(), PAGE)
    # private anonymous memory (mmap's default for -1 is shared memory, which huge pages for anonymous memory skip)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buffer = mmap.mmap(-1, total + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, total + HUGE_PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    shift = (-base) % HUGE_PAGE  # start the arena on a huge-page boundary
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE, shift, total)
        except OSError:  # huge pages unsupported here: alignment alone still helps
            pass
    arena = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the mapping alive as long as any weight does
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            start = shift + offset
            copy = arena[start: start + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            copy.copy_(p.data)
            p.data = copy
    setattr(model, _PLACED, True)
    return len(params)
