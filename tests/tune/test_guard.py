"""The run-time guard (`aiak.tune.guard`): its plain compute is plain PyTorch, its windows alternate as documented,
its rule keeps, budgets or drops the pick, and the cache learns its choice beside the load."""
import copy
import json
import os

import pytest
import torch
from torch import nn

import aiak
from aiak.amp.half_compute import HalfCompute
from aiak.cli.demo import DemoNet, make_setup, training_steps
from aiak.runtime.switches import read_switches, write_switches
from aiak.tune import guard
from aiak.tune.guard import BUDGET, MAX_ROUNDS, MIN_ROUNDS, PICK, PLAIN, TIMED_STEPS, SpeedGuard, choose
from aiak.tune.decision import Decision
from aiak.tune.trials import Tuning, load_changed
from aiak.util.machine.load import CpuLoad, cpu_load


def compute_of(model):
    return next(h.__self__ for m in model.modules() for h in m._forward_pre_hooks.values()
                if isinstance(getattr(h, "__self__", None), HalfCompute))


def grads_of(model, x, y):
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_plain_compute_is_plain_pytorch_and_the_pick_is_not(level):
    """With its regions off, a model under O1/O2 bf16 computes exactly as the plain fp32 model (its parameters are
    the fp32 ones); on again, it computes in bf16 (the gradients differ), so the switch really switches."""
    torch.manual_seed(0)
    plain = DemoNet(width=8)
    model = copy.deepcopy(plain)
    aiak.optimize(model, strategy={"extends": "default", "precision": {"level": level, "dtype": "bf16"}})
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    compute = compute_of(model)
    compute.enabled = False
    off, reference = grads_of(model, x, y), grads_of(plain, x, y)
    assert all(torch.equal(off[n], reference[n]) for n in reference)
    compute.enabled = True
    on = grads_of(model, x, y)
    assert any(not torch.equal(on[n], reference[n]) for n in reference)
    assert model(x).dtype == torch.float32


WINDOW_MAX = TIMED_STEPS + 1   # a window's steps at most: its timed ones after an untimed one


def schedule(arms, rounds):
    """The arms of each step of the guard's first ``rounds`` rounds, as its docstring says: forwards in even rounds,
    backwards in odd ones; each window `TIMED_STEPS` timed steps, after an untimed one where the arm changed."""
    steps, last = [], None
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            steps += [arm] * (TIMED_STEPS + (arm is not last))
            last = arm
    return steps


def run_guard(load, steps=None):
    """A demo model under O1 bf16 with a guard on its optimizer; returns the guard, the arm each step computed with
    (read in the forward: half compute on or off, intra-op threads) and the decisions it reported."""
    switches = read_switches()
    model, optimizer, loader = make_setup(0, 640, 16, width=8)
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}})
    compute = compute_of(model)
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append((compute.enabled, torch.get_num_threads())))
    decided = []
    pick = {**read_switches(), "num_threads": 2}
    plain = {**switches, "num_threads": 2}
    g = SpeedGuard(optimizer, model, compute, pick, plain, load, torch.device("cpu"), decided.append)
    it = training_steps(model, optimizer, loader, None)
    try:
        for _ in range(steps or (MAX_ROUNDS * len(g.arms) * WINDOW_MAX + 6)):
            next(it)
    finally:
        write_switches(switches)
    return g, seen, decided, compute


def test_the_windows_alternate_then_the_guard_lets_go():
    """Windows of TIMED_STEPS steps after an untimed one where the arm changed, the arms forwards then backwards,
    each arm's state in its forward; after the decision the hook is gone and the chosen arm computes every later
    step."""
    g, seen, decided, compute = run_guard(CpuLoad(cores=2, busy_elsewhere=1.5, load1=3.0))
    assert [a.label for a in g.arms] == [PICK, BUDGET, PLAIN]   # one core free of 2: a thread budget is offered
    state = {PICK: (True, 2), BUDGET: (True, 1), PLAIN: (False, 2)}
    # (after MIN_ROUNDS rounds, an arm slower than plain and than another one is dropped)
    expected = [state[a.label] for a in schedule(g.arms, MIN_ROUNDS)]
    assert seen[:len(expected)] == expected
    assert expected[:9] == [state[PICK]] * 3 + [state[BUDGET]] * 3 + [state[PLAIN]] * 3   # round 1: forwards
    assert expected[9:] == [state[PLAIN]] * 2 + [state[BUDGET]] * 3 + [state[PICK]] * 3   # round 2: backwards
    plain_steps = seen[:g.result.steps].count(state[PLAIN])
    rounds = len(g.result.rounds[PICK])
    assert MIN_ROUNDS <= rounds <= MAX_ROUNDS and rounds * TIMED_STEPS <= plain_steps <= rounds * WINDOW_MAX
    assert len(decided) == 1 and decided[0] is g.result
    assert set(seen[g.result.steps:]) == {state[g.result.chosen]}   # the rest of the run: the chosen arm
    assert set(g.result.speedups) == {PICK, BUDGET, PLAIN} and g.result.speedups[PLAIN] == 1.0


