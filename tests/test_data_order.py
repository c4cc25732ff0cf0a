"""The training data order (tetrad.train.data.TokenWindows): every epoch visits every window once,
in its own permutation of (seed, epoch); the batch of a step is a pure function of (seed, step),
whatever was asked before it. Tokens are their own positions, so a window names its start."""

import numpy as np
import pytest
import torch

from tetrad.errors import ConfigError
from tetrad.train.data import TokenWindows

SEQ_LEN, NUM_WINDOWS, EPOCHS = 4, 10, 4


def windows(seed: int, extra_tokens: int = 1) -> TokenWindows:
    return TokenWindows(np.arange(NUM_WINDOWS * SEQ_LEN + extra_tokens), SEQ_LEN, seed)


def epoch_order(data: TokenWindows, epoch: int) -> list[int]:
    """The window indices epoch `epoch` visits, in order (from each window's first token)."""
    first = epoch * data.num_windows
    return [int(data.window(first + i)[0]) // SEQ_LEN for i in range(data.num_windows)]


def test_every_epoch_is_a_permutation_of_all_windows_and_epochs_differ():
    data = windows(seed=3)
    orders = [epoch_order(data, epoch) for epoch in range(EPOCHS)]
    for order in orders:
        assert sorted(order) == list(range(NUM_WINDOWS))
    # 10! orders: two epochs agreeing would be a fluke, not chance.
    assert len({tuple(order) for order in orders}) == EPOCHS
    assert all(order != sorted(order) for order in orders)  # shuffled, not corpus order


def test_the_order_is_a_function_of_seed_and_epoch_only():
    data, again = windows(seed=3), windows(seed=3)
    # Asked in another order (the permutation cache holds one epoch), the same windows.
    backwards = {epoch: epoch_order(again, epoch) for epoch in reversed(range(EPOCHS))}
    assert [backwards[epoch] for epoch in range(EPOCHS)] == [
        epoch_order(data, epoch) for epoch in range(EPOCHS)]
    assert epoch_order(windows(seed=4), 0) != epoch_order(data, 0)


def test_windows_are_consecutive_tokens_with_one_shifted_target_and_none_is_left_out():
    for extra in (1, SEQ_LEN):  # one token past the last window, or a partial window's worth
        data = windows(seed=0, extra_tokens=extra)
        assert data.num_windows == NUM_WINDOWS
        for index in range(data.num_windows):
            window = data.window(index)
            start = int(window[0])
            assert start % SEQ_LEN == 0
            assert window.tolist() == list(range(start, start + SEQ_LEN + 1))
    with pytest.raises(ConfigError, match="too few"):
        TokenWindows(np.arange(SEQ_LEN), SEQ_LEN, 0)


def test_a_batch_across_an_epoch_boundary_continues_into_the_next_epochs_order():
    data, batch_size = windows(seed=7), 4
    steps = [data.batch(step, batch_size) for step in range(5)]  # 20 samples: two epochs
    assert all(batch.shape == (batch_size, SEQ_LEN + 1) and batch.dtype == torch.int64
               for batch in steps)
    visited = [int(row[0]) // SEQ_LEN for batch in steps for row in batch]
    assert visited == epoch_order(data, 0) + epoch_order(data, 1)
    # The step's batch alone, later, from a fresh loader: what a resumed run reads.
    assert torch.equal(windows(seed=7).batch(3, batch_size), steps[3])
