"""The C argmax (kernels/cpu/argmax.py) against torch's: ties, NaN, infinities, tails past
a whole vector, strided rows, and what it hands to torch."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.argmax import ArgmaxKernel, load_argmax, torch_argmax
from shared.runtime.sampler import Sampler
from shared.runtime.sequence import SamplingParams
from tests.runtime.helpers import built_or_skip


@pytest.fixture(scope="module")
def argmax(tmp_path_factory: pytest.TempPathFactory) -> ArgmaxKernel:
    return built_or_skip(load_argmax(tmp_path_factory.mktemp("kernels")), "torch's max")


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 100, 4096, 4097])
def test_matches_torch_on_random_rows(argmax: ArgmaxKernel, cols: int) -> None:
    x = torch.randn(33, cols, generator=torch.Generator().manual_seed(cols))
    assert argmax(x) == torch_argmax(x)


def test_ties_nan_and_infinities_as_torch_answers(argmax: ArgmaxKernel) -> None:
    rows = torch.zeros(8, 40)
    rows[0, [3, 20, 39]] = 5.0  # ties: the first
    rows[1, 37] = float("inf")
    rows[2, :] = float("-inf")
    rows[3, [2, 30]] = float("nan")  # NaN counts as the maximum: the first NaN
    rows[3, 10] = float("inf")
    rows[4, 35] = float("nan")  # in the tail past the last whole vector
    rows[5, 17:] = 1.0  # the maximum first reached after a whole vector
    rows[6, 0] = -0.0
    rows[7] = torch.arange(40.0).flip(0)
    assert argmax(rows) == torch_argmax(rows) == [3, 37, 0, 2, 35, 17, 0, 0]


def test_strided_rows_and_what_goes_to_torch(argmax: ArgmaxKernel) -> None:
    base = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    view = base[::2, 8:40]  # rows 128 floats apart, columns contiguous
    assert argmax(view) == torch_argmax(view)
    columns_strided = base.t()[:20]
    assert argmax(columns_strided) == torch_argmax(columns_strided)
    assert argmax(base.double()) == torch_argmax(base.double())
    assert argmax(torch.empty(0, 16)) == []


def test_the_sampler_uses_it_for_greedy_rows(argmax: ArgmaxKernel) -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    greedy = [SamplingParams(temperature=0.0)] * 6
    assert Sampler(argmax)(logits, greedy, [0] * 6) == logits.argmax(-1).tolist()
