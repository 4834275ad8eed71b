"""u1serve kernels: Triton kernels with torch references and one dispatch per op.

Every op `<name>` runs Triton on CUDA (when triton imports and the shape is supported) and the
torch reference `<name>_ref` elsewhere; `U1SERVE_KERNELS=ref|triton|auto` overrides.
This package imports torch and triton only. API documented in docs/kernels.md.
"""
from ._backend import HAS_TRITON, kernel_mode
from .decode_attention import decode_attention, decode_attention_ref
from .denoise_attention import HAS_FLASH_ATTN, denoise_attention, denoise_attention_ref
from .kv_copy import (
    HostMappedView,
    device_view,
    kv_export,
    kv_export_ref,
    kv_import,
    kv_import_ref,
    kv_write_,
    kv_write_ref_,
    register_host_memory,
    unregister_host_memory,
)
from .moe import fused_moe, fused_moe_ref
from .norm_act import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref, silu_mul, silu_mul_ref
from .prefill_attention import prefill_attention, prefill_attention_ref
from .qk_norm_rope import qk_norm_rope_, qk_norm_rope_ref_, rope_table
from .skinny_gemm import MAX_ROWS as SKINNY_MAX_ROWS
from .skinny_gemm import gated_linear, skinny_linear

__all__ = [
    "HAS_TRITON", "HAS_FLASH_ATTN", "kernel_mode",
    "prefill_attention", "prefill_attention_ref",
    "fused_moe", "fused_moe_ref",
    "denoise_attention", "denoise_attention_ref",
    "decode_attention", "decode_attention_ref",
    "qk_norm_rope_", "qk_norm_rope_ref_", "rope_table",
    "skinny_linear", "gated_linear", "SKINNY_MAX_ROWS",
    "rms_norm", "rms_norm_ref", "add_rms_norm", "add_rms_norm_ref", "silu_mul", "silu_mul_ref",
    "kv_export", "kv_export_ref", "kv_import", "kv_import_ref", "kv_write_", "kv_write_ref_",
    "register_host_memory", "unregister_host_memory", "device_view", "HostMappedView",
]
