"""tritoff's Triton kernels (shipped as ``tritoff.kernels``), each with its PyTorch reference beside it.

In a source checkout this directory is also importable as a top-level ``kernels`` whenever the repository root is on
``sys.path`` (``python -m`` from the root, pytest), where it shadows Hugging Face's ``kernels`` package: transformers
imports it to read a version. Imported under that name it defines nothing (no version: transformers sees no usable
package), and ``backend.register_op`` never registers an op twice: torch replacing an op's registration would leave
tritoff's handles to it dangling (calls then crash at random).
"""

if __name__ == "tritoff.kernels":
    from .backend import has_triton, interpreting, native_fp8, triton_runs_on
    from .quantize import pow2_exponents, quantize, quantize_reference
    from .upcast import (
        BLOCK,
        BLOCK_ZERO_COPY,
        KIND_COPY,
        KIND_FP8,
        TABLE_COLUMNS,
        ZERO_COPY_PROGRAMS,
        chunk_starts,
        upcast_pack,
        upcast_pack_reference,
        upcast_pack_zero_copy,
    )

    __all__ = [
        "BLOCK",
        "BLOCK_ZERO_COPY",
        "ZERO_COPY_PROGRAMS",
        "KIND_COPY",
        "KIND_FP8",
        "TABLE_COLUMNS",
        "chunk_starts",
        "has_triton",
        "interpreting",
        "native_fp8",
        "pow2_exponents",
        "quantize",
        "quantize_reference",
        "triton_runs_on",
        "upcast_pack",
        "upcast_pack_reference",
        "upcast_pack_zero_copy",
    ]
