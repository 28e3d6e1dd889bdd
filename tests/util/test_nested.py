"""``aiak.util.nested.map_tensors`` on dataclass outputs: every field kept (``init=False`` ones too, their tensors
mapped), no second ``__init__`` / ``__post_init__``, frozen dataclasses, Hugging Face ``ModelOutput`` (a dataclass
that is an ``OrderedDict``), namedtuples; and such an output through an O2 bf16 model."""
import dataclasses
import itertools
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest
import torch
from torch import nn

import aiak
from aiak.util.nested import iter_tensors, map_tensors

_serial = itertools.count()
_post_inits: List[str] = []  # what each __post_init__ ran for (a side effect a copy must not repeat)


def plus_one(t):
    return t + 1 if t.is_floating_point() else t


@dataclass
class Stats:
    x: torch.Tensor
    label: str = "stats"
    total: torch.Tensor = field(init=False)   # computed once, in __post_init__
    serial: int = field(init=False)           # not a tensor: must come back as it was
    note: Optional[torch.Tensor] = field(init=False, default=None)  # set later, by whoever built it

    def __post_init__(self):
        self.total = self.x.sum()
        self.serial = next(_serial)
        _post_inits.append(f"Stats {self.label}")


@dataclass(frozen=True)
class FrozenStats:
    x: torch.Tensor
    scale: torch.Tensor = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "scale", self.x.abs().max())
        _post_inits.append("FrozenStats")


@dataclass(frozen=True, slots=True)
class SlottedFrozen:
    x: torch.Tensor
    total: torch.Tensor = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "total", self.x.sum())
        _post_inits.append("SlottedFrozen")


def test_init_false_fields_are_kept_mapped_and_not_recomputed():
    x = torch.tensor([1.0, 2.0, 3.0])
    s = Stats(x, label="a")
    s.note = torch.tensor(10.0)
    calls = list(_post_inits)
    out = map_tensors(s, plus_one)
    assert type(out) is Stats and out is not s
    assert torch.equal(out.x, x + 1)
    # The value carried over and mapped (6 + 1), not recomputed from the mapped x ((x + 1).sum() = 9).
    assert torch.equal(out.total, torch.tensor(7.0))
    assert out.serial == s.serial and out.label == "a"
    assert out.note is not None and torch.equal(out.note, torch.tensor(11.0))
    assert _post_inits == calls, "__post_init__ ran again"
    # the original is untouched
    assert torch.equal(s.x, x) and torch.equal(s.total, torch.tensor(6.0)) and torch.equal(s.note, torch.tensor(10.0))


def test_iter_tensors_sees_init_false_fields():
    s = Stats(torch.ones(2))
    s.note = torch.zeros(3)
    found = list(iter_tensors(s))
    assert [tuple(t.shape) for t in found] == [(2,), (), (3,)]
    assert found[1] is s.total and found[2] is s.note


@pytest.mark.parametrize("cls", [FrozenStats, SlottedFrozen])
def test_frozen_dataclass(cls):
    x = torch.tensor([-4.0, 1.0])
    s = cls(x)
    computed = dataclasses.fields(cls)[1].name
    calls = list(_post_inits)
    out = map_tensors(s, lambda t: t.to(torch.bfloat16) + 1)
    assert type(out) is cls
    assert _post_inits == calls, "__post_init__ ran again"
    assert out.x.dtype == torch.bfloat16 and torch.equal(out.x.float(), x + 1)
    # carried over and mapped: its value on the original + 1, not recomputed from the mapped x
    assert getattr(out, computed).dtype == torch.bfloat16
    assert torch.equal(getattr(out, computed).float(), getattr(s, computed) + 1)
    assert not torch.equal(getattr(out, computed).float(), getattr(cls(x + 1), computed))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.x = x  # still frozen
    assert torch.equal(s.x, x) and s.x.dtype == torch.float32


@dataclass
class Inner:
    weights: List[torch.Tensor]
    mask: torch.Tensor
    mean: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.mean = torch.stack(self.weights).mean()
        _post_inits.append("Inner")


Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Outer:
    inner: Dict[str, Inner]
    pair: Pair
    extra: Inner = field(init=False)

    def __post_init__(self):
        self.extra = Inner([torch.full((2,), 5.0)], torch.tensor([True, False]))
        _post_inits.append("Outer")


