"""Accumulation windows that equal the big batch: closed at each epoch's end (timm's rule), and averaged by counted
items (``aiak.count_items``) for mean-over-tokens losses; in one process and on 2x2 gloo ranks.

Tolerances: weights against plain PyTorch to 1e-6 (float32 sums in another order); the controls show the
property is not vacuous (the old behaviour differs by far more than that)."""
import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import aiak
from aiak.step.controller import controller_of
from tests.step import window_data as data

NO_TUNE = {"tune": False}


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _loader(shuffle_seed=0):
    return torch.utils.data.DataLoader(data.samples(20), batch_size=2, shuffle=True,
                                       generator=torch.Generator().manual_seed(shuffle_seed))


def _aiak_epochs(loader, strategy, epochs=2, checkpoint=True):
    model = data.image_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt, loader = aiak.optimize(model, opt, loader, strategy={**NO_TUNE, **strategy})
    stepped, real_steps = [], 0
    for _ in range(epochs):
        with warnings.catch_warnings():
            if checkpoint:  # nothing to say: a clip at the epoch's last step sees a real step's gradient, and a
                warnings.simplefilter("error")  # checkpoint at the epoch's end is no longer inside a window
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                opt.step()
                real_steps += aiak.stepped(opt)
                opt.zero_grad()
            stepped.append(aiak.stepped(opt))
            opt.state_dict()
    return model, stepped, real_steps


# -- epoch ends ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_window_open_at_the_epochs_end_steps_there_averaged_over_what_it_holds(prefetch):
    """10 micro-batches per epoch, accumulation 4, two epochs: windows 4, 4, 2 per epoch (the last averaged over 2),
    as timm's train.py does; with the user's loader as it is and with aiak's prefetching one."""
    reference = data.image_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    epochs = [list(loader) for loader in [_loader()] for _ in range(2)]
    data.epoch_run(reference, ref_opt, epochs, 4)

    model, stepped, real_steps = _aiak_epochs(_loader(), {"grad_accumulation": 4, "loader": {"prefetch": prefetch}})
    assert stepped == [True, True] and real_steps == 6
    assert _max_diff(model, reference) < 1e-6

    across = data.image_model()  # the old behaviour: windows of 4 running on across the epochs
    across_opt = torch.optim.SGD(across.parameters(), lr=0.2, momentum=0.9)
    data.epoch_run(across, across_opt, [epochs[0] + epochs[1]], 4)
    assert _max_diff(across, reference) > 1e-3


class _Batches:
    """A re-iterable of batches, with a len() that may lie, or none."""

    def __init__(self, batches, length=None):
        self.batches, self.length = batches, length
        self.mixup_enabled = True

    def __iter__(self):
        return iter(self.batches)


class _SizedBatches(_Batches):
    def __len__(self):
        return self.length


def test_a_loader_without_len_keeps_windows_running_on_and_says_so_once(warnings_said_again):
    batches = list(_loader())
    with pytest.warns(UserWarning, match="no exact len"):
        model, stepped, _ = _aiak_epochs(_Batches(batches), {"grad_accumulation": 4}, checkpoint=False)
    assert stepped == [False, True]  # 10 + 10 micro-batches: the first epoch's end is inside a window


def test_an_epoch_that_ends_where_len_did_not_say_is_said(warnings_said_again):
    batches = list(_loader())
    with pytest.warns(UserWarning, match="had 10 batches where its len.. says 12"):
        _, stepped, _ = _aiak_epochs(_SizedBatches(batches, 12), {"grad_accumulation": 4}, epochs=1,
                                     checkpoint=False)
    assert stepped == [False]


def test_the_returned_loader_is_the_users_for_everything_but_iteration():
    loader = _loader()
    model = data.image_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, wrapped = aiak.optimize(model, opt, loader, strategy={**NO_TUNE, "grad_accumulation": 2})
    assert wrapped is not loader and len(wrapped) == len(loader) == 10
    assert wrapped.dataset is loader.dataset and wrapped.sampler is loader.sampler and wrapped.batch_size == 2
    own = _SizedBatches(list(loader), 10)
    model = data.image_model()
    _, _, wrapped = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), own,
                                  strategy={**NO_TUNE, "grad_accumulation": 2})
    wrapped.mixup_enabled = False  # timm turns mixup off through the loader it holds
    assert own.mixup_enabled is False


