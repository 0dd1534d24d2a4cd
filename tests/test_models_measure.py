"""models.measure: parameters and multiply-adds, counted by each paper's convention."""
import pytest
import torch
from torch import nn

from models import PaperFacts
from models.measure import count_gmacs, count_params, count_reported_gflops


class ConvLinearMatmul(nn.Module):
    """A 1x1 convolution, a Linear over its channels, and a token-by-token product like attention's QKᵀ."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=1, bias=False)
        self.fc = nn.Linear(4, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.fc(self.conv(images).flatten(2).transpose(1, 2))  # [B, HW, 5]
        return tokens @ tokens.transpose(1, 2)  # [B, HW, HW]


# At 4 x 4 px, 16 positions: conv 16·3·4 = 192, Linear 16·4·5 = 320, product 16·16·5 = 1280 multiply-adds.
CONV_MACS, LINEAR_MACS, MATMUL_MACS = 192, 320, 1280


def test_all_ops_counts_every_multiply_add_once():
    assert count_gmacs(ConvLinearMatmul(), 4, ops="all") * 1e9 == pytest.approx(CONV_MACS + LINEAR_MACS + MATMUL_MACS)


def test_conv_linear_counts_only_convolutions_and_linear_layers():
    assert count_gmacs(ConvLinearMatmul(), 4, ops="conv_linear") * 1e9 == pytest.approx(CONV_MACS + LINEAR_MACS)


def test_multiply_adds_are_per_image():
    assert count_gmacs(ConvLinearMatmul(), 4, batch_size=3) == pytest.approx(count_gmacs(ConvLinearMatmul(), 4))


def test_unknown_convention_is_rejected_naming_the_valid_ones():
    valid = r"\('all', 'conv_linear'\)"
    with pytest.raises(ValueError, match=rf"ops='thop' is not a FLOP-counting convention; valid: {valid}"):
        count_gmacs(ConvLinearMatmul(), 4, ops="thop")


def test_reported_gflops_follow_the_papers_ops_and_flops_per_multiply_add():
    facts = PaperFacts(paper="000", family="test", img_size=4, flop_ops="conv_linear", flops_per_mac=2)
    assert count_reported_gflops(ConvLinearMatmul(), facts) * 1e9 == pytest.approx(2 * (CONV_MACS + LINEAR_MACS))


def test_shared_parameters_count_once():
    shared = nn.Linear(3, 3)
    assert count_params(nn.Sequential(shared, nn.ReLU(), shared)) == 3 * 3 + 3