def test_no_thread_budget_on_an_idle_machine():
    g, seen, decided, _ = run_guard(CpuLoad(cores=2, busy_elsewhere=0.0, load1=0.1))
    assert [a.label for a in g.arms] == [PICK, PLAIN] and len(decided) == 1
    assert {threads for _, threads in seen} == {2}


@pytest.mark.parametrize("pick, budget, chosen", [
    ([1.0, 1.0, 1.0], None, PICK),              # as fast as plain: kept
    ([0.5, 0.5], None, PICK),                   # twice as fast
    ([1.02, 1.01], None, PICK),                 # slower within the noise floor: kept
    ([2.0, 2.1, 1.9], None, PLAIN),             # twice as slow in every round: plain compute
    ([0.5, 9.0, 0.5, 0.5], None, PLAIN),        # fast by the median, but one round's tail makes it slower in sum
    ([0.5, 2.5], None, PLAIN),                  # rounds as far apart as 2.0x and 0.4x: the sum decides, not the spread
    ([0.8, 0.8], [0.4, 0.4], BUDGET),           # faster, but the budget is twice as fast again
    ([0.8, 0.8], [0.78, 0.79], PICK),           # the budget within noise of the pick: the pick stays
    ([3.0, 3.0], [2.0, 2.0], PLAIN),            # both slower than plain
])
def test_the_rule(pick, budget, chosen):
    plain = [1.0] * len(pick)
    arms = [(PICK, pick, 2)] + ([(BUDGET, budget, 1)] if budget else []) + [(PLAIN, plain, 2)]
    label, why, speedups, rounds = choose(arms)
    assert label == chosen, why
    assert speedups[PICK] == round(sum(plain) / sum(pick), 3)


def test_with_nothing_timed_the_pick_stays():
    """A loop whose optimizer steps run no training forward gives the guard no seconds: it keeps the pick."""
    assert choose([(PICK, [0.0, 0.0], 2), (PLAIN, [0.0, 0.0], 2)])[0] == PICK
    assert choose([(PICK, [0.0, 0.0], 2), (PLAIN, [1.0, 1.0], 2)])[0] == PICK


def test_the_notice_says_what_changed(capsys):
    g, _, _, _ = run_guard(CpuLoad(cores=2, busy_elsewhere=1.5, load1=3.0))
    said = capsys.readouterr().err
    assert (g.warning() in said) if g.result.chosen != PICK else "alternating windows" not in said
    g.result.chosen = PLAIN
    text = g.warning()
    assert "plain PyTorch (fp32" in text and "1.5 runnable task(s) of other work on 2 core(s)" in text
    g.result.chosen = PICK
    assert g.warning() == ""


def test_a_cached_decision_is_measured_again_under_another_load():
    entry = {"load": {"cores": 2, "free_cores": 2}}
    assert load_changed(entry, CpuLoad(2, 0.2, 0.5)) == ""
    assert "2 of 2 core(s) free of other work, 1 now: measured again" in load_changed(entry, CpuLoad(2, 1.2, 3.0))
    near = {"load": {"cores": 2, "free_cores": 2, "busy_elsewhere": 0.4}}   # rounds to 2 free, 0.6 to 1: one load
    assert load_changed(near, CpuLoad(2, 0.6, 0.5)) == "" and load_changed(near, CpuLoad(2, 1.5, 0.5)) != ""
    entry["guard"] = {"load": {"cores": 2, "free_cores": 1}}       # the guard's reading is the later one
    assert load_changed(entry, CpuLoad(2, 1.2, 3.0)) == ""
    assert load_changed(entry, CpuLoad(2, None, 3.0)) == ""          # unknown now: reused
    assert load_changed({"load": None}, CpuLoad(2, 1.2, 3.0)) == ""  # an entry written before the load was kept


