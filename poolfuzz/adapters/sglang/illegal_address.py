"""The GPU's illegal memory access, as the CPU stand-ins for SGLang's kernels raise it."""


class IllegalAddress(RuntimeError):
    """A kernel (a CPU copy standing in for one, or an interpreted Triton kernel) touched bytes outside the memory it
    may address: on a GPU, a CUDA illegal memory access."""