def test_nested_dataclasses():
    inner = Inner([torch.ones(2), torch.zeros(2)], torch.tensor([1, 2]))
    o = Outer({"a": inner}, Pair(torch.tensor(3.0), "text"))
    calls = list(_post_inits)
    out = map_tensors(o, lambda t: t.double() if t.is_floating_point() else t)
    assert _post_inits == calls, "__post_init__ ran again"
    assert type(out.inner["a"]) is Inner and type(out.pair) is Pair and type(out.extra) is Inner
    assert [t.dtype for t in out.inner["a"].weights] == [torch.float64, torch.float64]
    assert out.inner["a"].mask.dtype == torch.int64
    assert out.inner["a"].mean.dtype == torch.float64 and out.inner["a"].mean.item() == 0.5
    assert out.pair.first.dtype == torch.float64 and out.pair.second == "text"
    assert out.extra.mean.dtype == torch.float64 and out.extra.mean.item() == 5.0
    assert out.extra.weights[0].dtype == torch.float64 and out.extra.mask.dtype == torch.bool
    floating = [t for t in iter_tensors(out) if t.is_floating_point()]
    assert len(floating) == 6 and all(t.dtype == torch.float64 for t in floating)


def test_namedtuple():
    Out = namedtuple("Out", ["logits", "stats", "name"])
    s = Stats(torch.tensor([1.0, 1.0]))
    o = Out(torch.zeros(2, dtype=torch.bfloat16), s, "n")
    out = map_tensors(o, lambda t: t.float())
    assert type(out) is Out and out._fields == ("logits", "stats", "name") and out.name == "n"
    assert out.logits.dtype == torch.float32
    assert type(out.stats) is Stats and torch.equal(out.stats.total, torch.tensor(2.0))
    assert out.stats.serial == s.serial
    logits, stats, name = out
    assert name == "n" and stats is out.stats


def test_hugging_face_model_output():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import SequenceClassifierOutput

    to_bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731
    o = SequenceClassifierOutput(loss=torch.tensor(0.5), logits=torch.ones(2, 3))
    out = map_tensors(o, to_bf16)
    assert type(out) is SequenceClassifierOutput and isinstance(out, transformers.utils.ModelOutput)
    assert list(out.keys()) == ["loss", "logits"]
    assert out.loss.dtype == out.logits.dtype == torch.bfloat16
    assert out["logits"] is out.logits and out["loss"] is out.loss and out[0] is out.loss
    assert out.hidden_states is None and out.attentions is None and "hidden_states" not in out
    assert len(out.to_tuple()) == 2
    assert o.logits.dtype == torch.float32 and o["logits"].dtype == torch.float32  # the original is untouched

    # Without a loss: None field, no key
    out = map_tensors(SequenceClassifierOutput(logits=torch.ones(2, 3)), to_bf16)
    assert list(out.keys()) == ["logits"] and out.loss is None and out[0] is out.logits

    # A loss set after construction comes after logits (``out[0]`` is the logits, as on the plain model's output)
    o = SequenceClassifierOutput(logits=torch.ones(2, 3))
    o.loss = torch.tensor(0.25)
    out = map_tensors(o, to_bf16)
    assert list(out.keys()) == list(o.keys()) == ["logits", "loss"]
    assert out[0] is out.logits and out[1] is out.loss and out["loss"].dtype == torch.bfloat16


# -- end to end: an O2 bf16 model whose forward returns a dataclass -------------------------------------------

@dataclass
class ClassifierOutput:
    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None
    pred: torch.Tensor = field(init=False)                 # computed in __post_init__ (integer)
    features: torch.Tensor = field(init=False)             # set by forward after construction
    aux: Dict[str, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self):
        self.pred = self.logits.argmax(-1)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.body(x))
        logits = self.head(h)
        out = ClassifierOutput(logits, nn.functional.cross_entropy(logits, y))
        out.features = h
        out.aux = {"h_norm": h.pow(2).mean()}
        return out


def test_dataclass_output_through_o2_bf16():
    torch.manual_seed(0)
    model = Classifier()
    reference = Classifier()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])

    calls = []
    model.head.register_forward_hook(lambda m, a, o: calls.append(o.dtype))
    out = model(x, y)
    assert calls == [torch.bfloat16], "the model must really compute in bf16 for this test to mean anything"
    assert type(out) is ClassifierOutput
    assert {f.name for f in dataclasses.fields(out)} <= set(vars(out))  # every field present
    for t in (out.logits, out.loss, out.features, out.aux["h_norm"]):
        assert t.dtype == torch.float32 and t.requires_grad
    assert out.pred.dtype == torch.int64 and out.pred.shape == (5,)

    expected = reference(x, y)
    assert torch.equal(out.pred, out.logits.argmax(-1))  # computed inside, on the bf16 logits
    # bf16 compute: 8 bits of mantissa, values O(1)
    torch.testing.assert_close(out.logits, expected.logits, rtol=0.05, atol=0.05)
    torch.testing.assert_close(out.features, expected.features, rtol=0.05, atol=0.05)

    (out.loss + out.aux["h_norm"]).backward()
    (expected.loss + expected.aux["h_norm"]).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0.05, atol=0.02, msg=name)
    optimizer.step()
    optimizer.zero_grad()
    assert type(model(x, y)) is ClassifierOutput
