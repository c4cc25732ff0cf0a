"""triton and triton.language where they import, else stand-ins with which Triton kernels can still
be defined (and are never launched): the engine and the models run without triton."""

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _NoTriton:
        """Stands in for triton and triton.language so that kernels can be defined."""
        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _NoTriton()

__all__ = ["HAS_TRITON", "tl", "triton"]
