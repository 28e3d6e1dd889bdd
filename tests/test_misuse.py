"""Misuse is said, not trained through: ``aiak.optimize`` checks the objects it is given before it chooses or applies
anything (:mod:`aiak.util.arguments`), and a strategy's mistakes, ranges included, are listed at once."""
import pytest
import torch
from torch import nn

import aiak


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _untouched(model):
    return not any("_call_impl" in vars(m) or m._forward_pre_hooks for m in model.modules())


def test_arguments_in_the_wrong_order_are_named():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"wrong order: the first is an optimizer \(SGD\) and the second a model "
                                        r"\(Sequential\)"):
        aiak.optimize(optimizer, model, strategy={"precision": {"level": "O2"}})
    assert _untouched(model) and not hasattr(optimizer, "_aiak_steps")


def test_an_optimizer_of_another_model_is_refused_before_anything_is_applied():
    model, other = _net(0), _net(1)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"none of them the model's .* built for another model"):
        aiak.optimize(model, optimizer, strategy={"precision": {"level": "O2"}, "channels_last": True})
    assert _untouched(model) and not hasattr(optimizer, "_aiak_steps")


def test_a_scheduler_of_another_optimizer_is_refused():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stray = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_net(1).parameters(), lr=0.1), step_size=1)
    with pytest.raises(ValueError, match="scheduler .StepLR. was built on another optimizer"):
        aiak.optimize(model, optimizer, scheduler=stray, strategy="default")
    assert not hasattr(optimizer, "_aiak_steps")


def test_a_model_or_optimizer_of_the_wrong_kind_is_named():
    model = _net()
    with pytest.raises(TypeError, match="first argument must be the model .* got dict"):
        aiak.optimize({"model": model}, strategy="default")
    with pytest.raises(TypeError, match="second argument must be the optimizer, got another model"):
        aiak.optimize(model, _net(1), strategy="default")


def test_a_scheduler_in_the_loader_or_optimizer_slot_is_named_with_where_it_goes():
    """A scheduler passed positionally lands in the loader's (or the optimizer's) slot: it would come back as the
    "loader". It is refused before anything is applied, naming the slot and ``scheduler=``."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    for wrong in (scheduler, plateau):
        with pytest.raises(TypeError, match=rf"third argument \(loader\) is a learning-rate scheduler "
                                            rf"\({type(wrong).__name__}\).*pass it as scheduler="):
            aiak.optimize(model, optimizer, wrong, strategy={"precision": {"level": "O2"}})
    with pytest.raises(TypeError, match=r"second argument \(optimizer\) is a learning-rate scheduler \(StepLR\).*"
                                        r"pass the optimizer there and the scheduler as scheduler="):
        aiak.optimize(model, scheduler, strategy="default")
    assert _untouched(model) and not hasattr(optimizer, "_aiak_steps")
    # where it belongs, it is taken
    model, optimizer, loader, scheduler = aiak.optimize(model, optimizer, scheduler=scheduler, strategy="default")
    assert loader is None and isinstance(scheduler, torch.optim.lr_scheduler.StepLR)


def test_a_model_with_nothing_to_train_is_said_once(warnings_said_again, said):
    model = _net()
    model.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # a backbone frozen for now, unfrozen later
    with said:
        aiak.optimize(model, optimizer, strategy="default")
    assert "no parameter of the model (Sequential) has requires_grad=True" in said.text


def test_an_empty_strategy_file_warns(tmp_path, warnings_said_again, said):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here yet\n")
    with said:
        strategy = aiak.load_strategy(str(empty))
    assert f"{empty} is empty" in said.text and strategy.precision.level == "O0"


def test_range_errors_are_listed_with_every_other_mistake():
    with pytest.raises(aiak.StrategyError) as error:
        aiak.load_strategy({"grad_accumulation": 0, "precision": {"level": "O5"}, "comm": {"bucket_mb": -1}})
    problems = error.value.problems
    assert len(problems) == 3
    assert any("grad_accumulation must be an integer >= 1" in p for p in problems)
    assert any("precision.level must be one of" in p for p in problems)
    assert any("comm.bucket_mb must be > 0" in p for p in problems)


def test_unpacking_into_the_wrong_number_of_names_says_what_optimize_returns_before_applying():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"returns 3 objects, \(model, optimizer, loader\) \(None where one was not "
                                        r"given.*unpacks it into 2 names: write model, optimizer, _ ="):
        model, optimizer = aiak.optimize(model, optimizer, strategy={"precision": {"level": "O2"}})
    assert _untouched(model) and not hasattr(optimizer, "_aiak_steps")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    with pytest.raises(TypeError, match=r"returns 4 objects, \(model, optimizer, loader, scheduler\).* into 3 names"):
        model, optimizer, scheduler = aiak.optimize(model, optimizer, scheduler=scheduler, strategy="default")
    # what every script writes goes through, and so does a result kept whole or indexed
    model, optimizer, loader, scheduler = aiak.optimize(model, optimizer, scheduler=scheduler, strategy="default")
    assert loader is None
    result = aiak.optimize(_net(), strategy="default")
    assert len(result) == 3 and result[1:] == (None, None)
    first = aiak.optimize(_net(), strategy="default")[0]
    assert isinstance(first, nn.Module)


def test_parameters_replaced_after_optimize_are_said_at_the_first_step():
    """``load_state_dict(..., assign=True)`` after ``aiak.optimize`` puts new parameter objects in the model: the
    optimizer holds the old ones and would train nothing (the weights stayed as they were). The first step says so;
    a model whose parameters stayed, and a second optimizer's untouched parameters, train on."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy="default")
    model.load_state_dict(_net(1).state_dict(), assign=True)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="no longer the model's: they were replaced after aiak.optimize"):
        optimizer.step()

    model = _net()
    body, head = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)
    aiak.optimize(model, body, strategy="default")
    aiak.optimize(model, head, strategy="default")
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    body.step()
    head.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