def test_the_load_reading():
    load = cpu_load()
    assert load.cores == len(os.sched_getaffinity(0)) and 1 <= load.free_cores <= load.cores
    assert CpuLoad(4, 2.6, 1.0).free_cores == 1 and CpuLoad(4, 0.0, 1.0).free_cores == 4
    assert CpuLoad(2, 9.0, 1.0).free_cores == 1 and CpuLoad(2, None, 1.0).free_cores == 2


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("AIAK_TUNE_CACHE", str(path))
    return path


def trained_pick(cache_file):
    model, optimizer, loader = make_setup(0, 256, 16, width=8)
    aiak.optimize(model, optimizer, loader, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}, "tune": {"candidates": 2, "steps": 2}})
    return json.loads(cache_file.read_text())


def test_the_cache_learns_the_guards_choice_and_the_load(cache_file):
    """The entry keeps the load the trials measured under; a later run whose entry holds the guard's choice of
    plain compute starts from it, with no guard (the entry's load left out here, so that the machine's load now
    cannot differ from it); under another load, it measures again."""
    data = trained_pick(cache_file)
    (key, entry), = data.items()
    assert entry["load"]["cores"] == len(os.sched_getaffinity(0)) and "plain_strategy" in entry
    entry["label"] = "bf16"   # as if the trials had chosen the pick: the guard's plain choice must override it
    entry["guard"], entry["load"] = {"chosen": PLAIN, "speedups": {PICK: 0.8, PLAIN: 1.0}}, None
    cache_file.write_text(json.dumps(data))
    model, optimizer, loader = make_setup(0, 256, 16, width=8)
    aiak.optimize(model, optimizer, loader, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}, "tune": {"candidates": 2, "steps": 2}})
    d = aiak.last_decision().to_dict()
    assert d["cache_hit"] and d["strategy"]["precision"]["level"] == "O0" and d["guard"] == {}

    entry["guard"]["load"] = {"cores": 2, "free_cores": 0}   # no reading now can match
    cache_file.write_text(json.dumps(data))
    model, optimizer, loader = make_setup(0, 256, 16, width=8)
    aiak.optimize(model, optimizer, loader, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}, "tune": {"candidates": 2, "steps": 2}})
    d = aiak.last_decision().to_dict()
    assert not d["cache_hit"] and "measured again" in d["tuning"]


def test_the_guard_reports_into_the_decision_and_the_cache(cache_file):
    """Through optimize(): a measured pick is watched (the record says so at once), and once the guard decides, the
    record and the cache entry hold its figures. The pick is made the trials' choice in the cache (whatever they
    measured here), so that there is a pick to guard."""
    strategy = {"extends": "default", "precision": {"level": "O1", "dtype": "bf16"},
                "tune": {"candidates": 2, "steps": 2}}
    data = trained_pick(cache_file)
    (entry,) = data.values()
    entry["label"], entry["load"], entry["timed_in_run"] = "custom", None, False   # as trials on copies chose
    entry["strategy"] = aiak.Strategy.from_dict(strategy).to_dict()
    cache_file.write_text(json.dumps(data))
    switches = read_switches()
    try:
        model, optimizer, loader = make_setup(0, 640, 16, width=8)
        model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy)
        decision = aiak.last_decision()
        assert decision.cache_hit and "watching" in decision.guard["why"]
        it = training_steps(model, optimizer, loader, None)
        for _ in range(MAX_ROUNDS * 3 * WINDOW_MAX):
            next(it)
    finally:
        write_switches(switches)
    assert decision.guard["chosen"] in (PICK, BUDGET, PLAIN) and decision.guard["steps"] >= MIN_ROUNDS * 2
    assert "run-time guard: " in decision.render()
    (entry,) = json.loads(cache_file.read_text()).values()
    assert entry["guard"] == json.loads(json.dumps(decision.guard))


def test_off_where_it_cannot_switch():
    strategy = aiak.Strategy.from_dict({"extends": "default", "tune": {"guard": False}})
    tuning = Tuning(strategy, "custom", [], 0.0, False, None)
    decision = Decision(strategy={}, knobs={})
    assert guard.watch(tuning, strategy, DemoNet(), torch.optim.SGD(DemoNet().parameters(), lr=0.1), {},
                       torch.device("cpu"), decision) is None
    assert decision.guard["why"] == "not run: tune.guard is false"


