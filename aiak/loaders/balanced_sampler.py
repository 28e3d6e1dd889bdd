"""Length-balanced batches across ranks for variable-length samples, and a padding collate.

With ``DistributedSampler`` each rank draws random samples, so at every step one rank gets the long
sequences and the others wait for it at the gradient allreduce. ``BalancedBatchSampler`` buckets samples
by length (a global sort, ties broken at random), cuts the sorted order into steps of similar lengths and
deals each step out so that every rank gets a batch of near-equal token count (largest-first onto the rank
with fewest tokens). The order of the steps is shuffled. All of it is a pure function of
``(lengths, seed, epoch)``, so every rank computes the same plan without communicating, and every rank gets
the same number of batches. Rebuilt from a user's ``DataLoader`` it follows that loader's sampler instead
(``follow=``): a ``DistributedSampler``'s seed and epoch, or each epoch's permutation drawn from a
``RandomSampler``. With ``max_tokens`` the per-rank batch size varies so that a padded batch
(``batch size * longest sample``) stays within the budget, as in fairseq's token-based batching
(Ott et al., 2019, "fairseq: A Fast, Extensible Toolkit for Sequence Modeling").
"""
from __future__ import annotations

import array
import hashlib
import heapq
import math
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import DistributedSampler, RandomSampler, Sampler, SequentialSampler

from aiak.util.dist import process_group_exists


def _default_rank_and_world(rank: Optional[int], world_size: Optional[int]):
    import torch.distributed as dist

    initialized = process_group_exists()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    return rank, world_size


def _order_settings(follow: Sampler, num_samples: int) -> Tuple[bool, Optional[int]]:
    """``(shuffle, seed)`` of a sampler to follow; an error says which samplers can be followed and why not."""
    if isinstance(follow, DistributedSampler):
        return follow.shuffle, follow.seed
    if isinstance(follow, RandomSampler):
        if follow.replacement or follow.num_samples != num_samples:
            raise ValueError("BalancedBatchSampler: follow= a RandomSampler that draws with replacement or "
                             f"num_samples={follow.num_samples} of {num_samples}; a balanced epoch uses every sample "
                             "once")
        return True, None
    if isinstance(follow, SequentialSampler):
        return False, 0
    raise TypeError(f"BalancedBatchSampler: follow must be a DistributedSampler, RandomSampler or SequentialSampler, "
                    f"got {type(follow).__name__}")


