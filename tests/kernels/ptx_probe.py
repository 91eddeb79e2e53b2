"""Compile the kernels for sm_90 and sm_80 without a GPU and print PTX facts as JSON (run by test_ptx.py).

Must run without TRITON_INTERPRET: only compiled Triton functions can be lowered to PTX.
"""

import json
import re
from collections import Counter

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tritoff.kernels.quantize import _quantize_rows_kernel
from tritoff.kernels.upcast import _upcast_pack_kernel

ALIGNED = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
UPCAST_SIGNATURE = {"src_ptr": "*u8", "dst_ptr": "*u8", "table_ptr": "*i64", "n_tensors": "i32", "n_chunks": "i32"}
UPCAST_SIGNATURE |= dict.fromkeys(
    (
        "OUT_DTYPE",
        "FP8_DTYPE",
        "MANTISSA_BITS",
        "EXPONENT_BIAS",
        "NATIVE_FP8",
        "MAX_TENSORS",
        "BLOCK",
        "PERSISTENT",
        "CODE_ALIGN",
    ),
    "constexpr",
)
QUANTIZE_CONSTANTS = dict(FMAX_EXP=8, FMAX_MANTISSA=0x600000, MANTISSA_BITS=3, EXPONENT_BIAS=7, MAX_EXP=100, BLOCK=2048)


def facts(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    return {
        "loads": dict(Counter(re.findall(r"ld\.global[.\w]*", ptx))),
        "stores": dict(Counter(re.findall(r"st\.global[.\w]*", ptx))),
        "fp8_cvt": len(re.findall(r"cvt\.[\w.]*e[45]m[23]", ptx)),
        "float_div": len(re.findall(r"div[.\w]*\.f(?:32|64)\b", ptx)),
        "shared_bytes": kernel.metadata.shared,
        "barriers": len(re.findall(r"\bbar\.sync\b", ptx)),
    }


def main() -> None:
    out = {}
    for cc in (90, 80):
        target = GPUTarget("cuda", cc, 32)
        for native in (True, False):
            if native and cc < 89:
                continue
            for out_name, out_dtype, out_size in (
                ("bf16", tl.bfloat16, 2),
                ("fp16", tl.float16, 2),
                ("fp32", tl.float32, 4),
            ):
                for fmt, fp8, mb, eb in (("e4m3", tl.float8e4nv, 3, 7), ("e5m2", tl.float8e5, 2, 15)):
                    constants = dict(
                        OUT_DTYPE=out_dtype,
                        FP8_DTYPE=fp8,
                        MANTISSA_BITS=mb,
                        EXPONENT_BIAS=eb,
                        NATIVE_FP8=native,
                        MAX_TENSORS=16,
                        BLOCK=4096,
                        PERSISTENT=False,
                        CODE_ALIGN=16 // out_size,  # as the launcher sets it (kernels/upcast.py: CODE_LOAD_BYTES)
                    )
                    kernel = triton.compile(
                        ASTSource(_upcast_pack_kernel, UPCAST_SIGNATURE, constants, ALIGNED), target=target
                    )
                    out[f"upcast sm{cc} {'native' if native else 'bits'} {fmt}->{out_name}"] = facts(kernel)
            # the zero-copy launch: a bounded grid striding over the chunks, 8192 units per program
            constants = dict(
                OUT_DTYPE=tl.bfloat16,
                FP8_DTYPE=tl.float8e4nv,
                MANTISSA_BITS=3,
                EXPONENT_BIAS=7,
                NATIVE_FP8=native,
                MAX_TENSORS=16,
                BLOCK=8192,
                PERSISTENT=True,
                CODE_ALIGN=8,
            )
            kernel = triton.compile(ASTSource(_upcast_pack_kernel, UPCAST_SIGNATURE, constants, ALIGNED), target=target)
            out[f"zero-copy sm{cc} {'native' if native else 'bits'} e4m3->bf16"] = facts(kernel)
            # 16-byte code loads (kernels/upcast.py: CODE_LOAD_BYTES = 16), which bench/kernels.py times beside
            constants = dict(constants, BLOCK=4096, PERSISTENT=False, CODE_ALIGN=16)
            kernel = triton.compile(ASTSource(_upcast_pack_kernel, UPCAST_SIGNATURE, constants, ALIGNED), target=target)
            out[f"wide-loads sm{cc} {'native' if native else 'bits'} e4m3->bf16"] = facts(kernel)
            for weight in ("*bf16", "*fp32"):
                signature = {"w_ptr": weight, "q_ptr": "*u8", "scale_ptr": "*fp32", "row_len": "i32"}
                signature |= dict.fromkeys(
                    ("FMAX", *QUANTIZE_CONSTANTS, "FP8_DTYPE", "NATIVE_FP8", "PER_ROW"), "constexpr"
                )
                for per_row in (True, False):
                    constants = dict(
                        QUANTIZE_CONSTANTS, FMAX=448.0, FP8_DTYPE=tl.float8e4nv, NATIVE_FP8=native, PER_ROW=per_row
                    )
                    source = ASTSource(_quantize_rows_kernel, signature, constants, ALIGNED)
                    kernel = triton.compile(source, target=target)
                    scales = "per-row" if per_row else "per-tensor"
                    out[f"quantize sm{cc} {'native' if native else 'bits'} {weight[1:]} {scales}"] = facts(kernel)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