def test_a_step_is_timed_from_its_first_training_forward():
    """The clock of a step starts at its first training forward, not at the previous optimizer step: what runs in
    between (loading, an evaluation, another run's steps in bench and the demo) is no arm's time."""
    switches = read_switches()
    model, optimizer, loader = make_setup(0, 640, 16, width=8)
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}})
    g = SpeedGuard(optimizer, model, compute_of(model), read_switches(), switches, CpuLoad(2, 0.0, 0.0),
                   torch.device("cpu"), lambda result: None)
    x, y = next(iter(loader))
    try:
        assert g.last_mark is None
        model.eval()
        with torch.no_grad():
            model(x)                       # an evaluation: no clock
        model.train()
        assert g.last_mark is None
        loss = nn.functional.cross_entropy(model(x), y)
        assert g.last_mark is not None     # the training forward started it
        loss.backward()
        optimizer.step()
        assert g.last_mark is None and g.steps == 1
    finally:
        write_switches(switches)


@pytest.mark.parametrize("prefer, pick, other, chosen", [
    ([PICK], [0.5, 0.5], [0.49, 0.5], PICK),              # the other within noise of the pick: the pick stays
    ([PICK], [0.8, 0.8], [0.5, 0.5], "O2"),               # the other faster beyond noise
    ([PLAIN, "neutral", PICK], [0.99, 0.98], [1.0, 1.0], PLAIN),   # 1.02x: within noise of plain, which is simpler
    ([PLAIN, "neutral", PICK], [0.5, 0.5], [0.52, 0.5], PICK),     # the pick before an arm it is within noise of
    ([PLAIN, "O2", PICK], [0.5, 0.5], [0.52, 0.5], "O2"),          # ... unless that one is preferred
    ([PLAIN, PICK], [1.5, 1.5], [1.2, 1.2], PLAIN),                # both slower: plain
])
def test_the_rule_with_more_arms(prefer, pick, other, chosen):
    plain = [1.0] * len(pick)
    label, why, speedups, _ = choose([(PICK, pick, 2), ("O2", other, 2), (PLAIN, plain, 2)], prefer)
    assert label == chosen, why
    assert set(speedups) == {PICK, "O2", PLAIN}


def train_until_decided(g, model, optimizer, loader, switches):
    """Enough training steps for the guard to decide at its last round, and a few more; the switches put back."""
    it = training_steps(model, optimizer, loader, None)
    try:
        for _ in range(MAX_ROUNDS * len(g.arms) * WINDOW_MAX + 4):
            next(it)
    finally:
        write_switches(switches)


def test_arms_that_switch_the_level_and_the_layout():
    """A demo model applied at O1 bf16 with channels_last, watched with an O2 arm and an fp32 channels_last arm: every
    step of a window computes as its arm (half compute on or off, the level, the weights' layout), plain compute is
    plain PyTorch's contiguous fp32 with the optimizer's momentum in the weights' layout, and after the decision
    every step computes as the chosen arm."""
    switches = read_switches()
    model, optimizer, loader = make_setup(0, 960, 16, width=8)
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}, "channels_last": True})
    compute = compute_of(model)
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    seen, momentum = [], []
    weight = conv.weight   # the fp32 parameter (O2 swaps a bf16 copy in while the module computes)

    def nhwc(t):
        return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()

    def arm_seen(module, args):
        seen.append((compute.enabled, compute.level if compute.enabled else None, nhwc(conv.weight)))
        buffer = optimizer.state.get(weight, {}).get("momentum_buffer")
        if buffer is not None:   # the optimizer's state in the weight's layout, so plain compute's steps are plain's
            momentum.append(nhwc(buffer) == nhwc(weight))

    model.register_forward_pre_hook(arm_seen)
    pick = read_switches()
    others = [guard.Arm("O2", pick, True, level="O2"), guard.Arm("fp32, channels_last", pick, False)]
    g = SpeedGuard(optimizer, model, compute, pick, switches, CpuLoad(2, 0.0, 0.0), torch.device("cpu"),
                   lambda result: None, others=others, prefer=[PLAIN, "fp32, channels_last", PICK])
    state = {PICK: (True, "O1", True), "O2": (True, "O2", True), "fp32, channels_last": (False, None, True),
             PLAIN: (False, None, False)}
    assert [a.label for a in g.arms] == [PICK, "O2", "fp32, channels_last", PLAIN]
    train_until_decided(g, model, optimizer, loader, switches)
    expected = [state[a.label] for a in schedule(g.arms, MIN_ROUNDS)]
    assert seen[:len(expected)] == expected
    # the layout changes twice in two rounds, into plain compute's window and out of it (rotating the order: four)
    assert sum(a[2] != b[2] for a, b in zip(seen[:len(expected)], seen[1:len(expected)])) == 2
    assert g.result is not None and set(seen[g.result.steps:]) == {state[g.result.chosen]}
    assert len(momentum) == len(seen) - 1 and all(momentum)


