"""How many variants of encore's Triton kernels have been compiled.

Triton compiles a kernel once per *variant*: its constexpr values plus what it specializes its other
arguments on (integers equal to 1 or divisible by 16, pointers aligned to 16 bytes). A compile takes
one to two seconds without a warm disk cache, so a variant first met while serving stalls every
running request for that long. encore's kernels therefore leave the integers and index pointers that
vary from step to step unspecialized and derive their constexprs from the model and a few fixed
buckets; the engine runs every reachable variant at start-up (``ModelRunner.warm_up_kernels``) and
reports, through ``compiled_variants``, any that is compiled after that.

Kept free of a triton import: an engine without CUDA never loads the kernels and counts nothing.
"""

from __future__ import annotations

from typing import TypeVar

_KERNELS: list = []
K = TypeVar("K")


def watched(kernel: K) -> K:
    """Decorator (outside ``triton.jit``): counts the kernel's variants in ``compiled_variants``."""
    _KERNELS.append(kernel)
    return kernel


def compiled_variants() -> int:
    """Variants of the watched kernels this process holds, on every device (a variant loaded from
    Triton's disk cache counts too: it is a compile's worth of lookups, not of seconds)."""
    # JITFunction.device_caches: device -> (kernel cache, ...); the interpreter's kernels have none.
    return sum(len(caches[0]) for kernel in _KERNELS for caches in getattr(kernel, "device_caches", {}).values())