class BalancedBatchSampler(Sampler[List[int]]):
    """Batch sampler giving every rank, at every step, a batch of near-equal token count.

    With variable-length data (text, speech), ranks that draw batches of unequal padded length wait at every
    allreduce for the longest: sorting by length and dealing batches of equal token budget to the ranks removes the
    wait. The number of steps depends only on the lengths and the limits, never on the order, so ranks that draw
    different orders still agree on it (a rank with more steps would wait forever at the allreduce). Standalone, use
    as `DataLoader(dataset, batch_sampler=sampler, collate_fn=PadCollate())` and call `sampler.set_epoch(epoch)`
    every epoch (`PrefetchLoader.set_epoch` forwards it).

    Args:
        lengths: length (tokens) of every sample of the dataset.
        batch_size: samples per rank per step (fixed batch size). Give this or `max_tokens` (or both: then
            a batch holds at most `batch_size` samples and at most `max_tokens` padded tokens).
        max_tokens: budget of padded tokens (`samples * longest`) per rank per step.
        num_replicas: the number of ranks; defaults to the followed `DistributedSampler`'s, else the initialized
            process group's, else 1.
        rank: this process's rank, defaulting alike (else 0).
        shuffle: shuffle ties and the order of steps (deterministically from `seed` and `epoch`); default True.
        seed: same on every rank; default 0.
        drop_last: drop the last step when it cannot give every rank a full share; otherwise it is completed
            with samples from the start of the plan (as `DistributedSampler` pads), so no sample is lost.
        follow: the sampler a `DataLoader` had before balancing (`aiak.loaders.balance_loader` passes
            it), so that every epoch is shuffled as that sampler would have shuffled it. `shuffle` and `seed`
            then come from it (leave them unset):

            * `DistributedSampler`: its `shuffle` and `seed`; the epoch is its `epoch`, read when an
              epoch starts, and `set_epoch` here calls its `set_epoch`, so both always agree.
            * `RandomSampler`: every epoch iterates it once, so its generator (or torch's global RNG) is
              consumed exactly as a plain `DataLoader` would consume it, and that permutation breaks the ties;
              the steps are shuffled by a generator seeded from a digest of it. No `set_epoch` is needed. On
              several ranks the order must be common, so it comes from seed 0 and an epoch counted per
              `iter()` instead (still a new shuffle every epoch).
            * `SequentialSampler`: no shuffling; the same batches every epoch.

    Raises:
        ValueError: `lengths` is not a non-empty 1-D sequence of non-negative integers, neither `batch_size` nor
            `max_tokens` is given (or one is not a positive integer), `max_tokens` is below the longest sample,
            `rank` is outside `[0, num_replicas)`, `shuffle`/`seed` are given with `follow`, or `follow` draws with
            replacement.
        TypeError: `follow` is not a `DistributedSampler`, `RandomSampler` or `SequentialSampler`.
    """

    def __init__(self, lengths: Sequence[int], batch_size: Optional[int] = None, *, max_tokens: Optional[int] = None,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None, shuffle: Optional[bool] = None,
                 seed: Optional[int] = None, drop_last: bool = False, follow: Optional[Sampler] = None):
        lengths = torch.as_tensor(list(lengths) if not isinstance(lengths, torch.Tensor) else lengths)
        if lengths.dim() != 1 or lengths.numel() == 0 or lengths.is_floating_point() or bool((lengths < 0).any()):
            raise ValueError("BalancedBatchSampler: lengths must be a non-empty 1-D sequence of non-negative integers")
        if batch_size is None and max_tokens is None:
            raise ValueError("BalancedBatchSampler: give batch_size (samples per rank) or max_tokens (tokens per rank)")
        for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"BalancedBatchSampler: {name} must be a positive integer or None, got {value!r}")
        if follow is not None:
            if shuffle is not None or seed is not None:
                raise ValueError("BalancedBatchSampler: give shuffle/seed or follow, not both (with follow they are "
                                 "the followed sampler's)")
            shuffle, seed = _order_settings(follow, lengths.numel())
            if isinstance(follow, DistributedSampler):
                num_replicas = follow.num_replicas if num_replicas is None else num_replicas
                rank = follow.rank if rank is None else rank
        rank, num_replicas = _default_rank_and_world(rank, num_replicas)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"BalancedBatchSampler: rank must be in [0, {num_replicas}), got {rank}")
        if max_tokens is not None and int(lengths.max()) > max_tokens:
            raise ValueError(f"BalancedBatchSampler: max_tokens={max_tokens} is smaller than the longest sample "
                             f"({int(lengths.max())} tokens); raise max_tokens or truncate the data")
        self.lengths = lengths.long()
        self._lens: List[int] = self.lengths.tolist()
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = True if shuffle is None else shuffle
        self.seed = 0 if seed is None and not isinstance(follow, RandomSampler) else seed
        self.drop_last = drop_last
        self.follow = follow
        self._epoch = 0
        self._plan_cache: Optional[tuple] = None
        self._drawn_plan: Optional[List[List[List[int]]]] = None
        self._num_steps: Optional[int] = None

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` plans: the followed ``DistributedSampler``'s, else the last ``set_epoch``."""
        return self.follow.epoch if isinstance(self.follow, DistributedSampler) else self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        if isinstance(self.follow, DistributedSampler):
            self.follow.set_epoch(epoch)

    # -- the plan: a list of steps, each a list of ``num_replicas`` batches -------------------------------
    def plan(self, epoch: Optional[int] = None) -> List[List[List[int]]]:
        """All ranks' batches for an epoch: ``plan[step][rank]`` is a list of dataset indices.

        A pure function of ``(lengths, seed, epoch)``; when following a ``RandomSampler`` it is instead the plan
        drawn when the current epoch started (``epoch`` must then be None).
        """
        if isinstance(self.follow, RandomSampler):
            if epoch is not None:
                raise ValueError("BalancedBatchSampler.plan: the order follows a RandomSampler, which has no epochs; "
                                 "call plan() without an epoch")
            if self._drawn_plan is None:
                raise RuntimeError("BalancedBatchSampler.plan: no epoch has started; the order of a followed "
                                   "RandomSampler is drawn when iteration starts")
            return self._drawn_plan
        return self._seeded_plan(self.epoch if epoch is None else epoch)

    def _seeded_plan(self, epoch: int) -> List[List[List[int]]]:
        if self._plan_cache is not None and self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        generator = torch.Generator().manual_seed((self.seed or 0) * 1_000_003 + epoch)
        n = self.lengths.numel()
        order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        steps = self._build(order, generator if self.shuffle else None)
        self._plan_cache = (epoch, steps)
        return steps

    def _draw_plan(self) -> List[List[List[int]]]:
        """One epoch of the followed RandomSampler, balanced: its permutation breaks the ties and seeds the steps.

        On several ranks the ranks must deal from one order (or they would train on overlapping shares),
        whatever their RNGs hold: the plan is then a pure function of the epoch, counted here (a new shuffle
        every epoch, as the RandomSampler gives), and the sampler is still iterated so that its generator, or
        torch's global RNG, is consumed as a plain ``DataLoader`` would consume it.
        """
        order = list(self.follow)
        if self.num_replicas > 1:
            self._drawn_plan = self._seeded_plan(self._epoch)
            self._epoch += 1
            return self._drawn_plan
        digest = hashlib.blake2b(array.array("q", order).tobytes(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        self._drawn_plan = self._build(torch.tensor(order, dtype=torch.long), generator)
        return self._drawn_plan

    def _build(self, order: torch.Tensor, step_generator: Optional[torch.Generator]) -> List[List[List[int]]]:
        """Sort ``order`` by length (stable: ``order`` breaks ties), cut it into steps, deal them, shuffle them."""
        order = order[torch.sort(self.lengths[order], stable=True).indices].tolist()
        steps = [self._deal(group) for group in self._cut(order)]
        if steps and self._short(steps[-1]):
            if self.drop_last:
                steps.pop()
            else:
                steps[-1] = self._complete(steps[-1], order)
        if step_generator is not None:
            steps = [steps[i] for i in torch.randperm(len(steps), generator=step_generator).tolist()]
        return steps

    def _per_rank(self, count: int, longest: int) -> bool:
        """Whether ``count`` samples per rank, the longest ``longest`` tokens, fit the limits."""
        if self.batch_size is not None and count > self.batch_size:
            return False
        return self.max_tokens is None or count * longest <= self.max_tokens

    def _cut(self, sorted_indices: List[int]) -> List[List[int]]:
        """Cut the length-sorted order into consecutive groups, one group per step."""
        world = self.num_replicas
        if self.max_tokens is None:
            size = self.batch_size * world
            return [sorted_indices[i:i + size] for i in range(0, len(sorted_indices), size)]
        groups, current = [], []
        for index in sorted_indices:
            longest = self._lens[index]  # ascending order: the newcomer is the longest
            if current and not self._per_rank(math.ceil((len(current) + 1) / world), longest):
                groups.append(current)
                current = []
            current.append(index)
        if current:
            groups.append(current)
        return groups

    def _deal(self, group: List[int]) -> List[List[int]]:
        """Deal one step's samples to ranks: longest first, onto the rank with fewest tokens that has room."""
        world = self.num_replicas
        per_rank = math.ceil(len(group) / world)
        batches: List[List[int]] = [[] for _ in range(world)]
        open_ranks = [(0, rank) for rank in range(world)]  # heap of (tokens so far, rank) with room left
        for index in sorted(group, key=lambda i: -self._lens[i]):
            tokens, rank = heapq.heappop(open_ranks)
            batches[rank].append(index)
            if len(batches[rank]) < per_rank:
                heapq.heappush(open_ranks, (tokens + self._lens[index], rank))
        return batches

    def _short(self, step: List[List[int]]) -> bool:
        sizes = {len(b) for b in step}
        if self.max_tokens is None:
            return sizes != {self.batch_size}
        return 0 in sizes

    def _complete(self, step: List[List[int]], sorted_indices: List[int]) -> List[List[int]]:
        """Fill a short last step with the shortest samples so every rank has a batch (like DistributedSampler)."""
        flat = [i for b in step for i in b]
        per_rank = self.batch_size if self.max_tokens is None else max(len(b) for b in step)
        target = per_rank * self.num_replicas
        filler = iter(sorted_indices * (1 + target // max(1, len(sorted_indices))))
        while len(flat) < target:
            flat.append(next(filler))
        return self._deal(flat)

    # -- Sampler protocol --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[List[int]]:
        # A generator: the order is drawn at the first next(), where a DataLoader's RandomSampler draws it too.
        plan = self._draw_plan() if isinstance(self.follow, RandomSampler) else self.plan()
        for step in plan:
            yield list(step[self.rank])

    def __len__(self) -> int:
        # Computed once, from the identity order: the count does not depend on the order (class docstring).
        if self._num_steps is None:
            self._num_steps = len(self._build(torch.arange(self.lengths.numel()), None))
        return self._num_steps


def tokens_per_rank(plan_step: List[List[int]], lengths: Sequence[int], padded: bool = True) -> List[int]:
    """Tokens each rank processes in one step: ``len(batch) * longest`` if ``padded``, else the sum of lengths."""
    out = []
    for batch in plan_step:
        sizes = [int(lengths[i]) for i in batch]
        out.append((len(sizes) * max(sizes) if sizes else 0) if padded else sum(sizes))
    return out


def _round_up(value: int, multiple: Optional[int]) -> int:
    return value if not multiple or multiple <= 1 else -(-value // multiple) * multiple


class PadCollate:
    """Collate variable-length samples: pad sequence fields along dim 0 to a common length, then stack.

    Samples may be tensors, tuples/lists (namedtuples too) or dicts of tensors; Python numbers become tensors.
    ``fields`` names the sequence fields (dict keys or tuple positions); by default every tensor field with at
    least one dimension is one. Sequence fields are padded to the batch's longest, rounded up to
    ``multiple_of`` (8 suits tensor cores; ``None`` or 1 pads to the batch max); other fields are stacked.
    ``pad_value`` is a number, or a dict ``{field: value}`` (e.g. ``{"labels": -100}``) with ``"default"`` for
    the rest. With ``return_mask`` dict samples also get ``attention_mask`` (1 = real token) from the first
    sequence field.
    """

    def __init__(self, pad_value: Union[float, Dict[Any, float]] = 0, multiple_of: Optional[int] = 8,
                 return_mask: bool = False, fields: Optional[Sequence[Any]] = None):
        if multiple_of is not None and (isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1):
            raise ValueError(f"PadCollate: multiple_of must be a positive integer or None, got {multiple_of!r}")
        self.pad_value = pad_value
        self.multiple_of = multiple_of
        self.return_mask = return_mask
        self.fields = None if fields is None else tuple(fields)

    def _value(self, key: Any) -> float:
        if isinstance(self.pad_value, Mapping):
            return self.pad_value.get(key, self.pad_value.get("default", 0))
        return self.pad_value

    def _field(self, items: List[Any], key: Any):
        if not isinstance(items[0], torch.Tensor):
            return torch.as_tensor(items), None
        is_sequence = items[0].dim() >= 1 and (self.fields is None or key in self.fields)
        if not is_sequence:
            if any(t.shape != items[0].shape for t in items):
                raise ValueError(f"PadCollate: field {key!r} is not a sequence field but its shapes differ: "
                                 f"{sorted({tuple(t.shape) for t in items})}; add it to fields=")
            return torch.stack(items), None
        if any(t.dim() == 0 or t.shape[1:] != items[0].shape[1:] for t in items):
            raise ValueError(f"PadCollate: field {key!r} has tensors that differ beyond dim 0: "
                             f"{sorted({tuple(t.shape) for t in items})}")
        longest = _round_up(max(t.shape[0] for t in items), self.multiple_of)
        out = items[0].new_full((len(items), longest, *items[0].shape[1:]), self._value(key))
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for row, t in enumerate(items):
            out[row, :t.shape[0]] = t
            mask[row, :t.shape[0]] = 1
        return out, mask

    def __call__(self, samples: List[Any]) -> Any:
        if not samples:
            raise ValueError("PadCollate: empty batch")
        first = samples[0]
        if isinstance(first, torch.Tensor):
            return self._field(samples, 0)[0]
        if isinstance(first, Mapping):
            out, mask = {}, None
            for key in first:
                out[key], field_mask = self._field([s[key] for s in samples], key)
                mask = mask if mask is not None else field_mask
            if self.return_mask and mask is not None and "attention_mask" not in out:
                out["attention_mask"] = mask
            return out
        if isinstance(first, (tuple, list)):
            fields = [self._field([s[i] for s in samples], i)[0] for i in range(len(first))]
            return type(first)(*fields) if hasattr(first, "_fields") else type(first)(fields)
        raise TypeError(f"PadCollate: samples must be tensors, tuples/lists or dicts, got {type(first).__name__}")