def test_an_arm_the_model_cannot_switch_to_exactly_is_left_out():
    """A level switch where a module kept in fp32 has O2's own hooks (the layout is attached: `attach_layout`)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.GELU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={
        "extends": "default", "precision": {"level": "O2", "dtype": "bf16", "keep_fp32": ["3"]}})
    switches = read_switches()
    others = [guard.Arm("O1", switches, True, level="O1"), guard.Arm("channels_last", switches, True,
                                                                      channels_last=True)]
    g = SpeedGuard(optimizer, model, compute_of(model), switches, switches, CpuLoad(2, 0.0, 0.0),
                   torch.device("cpu"), lambda result: None, others=others)
    assert [a.label for a in g.arms] == [PICK, "channels_last", PLAIN]
    g.handle.remove()
    g.forward_handle.remove()


def test_channels_last_switched_on_for_a_model_the_pick_left_contiguous():
    """The guard attaches a layout, off, to a demo model applied at O1 bf16 without channels_last: the channels_last
    arm's windows compute with NHWC weights and inputs, the others with contiguous ones; after the decision the
    layout stays attached only where the chosen arm computes channels_last."""
    switches = read_switches()
    model, optimizer, loader = make_setup(0, 960, 16, width=8)
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}})
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(
        (conv.weight.is_contiguous(), args[0].is_contiguous())))
    pick = read_switches()
    g = SpeedGuard(optimizer, model, compute_of(model), pick, switches, CpuLoad(2, 0.0, 0.0), torch.device("cpu"),
                   lambda result: None, others=[guard.Arm("channels_last=true", pick, True, channels_last=True)])
    assert [a.label for a in g.arms] == [PICK, "channels_last=true", PLAIN] and g.attached is not None
    train_until_decided(g, model, optimizer, loader, switches)
    nhwc = {PICK: (True, True), "channels_last=true": (False, False), PLAIN: (True, True)}
    expected = [nhwc[a.label] for a in schedule(g.arms, MIN_ROUNDS)]
    assert seen[:len(expected)] == expected
    assert set(seen[g.result.steps:]) == {nhwc[g.result.chosen]}
    attached = any(getattr(h, "__self__", None) is g.layout for h in model._forward_pre_hooks.values())
    assert attached == (g.result.chosen == "channels_last=true")


def _small_swin():
    import timm

    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4,
                             window_size=4, embed_dim=16, depths=(1, 1), num_heads=(2, 2), num_classes=4,
                             drop_path_rate=0.0)


def test_arms_that_switch_the_fused_window_attention():
    """A small timm Swin applied at O1 bf16 with fused window attention, watched with a 'no_fused_ops' arm: every step
    of a window computes with its arm's attention (fused or the original forward), plain compute computes exactly
    plain PyTorch's gradients (unfused, fp32), and after the decision every step computes as the chosen arm."""
    switches = read_switches()
    plain_model = _small_swin()
    model = copy.deepcopy(plain_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}, "fused_ops": ["window_attention"]})
    attention = [m for m in model.modules() if type(m).__name__.startswith("Fused")]
    assert len(attention) == 2
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(
        tuple(type(a).__name__.startswith("Fused") for a in attention)))
    pick = read_switches()
    g = SpeedGuard(optimizer, model, compute_of(model), pick, switches, CpuLoad(2, 0.0, 0.0), torch.device("cpu"),
                   lambda result: None, others=[guard.Arm("no_fused_ops", pick, True, fused_ops=frozenset())])
    assert [a.label for a in g.arms] == [PICK, "no_fused_ops", PLAIN]
    fused = {PICK: (True, True), "no_fused_ops": (False, False), PLAIN: (False, False)}
    g._use(g.arms[-1])   # plain compute: plain PyTorch's gradients, exactly
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2,))
    off, reference = grads_of(model, x, y), grads_of(plain_model, x, y)
    assert all(torch.equal(off[n], reference[n]) for n in reference)
    g._use(g.arms[0])
    seen.clear()
    data = [(torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2,))) for _ in range(8)]
    train_until_decided(g, model, optimizer, data * 20, switches)
    expected = [fused[a.label] for a in schedule(g.arms, MIN_ROUNDS)]
    assert seen[:len(expected)] == expected
    assert g.result is not None and set(seen[g.result.steps:]) == {fused[g.result.chosen]}


