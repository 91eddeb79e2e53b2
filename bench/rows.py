"""The row kinds of bench/e2e.py's tables, without importing torch: the GPU suite reads them before its installs."""

TRANSFORMER_ROWS = (
    "resident",
    "tritoff-group",
    "tritoff-auto",
    "tritoff-auto-bounded",  # 1-frame tables only: one row per --upcast-grid share
    "diffusers-bf16-group",
    "diffusers-fp8-group",
    "diffusers-model-offload",
    "tritoff-disk",  # last: the comparison with diffusers comes first when the part's time runs short
)
COMPILE_ROWS = ("resident-compile", "tritoff-group-compile")
PIPELINE_ROWS = ("resident", "tritoff", "diffusers-bf16-group", "diffusers-fp8-group", "diffusers-model-offload")
