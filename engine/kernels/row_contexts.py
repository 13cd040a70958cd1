"""Each AR row's context kept dense for the engine's decode attention, and that attention.

The model's own decode attention (`kv_cache.DecodeAttention`) gathers every row's keys and values
from the pool's scattered slots in every layer of every step. The engine keeps a dense copy of
each row's context instead, one position appended a step, and reads it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from intone.engine.kernels import row_attention
from intone.engine.models.pocket.kv_cache import (
    KVPool,
    SequenceAttention,
    SequenceStep,
    TensorFields,
    Upload,
)

CONTEXT_RUN = 64


class RowContexts:
    """Each row of a decode batch's context as one dense run:
    [layers, contexts, kv_heads, capacity, head_dim] for keys and for values.

    A decode step reads every row's whole context in every layer. Gathered from the pool's
    scattered slots, that was a padded copy per layer per step, which cost 3-4x the attention
    itself (16 rows x 150 positions, 16 heads of 64, one core: 4.3 ms a layer gathered, 1.1 ms
    read in place). Here row i of a step reads context i, so a step reads `[:rows, :, :length]`
    of a layer as a view. A row's context is copied in from the pool once, when it is seated;
    after that each step appends its one position. The pool gets every position as well and stays
    the record: a row whose context went to another re-seats from it.

    The contexts are reserved once, `rows` of `capacity` positions, and do not move: grown on
    demand, every context was zeroed and copied while the step waited (64 rows of the 2M model,
    2 cores: 140-210 ms, in the first step of a burst of new streams, which ran the streams
    already playing dry). The reservation is `torch.empty`: on a CPU its pages take memory only
    once written, and a context is zeroed only as far as a step reads it (`clean`), so memory is
    what the rows' contexts reach, `nbytes`. A step past the reservation still grows it.
    """

    def __init__(
        self, pool: KVPool, rows: int = 0, capacity: int = 0, dtype: torch.dtype | None = None
    ):
        """`dtype`: the contexts' (default the pool's); a copy from the pool rounds to it."""
        self.pool = pool
        layers, heads, _, dim = pool.keys.shape
        shape = (layers, rows, heads, _rounded(capacity), dim)
        self.keys = pool.keys.new_empty(shape, dtype=dtype)
        self.values = pool.values.new_empty(shape, dtype=dtype)
        self.owners: list[object | None] = [None] * rows  # whose context each one holds
        self.lengths: list[int] = [0] * rows  # positions each holds once its step is done
        self.clean: list[int] = [0] * rows  # positions of each written or zeroed

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        """Memory the contexts' written positions take (the rest of the reservation takes none
        on a CPU until a step reads that far)."""
        layers, _, heads, _, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size() * sum(self.clean)

    def seat(
        self, histories: list[torch.Tensor], owners: list[object | None], length: int
    ) -> list[int]:
        """Seat row r, whose context before this step is at pool slots `histories[r]`, in one
        of contexts 0 .. rows - 1, contexts at least `length` long. `owners[r]` identifies the
        context (None: a padding row with none). Rows keep the context they held if it is in
        range and up to date; the others move from one out of range or fill from the pool.
        Returns the rows in context order."""
        rows = len(histories)
        self._grow(rows, length)
        held = {id(owner): i for i, owner in enumerate(self.owners) if owner is not None}

        def current(row: int) -> int | None:
            i = held.get(id(owners[row])) if owners[row] is not None else None
            return i if i is not None and self.lengths[i] == len(histories[row]) else None

        context_of = [
            i if (i := current(r)) is not None and i < rows else None for r in range(rows)
        ]
        free = iter(sorted(set(range(rows)) - set(context_of)))
        for row in range(rows):
            if context_of[row] is not None:
                continue
            i = context_of[row] = next(free)
            n = len(histories[row])
            source = current(row)
            if source is not None:  # a context out of range: nobody writes it in this seating
                self.keys[:, i, :, :n] = self.keys[:, source, :, :n]
                self.values[:, i, :, :n] = self.values[:, source, :, :n]
            elif n:
                self.keys[:, i, :, :n] = self.pool.keys.index_select(2, histories[row])
                self.values[:, i, :, :n] = self.pool.values.index_select(2, histories[row])
            self.clean[i] = max(self.clean[i], n)
        seated = {id(owner) for owner in owners if owner is not None}
        self.owners = [None if id(owner) in seated else owner for owner in self.owners]
        for row, i in enumerate(context_of):
            self.owners[i] = owners[row]
            # Counted as if the step succeeds: after a failed one the lengths disagree with the
            # retry's history, so the retry re-seats from the pool.
            self.lengths[i] = len(histories[row]) + 1
        self._zero_up_to(rows, length)
        return sorted(range(rows), key=context_of.__getitem__)

    def fault_in(self, positions: int) -> None:
        """Write (zero) every context up to `positions` now. A context's first seating otherwise
        page-faults its memory in while the step waits: 16 full-size rows of 300 positions
        seated into fresh contexts took 155 ms on one core, into contexts written before
        47-58 ms, and a burst of 16 new streams at once waited that long for its second frame."""
        self._zero_up_to(len(self.owners), positions)

    def _zero_up_to(self, rows: int, length: int) -> None:
        """Contexts 0 .. rows - 1 hold finite values up to `length`: a step reads that far in
        every context and masks what is not the row's own, but a mask cannot hide a NaN of
        memory never written. Zeroed in runs of `_rounded` positions, once per context and run."""
        for i in range(rows):
            if self.clean[i] < length:
                end = min(_rounded(length), self.capacity)
                self.keys[:, i, :, self.clean[i] : end] = 0
                self.values[:, i, :, self.clean[i] : end] = 0
                self.clean[i] = end

    def store(
        self,
        layer: int,
        contexts: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new keys/values [rows, kv_heads, D] at positions[i] of context contexts[i]."""
        self.keys[layer, contexts, :, positions] = k.to(self.keys.dtype)
        self.values[layer, contexts, :, positions] = v.to(self.values.dtype)

    def context(self, layer: int, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of contexts 0 .. rows - 1, positions 0 .. length - 1:
        [rows, kv_heads, length, D]."""
        return self.keys[layer, :rows, :, :length], self.values[layer, :rows, :, :length]

    def _grow(self, rows: int, length: int) -> None:
        """Past the reservation: more contexts, or twice the positions (a copy of every one)."""
        count, capacity = self.keys.shape[1], self.capacity
        if rows <= count and length <= capacity:
            return
        layers, _, heads, _, dim = self.keys.shape
        grown_capacity = capacity if length <= capacity else max(_rounded(length), 2 * capacity)
        shape = (layers, max(rows, count), heads, grown_capacity, dim)
        for name in ("keys", "values"):
            grown = self.keys.new_empty(shape)
            grown[:, :count, :, :capacity] = getattr(self, name)
            setattr(self, name, grown)
        added = shape[1] - count
        self.owners += [None] * added
        self.lengths += [0] * added
        self.clean += [0] * added


def _rounded(length: int) -> int:
    """Positions in runs of 64: contexts are zeroed, and grow, a run at a time."""
    return -(-length // CONTEXT_RUN) * CONTEXT_RUN


@dataclass
class RowContextAttention:
    """Attention for a decode step through `RowContexts` in torch (implements `KVCache`): row i
    reads context i, `length` positions of it, masked by `bias`.

    Each layer writes the rows' new keys/values to the pool and to their contexts, then attends
    over views of the contexts, the query heads of a group sharing their KV head, softmax in
    float32 whatever the KV dtype.
    """

    pool: KVPool
    contexts: RowContexts
    write_slots: torch.Tensor  # [B]: each row's new position in the pool
    rows: torch.Tensor  # [B]: 0 .. B - 1, row i's context, made once for every layer
    positions: torch.Tensor  # [B]: the same position in the row's context
    length: int  # keys read per row: the longest row, maybe rounded up
    bias: torch.Tensor  # [B, 1, 1, length]: 0 where a row may see a key, -inf elsewhere

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.store(layer, self.write_slots, k, v)
        self.contexts.store(layer, self.rows, self.positions, k, v)
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        keys, values = self.contexts.context(layer, rows, self.length)
        # Contexts narrower than the queries (float16 beside float32) are read widened.
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        q = q.view(rows, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(q * dim**-0.5, keys.transpose(-1, -2)).float() + self.bias
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(rows, heads, dim)


@dataclass
class NativeRowAttention(TensorFields):
    """The same attention through row_attention's operators, each row read up to its own
    length (implements `KVCache`).

    It holds tensors only, no sizes and no owners of them: every value it uses reaches the
    operators as a tensor, so an AR step through it can be replayed as a trace with these as
    the trace's inputs (`tensors`, `from_tensors`), whatever the contexts' reservation is then.
    """

    pool_keys: torch.Tensor  # [layers, kv_heads, slots, D]: the pool
    pool_values: torch.Tensor
    context_keys: torch.Tensor  # [layers, contexts, kv_heads, capacity, D]: RowContexts'
    context_values: torch.Tensor
    pool_offsets: torch.Tensor  # [B]: where each row's new position starts in a pool layer
    context_offsets: torch.Tensor  # [B]: and in a layer of the contexts, in elements
    lengths: torch.Tensor  # [B] (int64): keys row i reads, its own position included

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.context_keys[layer], self.context_values[layer]
        row_attention.store(k, self.pool_keys[layer], self.pool_offsets)
        row_attention.store(k, keys, self.context_offsets)
        row_attention.store(v, self.pool_values[layer], self.pool_offsets)
        row_attention.store(v, values, self.context_offsets)
        return row_attention.attend(q, keys, values, self.lengths)


@dataclass
class JointAttention:
    """A prompt pass and an AR step as one pass (implements `KVCache`): its first rows, one per
    position `prompts` writes, attend through `prompts`; the rest, one per AR row, through
    `steps`. Both parts hold tensors only, and so does it (`tensors`, `from_tensors`): a pass
    through it replays as a trace whatever its prompts, rows and contexts."""

    prompts: SequenceAttention
    steps: NativeRowAttention

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = self.prompts.write_slots.shape[0]
        first = self.prompts.attend(layer, q[:n], k[:n], v[:n])
        return torch.cat([first, self.steps.attend(layer, q[n:], k[n:], v[n:])])

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = (("prompts.", self.prompts), ("steps.", self.steps))
        return {prefix + name: t for prefix, part in parts for name, t in part.tensors().items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> JointAttention:
        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}

        return cls(
            SequenceAttention.from_tensors(part("prompts.")),
            NativeRowAttention.from_tensors(part("steps.")),
        )


def plan_row_context_step(
    contexts: RowContexts,
    steps: list[SequenceStep],
    owners: list[object | None],
    key_multiple: int = 1,
    native: bool = False,
    upload: Upload | None = None,
) -> tuple[list[int], torch.Tensor, RowContextAttention | NativeRowAttention]:
    """(order, positions [B], attention) for a decode step (one new position per sequence)
    through `contexts`. The step runs its rows in `order` (order[i]: the step in context i), so
    its inputs and outputs are in that order; `owners` as in `RowContexts.seat`; `native`: attend
    through row_attention's operators (loaded, contexts in float32 on the CPU only); `upload` as
    in `kv_cache.plan_step`."""
    assert all(s.num_new == 1 for s in steps)
    device = contexts.pool.keys.device
    to_device = upload or (lambda tensor: tensor.to(device))
    longest = -(-max(len(s.slots) for s in steps) // key_multiple) * key_multiple
    order = contexts.seat([to_device(s.slots[:-1]) for s in steps], owners, longest)
    steps = [steps[i] for i in order]
    lengths = torch.tensor([len(s.slots) for s in steps])
    positions = lengths - 1
    write_slots = torch.cat([s.slots[-1:] for s in steps])
    device_positions = to_device(positions)
    if native:
        dim = contexts.keys.shape[-1]
        rows = torch.arange(len(steps))
        context_offsets = rows * contexts.keys.stride(1) + positions * dim
        return (
            order,
            device_positions,
            NativeRowAttention(
                contexts.pool.keys,
                contexts.pool.values,
                contexts.keys,
                contexts.values,
                to_device(write_slots * dim),
                to_device(context_offsets),
                to_device(lengths),
            ),
        )
    visible = torch.arange(longest)[None, :] < lengths[:, None]
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    attention = RowContextAttention(
        contexts.pool,
        contexts,
        to_device(write_slots),
        torch.arange(len(steps), device=device),
        device_positions,
        longest,
        to_device(bias[:, None, None]),
    )
    return order, device_positions, attention