def test_without_a_loader_the_first_step_says_windows_run_on(warnings_said_again):
    model = data.image_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={**NO_TUNE, "grad_accumulation": 2})
    x, y = next(iter(_loader()))
    with pytest.warns(UserWarning, match="without the loader given to aiak.optimize"):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


# -- counted items ------------------------------------------------------------------------------------------
def _token_runs(how, strategy=None, clip=1e9):
    batches = data.rank_batches(0, 1)
    model = data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    count = {"fn": data.count_tokens, "manual": True, "none": None}[how]
    model, opt, loader = aiak.optimize(model, opt, batches, count_items=count,
                                       strategy={**NO_TUNE, "grad_accumulation": 4, **(strategy or {})})
    for batch in loader:
        if how == "manual":
            aiak.count_items(opt, int(data.count_tokens(batch)))
        data.token_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model, opt


def _reference(run=data.big_batch_run, **kw):
    model = data.token_model()
    run(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), data.windows_of(data.rank_batches(0, 1), 4),
        **kw)
    return model


@pytest.mark.parametrize("how,prefetch", [("fn", 0), ("fn", 2), ("manual", 0)])
def test_counted_windows_equal_one_big_batch_of_their_tokens(how, prefetch):
    """Variable-length sequences, a mean-over-tokens loss, accumulation 4: counted, the real step's gradient is
    the one big batch's (one mean over all the window's tokens); uncounted it is the mean of the four means."""
    big = _reference()
    means = _reference(data.mean_of_means_run)
    assert _max_diff(big, means) > 1e-3  # the two differ: the test can fail
    model, _ = _token_runs(how, {"loader": {"prefetch": prefetch}})
    assert _max_diff(model, big) < 1e-6
    uncounted, _ = _token_runs("none")
    assert _max_diff(uncounted, means) < 1e-6


def test_clipping_sees_the_item_weighted_window():
    big = _reference(clip=0.05)
    assert _max_diff(big, _reference()) > 1e-3  # 0.05 clips
    model, _ = _token_runs("fn", clip=0.05)
    assert _max_diff(model, big) < 1e-6


