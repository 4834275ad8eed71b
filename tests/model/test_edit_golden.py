"""The reference edit (image-to-image) is the official it2i_generate in fp32 on the tiny official-schema checkpoint:
one input image, three-branch CFG (cond, img_cond, uncond). Bit for bit where this host's kernels give the golden
host's bits, else within the measured cross-host error (tests/golden_cases.py, docs/model.md "Bits"). How the
golden was made, and why its harness sets `<img>`'s id: tests/golden/cases/edit_cfg3_img2_64.json."""
import pytest

from tests import golden_cases as G

pytestmark = pytest.mark.usefixtures("default_threads")     # the golden host's bits are at torch's own count


def test_edit_three_branch_cfg_bit_exact():
    model, tok = G.model_tok()
    G.assert_official(G.reference_edit(model, tok, G.request(G.EDIT)), G.official(G.EDIT), "edit")
