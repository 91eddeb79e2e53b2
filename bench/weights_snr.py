"""Per-weight SNR of fp8 storage: power-of-two row scales vs float row scales vs per-tensor vs the unscaled cast.

Weights are N(0, sigma) for sigma from 0.1 down to 0.002 (the range of real diffusion-transformer weights), plus the
same with a few outlier rows (1% of rows 30x larger). Runs on CPU. Usage: python bench/weights_snr.py [--smoke]
"""

from __future__ import annotations

import torch
from common import markdown_table, out_directory, write_result

from tritoff.arguments import OneLineParser
from tritoff.formats import get_format
from tritoff.kernels.quantize import quantize_reference
from tritoff.snr import snr_db

SIGMAS = (0.1, 0.05, 0.02, 0.01, 0.005, 0.002)
METHODS = ("pow2-row", "float-row", "pow2-tensor", "unscaled")


def dequantize(w: torch.Tensor, fmt, method: str) -> torch.Tensor:
    """Quantize ``w`` with ``method`` and return its dequantized value in fp32."""
    if method == "float-row":  # the non-power-of-two scale: absmax / max exactly (dequantization then rounds)
        scales = w.abs().amax(dim=1, keepdim=True) / fmt.max
        return (w / scales).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() * scales
    granularity = {"pow2-row": "row", "pow2-tensor": "tensor", "unscaled": "none"}[method]
    codes, scales = quantize_reference(w, fmt, granularity)
    return codes.view(fmt.dtype).float() * scales[:, None]


def measure(rows: int, cols: int, seed: int = 0) -> list[dict]:
    """SNR (dB) of every method, format, sigma, with and without outlier rows."""
    gen = torch.Generator().manual_seed(seed)
    results = []
    for outliers in (False, True):
        for sigma in SIGMAS:
            w = torch.randn(rows, cols, generator=gen) * sigma
            if outliers:
                w[torch.randperm(rows, generator=gen)[: max(1, rows // 100)]] *= 30
            w = w.to(torch.bfloat16).float()  # the checkpoint's bf16 values are what gets quantized
            for fmt_name in ("fp8_e4m3", "fp8_e5m2"):
                fmt = get_format(fmt_name)
                for method in METHODS:
                    snr = snr_db(w, dequantize(w, fmt, method))
                    results.append(dict(format=fmt_name, method=method, sigma=sigma, outliers=outliers, snr_db=snr))
    return results


def main() -> None:
    """Measure, print markdown tables, write weights_snr.json into ``--out`` (default: bench/results)."""
    parser = OneLineParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument(
        "--out", type=out_directory, default=None, help="directory for the JSON (default: bench/results)"
    )
    args = parser.parse_args()
    rows, cols = (64, 64) if args.smoke else (2048, 2048)
    results = measure(rows, cols)
    for fmt_name in ("fp8_e4m3", "fp8_e5m2"):
        for outliers in (False, True):
            print(f"\n{fmt_name}, {'1% outlier rows (30x)' if outliers else 'N(0, sigma)'}, {rows}x{cols}, SNR dB")
            table = []
            for sigma in SIGMAS:
                cells = [
                    f"{r['snr_db']:.1f}"
                    for m in METHODS
                    for r in results
                    if r["format"] == fmt_name
                    and r["method"] == m
                    and r["sigma"] == sigma
                    and r["outliers"] == outliers
                ]
                table.append([sigma, *cells])
            print(markdown_table(["sigma", *METHODS], table))
    result = {"shape": [rows, cols], "unit": "dB", "results": results}
    path = write_result("weights_snr", result, smoke=args.smoke, out=args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