@pytest.mark.filterwarnings("ignore:aiak. precision.dtype fp16")
def test_fp16_loss_scaling_with_thousands_of_items_per_micro_batch_does_not_overflow():
    """The root is the loss scale times the items over a power-of-two reference, not times the items: with ~4000
    items per micro-batch and a scale of 2^16, the product would overflow fp16 on every step."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (3000, 5000, 4100, 3900)]

    def run(strategy):
        model = data.image_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        model, opt, loader = aiak.optimize(model, opt, batches, count_items=lambda b: len(b[1]),
                                           strategy={**NO_TUNE, "grad_accumulation": 4, **strategy})
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model, controller_of(opt)

    fp16, controller = run({"precision": {"level": "O1", "dtype": "fp16", "loss_scale": "dynamic"}})
    fp32, _ = run({})
    assert controller.scaler.skipped_steps == 0 and controller.scaler.scale == 2.0 ** 16
    assert _max_diff(fp16, fp32) < 2e-3


def test_a_checkpoint_inside_a_counted_window_keeps_its_items():
    batches = data.rank_batches(0, 1)
    straight, _ = _token_runs("fn")

    def fresh(loader_batches):
        model = data.token_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        return aiak.optimize(model, opt, loader_batches, count_items=data.count_tokens,
                             strategy={**NO_TUNE, "grad_accumulation": 4})

    def train(model, opt, loader, stop=None):
        for i, batch in enumerate(loader):
            if i == stop:
                break
            data.token_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()

    model, opt, loader = fresh(batches)
    train(model, opt, loader, stop=6)  # one window, then 2 micro-steps into the next
    with pytest.warns(UserWarning, match="micro-step"):
        saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    assert saved["optimizer"]["aiak"]["items"]["counted"] is True
    grads = [p.grad.clone() for p in model.parameters()]
    model, opt, loader = fresh(batches[6:])
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    for p, g in zip(model.parameters(), grads):  # the window's partial sum, as a script saving it would restore it
        p.grad = g
    train(model, opt, loader)
    for p, q in zip(model.parameters(), straight.parameters()):
        assert torch.equal(p, q)


def test_a_window_counted_in_part_is_refused_with_the_fix():
    model = data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={**NO_TUNE, "grad_accumulation": 4}, count_items=True)
    batches = data.rank_batches(0, 1)
    aiak.count_items(opt, 5)
    data.token_loss(model, batches[0]).backward()
    opt.step()
    data.token_loss(model, batches[1]).backward()
    with pytest.raises(RuntimeError, match="micro-step 2 of this 4-step accumulation window was not counted"):
        opt.step()


def test_only_the_counting_optimizers_parameters_are_weighted():
    """One backward through a counted model and a second model of a plain optimizer, plus an input gradient and
    ``torch.autograd.grad``: only the counted model's gradients carry the items (then divided at the step)."""
    torch.manual_seed(0)
    counted, other = nn.Linear(4, 4), nn.Linear(4, 1)
    plain_counted, plain_other = nn.Linear(4, 4), nn.Linear(4, 1)
    plain_counted.load_state_dict(counted.state_dict())
    plain_other.load_state_dict(other.state_dict())
    opt = torch.optim.SGD(counted.parameters(), lr=0.1)
    counted, opt, _ = aiak.optimize(counted, opt, strategy={**NO_TUNE, "grad_accumulation": 2}, count_items=True)
    x = torch.randn(3, 4, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_(True)
    aiak.count_items(opt, 7)
    loss = other(counted(x)).pow(2).mean()
    (by_grad,) = torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    plain_loss = plain_other(plain_counted(x_plain)).pow(2).mean()
    (plain_by_grad,) = torch.autograd.grad(plain_loss, x_plain, retain_graph=True)
    plain_loss.backward()
    torch.testing.assert_close(by_grad, plain_by_grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-6, atol=0)
    for p, q in zip(other.parameters(), plain_other.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    for p, q in zip(counted.parameters(), plain_counted.parameters()):
        torch.testing.assert_close(p.grad, 7 * q.grad, rtol=1e-6, atol=0)  # weighted until the real step


def test_bad_counts_and_arguments_get_one_clear_error():
    model = data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="count_items must be a function"):
        aiak.optimize(model, opt, strategy=NO_TUNE, count_items="tokens")
    with pytest.raises(ValueError, match="pass the loader too"):
        aiak.optimize(model, opt, strategy=NO_TUNE, count_items=data.count_tokens)
    assert not hasattr(opt, "_aiak_steps")  # all or nothing: refused before anything was applied
    aiak.count_items(opt, 3)  # an optimizer aiak did not patch, one process: nothing to weigh
    model, opt, _ = aiak.optimize(model, opt, strategy={**NO_TUNE, "grad_accumulation": 2}, count_items=True)
    with pytest.raises(ValueError, match="finite count >= 0"):
        aiak.count_items(opt, -1)
    with pytest.raises(ValueError, match="one number"):
        aiak.count_items(opt, torch.ones(2))
    with pytest.raises(TypeError, match="a number or a one-element tensor"):
        aiak.count_items(opt, "12")
    aiak.count_items(opt, np.int64(12))  # a count numpy computed is a number
    assert controller_of(opt).items.pending == 12.0


# -- 2x2 gloo ranks -----------------------------------------------------------------------------------------
def _launch(scenario, strategy=None, count="fn", clip=None, world=4):
    from tests.comm.conftest import launch
    from pathlib import Path
    import tempfile

    env = {"AIAK_TEST_STRATEGY": json.dumps({**NO_TUNE, **(strategy or {})}), "AIAK_TEST_COUNT": count,
           "AIAK_TEST_NODE_COUNTS": "1" if count == "node" else None,
           "AIAK_TEST_CLIP": None if clip is None else str(clip)}
    return launch(scenario, Path(tempfile.mkdtemp()), world=world, env=env, timeout=120,
                  worker=Path(__file__).with_name("window_worker.py"))


def _global_reference(world, clip=1e9, run=data.big_batch_run):
    """One process, each window holding every rank's micro-batches of that window."""
    per_rank = [data.rank_batches(r, world) for r in range(world)]
    windows = [[b for r in range(world) for b in per_rank[r][w:w + 4]] for w in range(0, 8, 4)]
    model = data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    run(model, opt, windows, clip=clip) if run is data.big_batch_run else run(model, opt, windows)
    return model.state_dict()


def _close(state, reference, tol=1e-6):
    return max((state[k] - reference[k]).abs().max().item() for k in reference) < tol


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("comm", [{}, {"hierarchical": True}], ids=["flat", "hierarchical"])
def test_counted_windows_on_2x2_ranks_equal_the_global_big_batch(comm):
    reference = _global_reference(4)
    results = _launch("items", {"grad_accumulation": 4, "comm": comm})
    assert all(_close(state, reference) for state in results)
    uncounted = _launch("items", {"grad_accumulation": 4, "comm": comm}, count="none")
    assert not _close(uncounted[0], reference, 1e-4)  # each rank's mean of means is not the global big batch


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("comm,per_node", [
    ({"algorithm": "local_sgd", "local_sgd": {"period": 2, "warmup_steps": 0}}, True),
    ({"algorithm": "decentralized"}, True),
    ({"algorithm": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 2}}, False),
    ({"compression": "int8"}, False),
], ids=["local_sgd", "decentralized", "powersgd", "int8"])
def test_counts_alike_over_the_averaging_ranks_change_nothing_under_every_comm_algorithm(comm, per_node):
    """On 2x2 ranks, micro-batches whose counts are alike over the ranks an algorithm averages gradients over give
    the uncounted weights (1e-6): counted and uncounted windows then average the same gradients. Local SGD
    averages within a node and decentralized SGD not at all, so there each node counts its own number (2 and 4):
    a sum of the items over the whole world would weigh the nodes apart and change the result."""
    results = _launch("equal_counts", {"grad_accumulation": 2, "comm": comm},
                      count="node" if per_node else "fn")
    for r in results:
        assert _close(r[True], r[False]), comm


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_counted_windows_under_a_ddp_without_aiaks_hook_sum_the_items_over_its_group():
    reference = _global_reference(2)
    assert all(_close(state, reference) for state in _launch("items_framework_ddp", world=2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_counted_windows_on_ranks_clip_the_global_big_batchs_gradient():
    reference = _global_reference(4, clip=0.05)
    assert not _close(reference, _global_reference(4), 1e-3)
    assert all(_close(state, reference) for state in _launch("items", {"grad_accumulation": 4}, clip=0.05))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_rank_closes_its_window_at_the_epochs_end():
    world = 4
    results = _launch("epochs", {"grad_accumulation": 4}, world=world)
    assert all(r["stepped"] == [True, True] for r in results)
    dataset = data.samples()
    epochs = []
    for epoch in range(2):
        shards = []
        for rank in range(world):
            sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, seed=3)
            sampler.set_epoch(epoch)
            shards.append(list(torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)))
        epochs.append([(torch.cat([s[i][0] for s in shards]), torch.cat([s[i][1] for s in shards]))
                       for i in range(len(shards[0]))])
    assert len(epochs[0]) == 10
    model = data.image_model()
    data.epoch_run(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), epochs, 4)
    assert all(_close(r["state"], model.state_dict()) for r in results)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loaders_of_unequal_lengths_across_ranks_are_refused_on_every_rank():
    results = _launch("unequal", world=4)
    assert all(r["error"] is not None and "from 7 to 8 batches" in r["error"] for r in results), results
    assert not any(r["wrapped"] for r in results)  # all or nothing: the model is given back unwrapped
