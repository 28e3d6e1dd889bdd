"""Dynamic loss scaling schedule (apex defaults): 2**16 start, x2 after N clean steps, x0.5 on overflow, cap 2**24."""
import torch

from aiak.amp import LossScaler


def test_defaults_follow_apex():
    s = LossScaler()
    assert (s.scale, s.growth_interval, s.max_scale) == (2.0 ** 16, 2000, 2.0 ** 24)


def test_grows_after_clean_steps_halves_on_overflow_and_is_capped():
    s = LossScaler(init_scale=2.0 ** 22, growth_interval=3)
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 2.0 ** 23
    s.update(found_inf=True)
    assert s.scale == 2.0 ** 22 and s.clean_steps == 0 and s.skipped_steps == 1
    for _ in range(30):
        s.update(found_inf=False)
    assert s.scale == 2.0 ** 24


def test_static_scale_never_changes_but_still_reports_overflow():
    s = LossScaler(init_scale=128.0, dynamic=False)
    grads = [torch.tensor([256.0, float("inf")])]
    assert LossScaler.check_and_multiply_(grads) is True
    s.update(True)
    assert s.scale == 128.0 and s.skipped_steps == 1


def test_check_and_multiply_scales_in_place_across_dtypes_and_sparse_values():
    a, b = torch.tensor([8.0, 4.0]), torch.tensor([2.0], dtype=torch.float16)
    sparse = torch.sparse_coo_tensor([[0, 2]], [4.0, 8.0], (3,))
    assert LossScaler.check_and_multiply_([a, b, None, sparse], 0.25) is False
    assert a.tolist() == [2.0, 1.0] and b.item() == 0.5 and sparse.to_dense().tolist() == [1.0, 0.0, 2.0]
    assert LossScaler.check_and_multiply_([torch.sparse_coo_tensor([[1]], [float("nan")], (3,))]) is True


def test_state_dict_round_trip():
    s = LossScaler(growth_interval=5)
    s.update(True)
    s.update(False)
    t = LossScaler(growth_interval=5)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.clean_steps, t.skipped_steps) == (s.scale, s.clean_steps, s.skipped_steps)


def test_update_once_takes_one_verdict_per_backward_pass_and_lets_an_overflow_through_after_a_clean_one():
    """Per-parameter optimizers stepped in one backward pass (aiak.amp.scaling.fp16_steps) make one step of the
    schedule: repeated clean verdicts after the same pass count once, repeated overflows halve once, and an overflow
    after a clean verdict of the same pass still backs off; a new pass counts again."""
    s = LossScaler(init_scale=2.0 ** 10, growth_interval=2)
    for _ in range(5):
        s.update_once(False, after_pass=1)
    assert s.clean_steps == 1 and s.scale == 2.0 ** 10
    s.update_once(True, after_pass=1)
    s.update_once(True, after_pass=1)
    assert s.scale == 2.0 ** 9 and s.skipped_steps == 1
    s.update_once(False, after_pass=2)
    s.update_once(False, after_pass=3)
    assert s.scale == 2.0 ** 10  # two clean passes: grown
    s.update(False, after_pass=4)  # the step controller's verdict after pass 4
    s.update_once(False, after_pass=4)
    assert s.clean_steps == 1