def test_plain_compute_computes_the_1x1_convolutions_as_convolutions():
    """A timm ResNet-26 applied with its 1x1 convolutions as matrix multiplies (`fused_ops: [pointwise_conv]`): the
    guard's plain compute restores their convolution forward, so its gradients are plain PyTorch's bit for bit; the
    pick's arm computes them as matrix multiplies again (the same within fp32 rounding, not bit for bit)."""
    import timm

    from aiak.ops.pointwise_conv import PointwiseConvAsMatmul

    switches = read_switches()
    torch.manual_seed(0)
    plain_model = timm.create_model("resnet26", num_classes=4)
    model = copy.deepcopy(plain_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"extends": "default",
                                                                    "fused_ops": ["pointwise_conv"]})
    try:
        swapped = [m for m in model.modules() if isinstance(m, PointwiseConvAsMatmul)]
        assert len(swapped) == probe_count(plain_model) > 0
        g = SpeedGuard(optimizer, model, None, read_switches(), switches, CpuLoad(2, 0.0, 0.0), torch.device("cpu"),
                       lambda result: None)
        assert [a.label for a in g.arms] == [PICK, PLAIN] and g.fused.ops == {"pointwise_conv"}
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 4, (8,))
        reference = grads_of(plain_model, x, y)
        g._use(g.arms[-1])
        assert not any(isinstance(m, PointwiseConvAsMatmul) for m in model.modules())
        off = grads_of(model, x, y)
        assert all(torch.equal(off[n], reference[n]) for n in reference)
        g._use(g.arms[0])
        assert all(isinstance(m, PointwiseConvAsMatmul) for m in swapped)
        on = grads_of(model, x, y)
        assert any(not torch.equal(on[n], reference[n]) for n in reference)
        # fp32 rounding through train-mode BatchNorm over tiny maps: 1e-3 of the whole gradient's norm
        flat_on, flat_ref = (torch.cat([t[n].flatten() for n in reference]) for t in (on, reference))
        assert float((flat_on - flat_ref).norm() / flat_ref.norm()) < 1e-3
    finally:
        g.handle.remove()
        g.forward_handle.remove()
        write_switches(switches)


def probe_count(model):
    from aiak.strategy.probes import module_counts

    return module_counts(model)["pointwise_conv"]


