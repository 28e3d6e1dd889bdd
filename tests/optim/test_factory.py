"""Parameter groups (exclusion by module type), ``create`` and ``swap_optimizer`` (the strategy's ``optimizer:``)."""
import pytest
import torch
from torch import nn

from aiak.optim import Lamb, Lars, create, excluded_parameters, layerwise_param_groups, swap_optimizer
from aiak.strategy.schema import OptimizerConfig, Strategy


class FancyNorm(nn.Module):
    """A norm layer from 'another library': not a torch.nn subclass, 2-D scale with an unusual name."""

    def __init__(self, shape):
        super().__init__()
        self.gain_matrix = nn.Parameter(torch.ones(shape))

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True) * self.gain_matrix.mean()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.proj = nn.Linear(4 * 6 * 6, 10, bias=False)
        self.ln2d = nn.LayerNorm((2, 5))  # 2-D weight and bias: excluded by module type only
        self.fancy = FancyNorm((2, 5))     # excluded by class name only
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        x = self.bn(self.conv(x)).relu().flatten(1)
        x = self.fancy(self.ln2d(self.proj(x).view(-1, 2, 5))).flatten(1)
        return self.head(x)


def names(model, params):
    ids = {id(p) for p in params}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_exclusion_by_module_type_not_only_by_name():
    model = Net()
    excluded = names(model, [p for p in model.parameters() if id(p) in excluded_parameters(model)])
    assert excluded == ["bn.bias", "bn.weight", "conv.bias", "fancy.gain_matrix", "head.bias", "ln2d.bias",
                        "ln2d.weight"]
    groups = layerwise_param_groups(model, weight_decay=0.05)
    assert names(model, groups[0]["params"]) == ["conv.weight", "head.weight", "proj.weight"]
    assert groups[0]["weight_decay"] == 0.05 and "adapt" not in groups[0]
    assert groups[1]["weight_decay"] == 0.0 and groups[1]["adapt"] is False


def test_create_by_name():
    model = Net()
    opt = create("LAMB", model, lr=1e-3, weight_decay=0.01)
    assert isinstance(opt, Lamb)
    assert [(g["weight_decay"], g["adapt"]) for g in opt.param_groups] == [(0.01, True), (0.0, False)]
    opt = create("lars", model.parameters(), lr=0.1, exclude_bias_and_norm=False)
    assert isinstance(opt, Lars) and len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"create\(name\) must be one of \['lamb', 'lars'\]"):
        create("adam", model, lr=1e-3)
    with pytest.raises(ValueError, match=r"momentum: unknown hyper-parameter for lamb; valid keys: \['lr'"):
        create("lamb", model, lr=1e-3, momentum=0.9)


def optimizer_config(**section):
    return Strategy.from_dict({"optimizer": section}).optimizer


def test_keep_returns_the_same_object():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert swap_optimizer(model, opt, optimizer_config(name="keep")) is opt
    assert swap_optimizer(model, None, optimizer_config(name="keep")) is None


def test_swap_sgd_to_lars_keeps_lrs_groups_and_momentum():
    model = Net()
    backbone = [model.conv.weight, model.conv.bias, model.bn.weight, model.bn.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in backbone)]
    sgd = torch.optim.SGD([{"params": backbone, "lr": 0.01, "tag": "backbone"}, {"params": rest}],
                          lr=0.1, momentum=0.8, nesterov=True, weight_decay=5e-5, dampening=0.0)
    lars = swap_optimizer(model, sgd, optimizer_config(name="lars", trust_coefficient=0.02))
    assert isinstance(lars, Lars)
    summary = [(names(model, g["params"]), g["lr"], g["weight_decay"], g["adapt"], g["momentum"], g["nesterov"],
                g["trust_coefficient"], g.get("tag")) for g in lars.param_groups]
    assert summary == [
        (["conv.weight"], 0.01, 5e-5, True, 0.8, True, 0.02, "backbone"),
        (["bn.bias", "bn.weight", "conv.bias"], 0.01, 0.0, False, 0.8, True, 0.02, "backbone"),
        (["head.weight", "proj.weight"], 0.1, 5e-5, True, 0.8, True, 0.02, None),
        (["fancy.gain_matrix", "head.bias", "ln2d.bias", "ln2d.weight"], 0.1, 0.0, False, 0.8, True, 0.02, None),
    ]
    assert "dampening" not in lars.param_groups[0]


