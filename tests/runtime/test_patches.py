"""aiak's global patches of torch (:mod:`aiak.runtime.patches`): each declared once, all installed through the one
mechanism, listed by ``aiak.patches()``, and undone by ``aiak.undo_patches()`` down to the very objects torch had
before ``import aiak``; the next ``optimize()`` installs them again."""
import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiak.runtime import patches

ROOT = Path(__file__).resolve().parents[2]
AIAK = ROOT / "aiak"
KEYS = {"backward-root", "fp16-steps", "grad-scaler", "clip", "schedulers", "ddp-constructor", "deadlock-guard"}

# Run in a fresh interpreter: the snapshot of torch's attributes is taken before aiak is imported.
LIFECYCLE = textwrap.dedent('''
    import json, sys, tempfile, warnings
    import torch, torch.distributed as dist, torch.nn.utils.clip_grad
    from torch.optim import optimizer as optimizer_module
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    import timm.utils

    LR = torch.optim.lr_scheduler
    HOLDERS = [torch.autograd.graph, torch.autograd, torch.amp.GradScaler, torch.nn.utils, torch.nn.utils.clip_grad,
               DistributedDataParallel, dist, timm.utils, timm.utils.agc, timm.utils.clip_grad]
    todo = [LR.LRScheduler]
    while todo:
        HOLDERS.append(todo.pop())
        todo += HOLDERS[-1].__subclasses__()

    def dotted(holder):
        return f"{holder.__module__}.{holder.__qualname__}" if isinstance(holder, type) else holder.__name__

    def snapshot():
        """id() of every function-like attribute each holder has as its own (what a class inherits excluded) and
        of what a class has as its own __new__ and step (None where it inherits them)."""
        ids = {f"{dotted(holder)}.{attr}": id(value) for holder in HOLDERS
               for attr, value in vars(holder).items() if callable(value) or isinstance(value, staticmethod)}
        ids.update({f"{dotted(holder)}.{attr}": id(vars(holder).get(attr)) for holder in HOLDERS
                    if isinstance(holder, type) for attr in ("__new__", "step")})
        for kind in ("pre", "post"):  # the global hooks on every optimizer's step
            name = f"_global_optimizer_{kind}_hooks"
            ids[f"torch.optim.optimizer.{name}"] = hash(tuple(map(id, getattr(optimizer_module, name).values())))
        return ids

    def changed(before, after):
        return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))

    def accumulating_model():
        model = nn.Linear(4, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                strategy={"grad_accumulation": 2})
        return model

    def clip_leaves_the_window_alone(model):
        """A micro-step's backward, then torch.nn.utils.clip_grad_norm_ with a tiny max_norm: routed to aiak it
        clips nothing inside an accumulation window; torch's own function shrinks the partial sum."""
        model(torch.randn(8, 4)).square().mean().backward()
        grad = model.weight.grad.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-6)
        return bool(torch.equal(model.weight.grad, grad))

    before = snapshot()
    import aiak
    from aiak.comm.script_ddp import mark_built_by_aiak
    assert aiak.patches() == [] and changed(before, snapshot()) == []   # importing aiak patches nothing

    dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/store", rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = LR.StepLR(optimizer, step_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _, scheduler = aiak.optimize(
            model, optimizer, scheduler=scheduler,
            strategy={"precision": {"level": "O1", "dtype": "fp16"}, "grad_accumulation": 2})
    mark_built_by_aiak(DistributedDataParallel(nn.Linear(2, 2)))   # what optimize() does with several ranks
    aiak.comm.enable_deadlock_guard(timeout_s=30)
    dist.barrier()                                                  # through the guard
    installed = aiak.patches()
    during = snapshot()
    out = {"keys": [p.key for p in installed], "targets": {p.key: list(p.targets) for p in installed},
           "lines": [str(p) for p in installed], "changed": changed(before, during)}

    aiak.undo_patches()
    out["after_undo"] = changed(before, snapshot())
    out["patches_after_undo"] = [p.key for p in aiak.patches()]
    out["guard_enabled_again"] = aiak.comm.enable_deadlock_guard(timeout_s=30) is not None and \\
        aiak.patches()[-1].key == "deadlock-guard"
    aiak.comm.disable_deadlock_guard()
    out["after_guard_off"] = changed(before, snapshot())
    model = accumulating_model()
    out["reinstalled"] = [p.key for p in aiak.patches()]
    out["routed_again"] = clip_leaves_the_window_alone(model)
    aiak.undo_patches()
    out["routed_after_undo"] = clip_leaves_the_window_alone(model)
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def lifecycle():
    pytest.importorskip("timm")
    out = subprocess.run([sys.executable, "-c", LIFECYCLE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_optimize_installs_every_declared_patch_and_each_changes_what_it_names(lifecycle):
    assert set(lifecycle["keys"]) == KEYS and len(lifecycle["keys"]) == len(KEYS)
    for key, targets in lifecycle["targets"].items():
        assert targets and set(targets) <= set(lifecycle["changed"]), key
    ddp, lr = "torch.nn.parallel.distributed.DistributedDataParallel", "torch.optim.lr_scheduler"
    expected = {"torch.autograd.graph._engine_run_backward", "torch.autograd._engine_run_backward",
                "torch.amp.grad_scaler.GradScaler.scale", "torch.amp.grad_scaler.GradScaler.unscale_",
                f"{ddp}.__new__", f"{ddp}.__init__", "torch.distributed.all_reduce", "torch.distributed.barrier",
                f"{lr}.LRScheduler.step", f"{lr}.SequentialLR.step", f"{lr}.ReduceLROnPlateau.step",
                "torch.optim.optimizer._global_optimizer_pre_hooks", "torch.optim.optimizer._global_optimizer_post_hooks",
                "timm.utils.adaptive_clip_grad", "timm.utils.agc.adaptive_clip_grad",
                "timm.utils.clip_grad.adaptive_clip_grad"}
    expected |= {f"{module}.{name}" for module in ("torch.nn.utils", "torch.nn.utils.clip_grad")
                 for name in ("clip_grad_norm_", "clip_grad_value_")}
    expected |= {f"torch.nn.utils.clip_grad.{name}" for name in ("_get_total_norm", "_clip_grads_with_norm_",
                                                                 "_group_tensors_by_device_and_dtype")}
    assert expected <= set(lifecycle["changed"]), expected - set(lifecycle["changed"])
    # nothing changed that no patch names
    named = {t for targets in lifecycle["targets"].values() for t in targets}
    assert set(lifecycle["changed"]) <= named, set(lifecycle["changed"]) - named
    assert all(line.count("\n") == 0 and " replaced by aiak." in line for line in lifecycle["lines"])


def test_undo_puts_back_the_very_objects_torch_had_before_import(lifecycle):
    assert lifecycle["after_undo"] == [] and lifecycle["patches_after_undo"] == []
    assert lifecycle["guard_enabled_again"] and lifecycle["after_guard_off"] == []


def test_optimize_after_an_undo_installs_again_and_an_undo_leaves_its_objects_to_torch(lifecycle):
    assert {"clip", "grad-scaler", "schedulers"} <= set(lifecycle["reinstalled"])
    assert lifecycle["routed_again"] is True
    assert lifecycle["routed_after_undo"] is False   # torch's own clip_grad_norm_ on the partial sum


# -- the table ------------------------------------------------------------------------------------------------
def test_every_patch_is_declared_once_with_what_when_why_owner_and_undo():
    assert set(patches.DECLARED) == KEYS
    for key, row in patches.DECLARED.items():
        assert row.key == key
        assert all(len(text) > 10 for text in (row.replaces, row.when, row.why, row.undone)), key
        owner = AIAK.joinpath(*row.owner.split(".")[1:]).with_suffix(".py")
        assert owner.is_file(), (key, row.owner)
        source = owner.read_text()
        assert f'"{key}"' in source and ("patches.replace(" in source or "patches.hook(" in source), (
            f"{row.owner} does not install {key}")


def test_an_unknown_key_is_a_key_error_naming_the_declared_ones():
    for call in (lambda: patches.installed("clips"), lambda: patches.undo("clips"),
                 lambda: patches.replace("clips", object, "x", None)):
        with pytest.raises(KeyError, match="backward-root"):
            call()


def test_replace_keeps_the_first_original_and_undo_deletes_what_a_class_only_inherited():
    class Base:
        def step(self):
            return "base"

    class Child(Base):
        pass

    original = Base.step
    try:
        patches.replace("schedulers", Base, "step", lambda self: "first")
        patches.replace("schedulers", Base, "step", lambda self: "second")
        patches.replace("schedulers", Child, "step", lambda self: "child")
        assert Base().step() == "second" and Child().step() == "child"
        assert patches.is_replacement(vars(Base)["step"]) and not patches.is_replacement(original)
    finally:
        patches.undo("schedulers")
    assert vars(Base)["step"] is original and "step" not in vars(Child) and Child().step() == "base"


# -- every global patch goes through runtime/patches.py -------------------------------------------------------
# setattr/delattr targets outside runtime/patches.py, each one object's own attribute, with why:
OWN_ATTRIBUTE_WRITES = {
    ("aiak/runtime/marks.py", "obj"): "a mark on a user's object (MARKS)",
    ("aiak/optim/scheduler.py", "s"): "a scheduler's own per-group lists, remapped to the swapped optimizer's groups",
    ("aiak/loaders/window_loader.py", "self.loader"): "an attribute set on the wrapper, forwarded to the loader",
    ("aiak/loaders/prefetch.py", "loader"): "an attribute set on the wrapper, forwarded to the loader",
    ("aiak/step/wrappers.py", "wrapper"): "a framework's optimizer wrapper pointed at the optimizer again",
}


def _torch_names(tree: ast.Module) -> set:
    """Names bound to torch in a module: its imports of torch, names assigned a plain attribute chain of one
    (``graph = torch.autograd.graph``, ``cls = torch.amp.GradScaler``) and loop variables over a tuple or list
    of such (``for module in (torch.nn.utils, _clip_grad)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            names |= {a.asname or a.name for a in node.names}
    grew = True
    while grew:
        grew = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _root(node.value) in names and _is_chain(node.value):
                bound = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                    isinstance(node.iter, (ast.Tuple, ast.List)) and node.iter.elts and \
                    all(_root(e) in names and _is_chain(e) for e in node.iter.elts):
                bound = [node.target.id]
            else:
                continue
            grew = grew or bool(set(bound) - names)
            names |= set(bound)
    return names


def _is_chain(node: ast.AST) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _root(node: ast.AST):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _settings(node: ast.AST) -> bool:
    """``torch.backends.…``: process settings (TF32, cuDNN autotuning), which runtime/switches.py writes and the
    rollback puts back, not functions."""
    return (ast.unparse(node) + ".").startswith("torch.backends.")


def test_no_module_but_runtime_patches_replaces_an_attribute_of_torch():
    """The rule: outside ``aiak/runtime/patches.py``, (1) no assignment's target is an attribute of a name bound to
    torch (an import of torch, or a plain attribute chain of one assigned to a name: ``torch.nn.utils.x = …``,
    ``dist.all_reduce = …``, ``DistributedDataParallel.__init__ = …``, ``cls.scale = …`` after ``cls =
    torch.amp.GradScaler``), except torch.backends' settings; (2) every ``setattr``/``delattr`` names its target
    in :data:`OWN_ATTRIBUTE_WRITES` (one object's own attribute, with why), or is on torch.backends' settings.
    Writes on objects, not on torch's modules and classes, pass: ``self.ddp.require_backward_grad_sync``,
    ``vars(module)["_call_impl"]``, ``module.__class__``. A setattr on a class or module found at run time
    (a scheduler subclass, a timm module) cannot be told from a per-object one by reading, so (2) lists them all:
    a new one fails here until it is listed or goes through ``patches.replace``."""
    found = []
    for path in sorted(AIAK.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "aiak/runtime/patches.py":
            continue
        tree = ast.parse(path.read_text())
        torch_names = _torch_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Attribute) and _root(t) in torch_names and not _settings(t):
                            found.append(f"{rel}:{node.lineno}: {ast.unparse(t)} = ...")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and node.args:
                target = ast.unparse(node.args[0])
                if (rel, target) not in OWN_ATTRIBUTE_WRITES and not _settings(node.args[0]):
                    found.append(f"{rel}:{node.lineno}: {node.func.id}({target}, ...)")
    assert not found, "global patches made outside aiak.runtime.patches.replace:\n" + "\n".join(found)


def test_the_allowed_writes_still_exist():
    for (rel, target), why in OWN_ATTRIBUTE_WRITES.items():
        assert f"setattr({target}," in (ROOT / rel).read_text(), (rel, target, why)