def guard_with_o2(prefer):
    """A guard on an O1 bf16 model with an O2 arm beside the pick, its hooks off: its rounds are set by hand."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.GELU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={
        "extends": "default", "precision": {"level": "O1", "dtype": "bf16"}})
    switches = read_switches()
    g = SpeedGuard(optimizer, model, compute_of(model), switches, switches, CpuLoad(2, 0.0, 0.0),
                   torch.device("cpu"), lambda result: None, others=[guard.Arm("O2", switches, True, level="O2")],
                   prefer=prefer)
    g.handle.remove()
    g.forward_handle.remove()
    return g


@pytest.mark.parametrize("prefer,done", [([PLAIN, PICK], True), ([PICK], False)])
def test_where_plain_compute_is_preferred_no_arm_ahead_of_it_ends_the_windows(prefer, done):
    """After MIN_ROUNDS rounds in which no arm ran ahead of plain compute beyond the noise floor, the guard stops
    where plain compute is preferred within noise (more rounds could not make `choose` leave it); where the pick is
    preferred, arms within noise of plain keep the rounds going (the ranking is not clear)."""
    g = guard_with_o2(prefer)
    pick, o2, plain = g.arms
    plain.seconds, pick.seconds, o2.seconds = [1.0] * MIN_ROUNDS, [1.01, 0.99][:MIN_ROUNDS], [1.2] * MIN_ROUNDS
    g.round = MIN_ROUNDS
    assert g._done() is done
    pick.seconds = [0.9] + [1.0] * (MIN_ROUNDS - 1)   # ahead of plain by 11% in one round: more rounds may tell
    assert g._done() is False


def test_plain_compute_chosen_for_good_ends_the_windows():
    """Where plain compute is chosen and an arm's best round so far, repeated in every round left, would not make
    `choose` leave it, the guard stops at MIN_ROUNDS: the arms' windows only cost the run (timm's ResNet-50 on this
    project's CPU: the pick at 0.93x and 0.92x of plain, O2 at 1.06x then 0.92x, where the rule before this one ran
    all MAX_ROUNDS rounds for O2's 1.06x). An arm whose best round, repeated, would win keeps the rounds going."""
    prefer = [PLAIN, PICK]   # the trials handed the candidates over: plain compute first within noise
    g = guard_with_o2(prefer)
    pick, o2, plain = g.arms
    g.round = MIN_ROUNDS
    plain.seconds, pick.seconds, o2.seconds = [1.0, 1.0], [1 / 0.935, 1 / 0.92], [1 / 1.057, 1 / 0.915]
    assert choose([(a.label, a.seconds, None) for a in g.arms], prefer)[0] == PLAIN
    assert g._done() is True
    o2.seconds = [1 / 1.15, 1 / 0.96]   # plain is still chosen on two rounds, but O2's best round would win the rest
    assert choose([(a.label, a.seconds, None) for a in g.arms], prefer)[0] == PLAIN
    assert g._done() is False
    g.round = MAX_ROUNDS
    assert g._done() is True


def test_a_pick_far_ahead_ends_the_windows_beside_an_arm_near_plain():
    """Where the chosen arm ran ahead of plain beyond the noise floor in every round and would stay chosen were it to
    repeat its worst round and every other arm its best in each round left, the guard stops at MIN_ROUNDS, though
    an arm within the noise floor of plain leaves the ranking unclear (DemoNet: its pick at 1.8x plain compute, the
    fp32 channels_last arm at 1.01-1.13x, ran all MAX_ROUNDS rounds). An arm whose best round would win, or a chosen
    arm near plain in a round, keeps the rounds going."""
    from aiak.measure.rounds import ranking_is_clear

    prefer = [PLAIN, PICK]
    g = guard_with_o2(prefer)
    pick, o2, plain = g.arms
    g.round = MIN_ROUNDS
    plain.seconds, pick.seconds, o2.seconds = [1.0, 1.0], [1 / 1.8, 1 / 1.7], [1 / 1.13, 1 / 1.01]
    assert not ranking_is_clear([g._ratios(pick), g._ratios(o2)])   # O2 within the floor of plain in one round
    assert choose([(a.label, a.seconds, None) for a in g.arms], prefer)[0] == PICK
    assert g._done() is True
    o2.seconds = [1 / 2.5, 1 / 1.6]   # O2's best round, repeated, would make it the fastest beyond noise
    assert choose([(a.label, a.seconds, None) for a in g.arms], prefer)[0] == PICK
    assert g._done() is False
    o2.seconds, pick.seconds = [1 / 1.13, 1 / 1.01], [1 / 1.8, 1 / 1.02]   # the pick near plain in a round: a tail
    assert g._done() is False                                           # under load may yet show


def test_plain_compute_keeps_the_memory_switches_as_applied():
    """glibc malloc's thresholds (`malloc_retain`) change how memory is obtained, not what is computed: the plain
    compute arm keeps them as the pick applied them, where every other process switch is the script's."""
    model, optimizer, _ = make_setup(0, 64, 16, width=8)
    switches = read_switches()
    pick = {**switches, "malloc_retain": True, "num_threads": 2}
    plain = {**switches, "malloc_retain": False, "num_threads": 1}
    g = SpeedGuard(optimizer, model, None, pick, plain, CpuLoad(2, 0.0, 0.0), torch.device("cpu"), lambda r: None)
    try:
        assert g.arms[-1].label == PLAIN
        assert g.arms[-1].switches == {**plain, "malloc_retain": True}
    finally:
        g.handle.remove()
        g.forward_handle.remove()
        write_switches(switches)
