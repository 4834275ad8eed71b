"""The fp8 producers' launch variants (kernels/fp8_quant.py fp8_launch) and how a profile files their kernels
(bench/genperf_parts.py PROFILE_CATEGORIES). The variants' bits: tests/kernels/interpreted/check_fp8.py."""
import pytest

from bench.genperf_parts import profile_category
from kernels.fp8_quant import FP8_VARIANTS, VARIANT_ENV, fp8_launch


def test_default_launch_keeps_the_row_in_registers_without_padding(monkeypatch):
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    wide, hidden = fp8_launch(12288), fp8_launch(4096)
    assert (wide.variant, wide.block, wide.pieces, wide.even) == ("pieces", 4096, 3, True)
    assert (hidden.variant, hidden.block, hidden.pieces, hidden.even) == ("pieces", 4096, 1, True)
    assert not wide.div_rn and fp8_launch(12288, "legacy").div_rn


@pytest.mark.parametrize("n", [1, 16, 333, 4096, 12288, 16384])
@pytest.mark.parametrize("spec", ["auto", *FP8_VARIANTS, "twopass-1024", "twopass-4096-w8", "pieces-w16"])
def test_every_spec_gives_a_valid_launch(n, spec):
    launch = fp8_launch(n, spec)
    assert launch.warps in (1, 2, 4, 8, 16, 32)
    assert launch.block & (launch.block - 1) == 0 and 1 <= launch.pieces <= 4
    assert launch.block * launch.pieces >= n or launch.twopass
    assert launch.even == (n % launch.block == 0)


def test_the_environment_picks_the_variant(monkeypatch):
    monkeypatch.setenv(VARIANT_ENV, "twopass-1024")
    assert fp8_launch(12288).spec() == "twopass-1024-w4"
    assert fp8_launch(12288, "row").variant == "row"          # an explicit variant wins


@pytest.mark.parametrize("spec", ["fast", "row-1024", "twopass-1000", "twopass-w3", "pieces-16"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError):
        fp8_launch(12288, spec)


KERNELS = {
    "nvjet_sm90_qqtst_128x256_128x6_2x1_v_bz_coopA_TNT": "fp8 GEMM",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "bf16 GEMM",
    "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1": "fp8 GEMM",
    "_silu_mul_fp8_kernel": "silu*mul -> fp8",
    "_silu_mul_fp8_twopass_kernel": "silu*mul -> fp8",
    "_silu_mul_kernel": "silu*mul (bf16)",
    "_rms_norm_kernel": "RMSNorm (bf16 and -> fp8)",
    "_quant_kernel": "fp8 quantiser (standalone)",
    "_quant_twopass_kernel": "fp8 quantiser (standalone)",
    "_norm_rope_kernel": "Q/K norm + RoPE",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0":
        "attention",
    "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda()#14}::operator()() const::{lambda(c10::Float8_e4m3fn)#1}>":
        "copy / index / cat",
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_profile_categories_file_each_kernel_where_it_belongs(name):
    assert profile_category(name) == KERNELS[name]