def test_swap_adamw_to_lamb_carries_betas_and_strategy_values_win():
    model = Net()
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.95), weight_decay=0.02, eps=1e-8)
    lamb = swap_optimizer(model, adamw, optimizer_config(name="lamb", weight_decay=0.1, max_grad_norm=1.0))
    assert isinstance(lamb, Lamb) and lamb.max_grad_norm == 1.0
    g = lamb.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"], g["eps"], g["adapt"]) == (3e-4, (0.8, 0.95), 0.1, 1e-6, True)
    assert "amsgrad" not in g
    assert lamb.param_groups[1]["weight_decay"] == 0.0 and lamb.param_groups[1]["adapt"] is False


def test_swapped_optimizer_steps_like_a_hand_built_one():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 3, 8, 8)
    twin = Net()
    twin.load_state_dict(model.state_dict())
    swapped = swap_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0),
                             optimizer_config(name="lamb", weight_decay=0.01, betas=[0.9, 0.99]))
    manual = Lamb(layerwise_param_groups(twin, weight_decay=0.01), lr=1e-2, betas=(0.9, 0.99))
    for _ in range(3):
        for m, opt in ((model, swapped), (twin, manual)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(model.conv.weight, Net().conv.weight)


def test_no_user_optimizer_needs_lr():
    model = Net()
    lars = swap_optimizer(model, None, optimizer_config(name="lars", lr=0.2))
    assert isinstance(lars, Lars) and {g["lr"] for g in lars.param_groups} == {0.2}
    assert sum(len(g["params"]) for g in lars.param_groups) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="optimizer.lr is required"):
        swap_optimizer(model, None, optimizer_config(name="lamb"))


@pytest.mark.parametrize("section, match", [
    (dict(name="lamb", momentum=0.9), r"optimizer\.momentum: unknown hyper-parameter for lamb; valid keys: \["),
    (dict(name="lars", betas=[0.9, 0.99]), r"optimizer\.betas: unknown hyper-parameter for lars"),
    (dict(name="lamb", betas=[0.9, 1.5]), r"optimizer\.betas: betas\[1\] must be a number in \[0.0, 1.0\)"),
    (dict(name="lamb", betas=0.9), r"optimizer\.betas"),
    (dict(name="lars", weight_decay=-1), r"optimizer\.weight_decay"),
    (dict(name="lars", nesterov="yes"), r"optimizer\.nesterov must be true or false"),
    (dict(name="lamb", lr="fast"), r"optimizer\.lr"),
])
def test_bad_hyperparameters_name_optimizer_key(section, match):
    """The same rules at load time (the strategy) and at swap time (a config built in code)."""
    with pytest.raises(ValueError, match=match):
        optimizer_config(**section)
    model = Net()
    unchecked = OptimizerConfig(name=section.pop("name"), hyperparameters=section)
    with pytest.raises(ValueError, match=match):
        swap_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), unchecked)


def test_existing_state_is_dropped_with_a_warning():
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    sgd.step()
    with pytest.warns(UserWarning, match="fresh state"):
        swap_optimizer(model, sgd, optimizer_config(name="lars"))


def test_users_own_no_decay_group_keeps_zero_decay():
    model = Net()
    no_decay = [model.proj.weight]  # e.g. an embedding the user keeps out of decay
    rest = [p for p in model.parameters() if p is not model.proj.weight]
    adamw = torch.optim.AdamW([{"params": rest, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-3)
    lamb = swap_optimizer(model, adamw, optimizer_config(name="lamb", weight_decay=0.1))
    decay = {n: g["weight_decay"] for g in lamb.param_groups for n in names(model, g["params"])}
    assert decay["proj.weight"] == 0.0 and decay["conv.weight"] == 0.1 and decay["head.weight"] == 0.1
    # a user optimizer without any decay gets the strategy's decay on every weight
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    lars = swap_optimizer(model, sgd, optimizer_config(name="lars", weight_decay=1e-4))
    assert lars.param_groups[0]["weight_decay"] == 1e-4
