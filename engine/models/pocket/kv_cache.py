"""FlowLM key/value storage: a flat pool of slots, addressed by slot indices.

A slot holds one position's rotated key and value for every layer. Who decides which slot a
position lives in is the caller's business: the single-request path gives a request one contiguous
run of slots, the engine's block manager hands out fixed-size pages. Either way a step only needs
the slot of every position it reads and writes, so the attention code is the same for both and a
batch never copies caches when its membership changes.

The pool holds `num_kv_heads` heads per position; queries may have more (grouped-query attention,
num_heads a multiple of num_kv_heads): query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from intone.engine.models.pocket import lane_ops


class KVPool:
    """Keys and values of the attention's key/value heads, stored head-major:
    [layers, kv_heads, slots, head_dim].

    Head-major because its reads (a prefill's context, a row's context copied into its lane)
    are one `index_select` per layer straight into the [kv_heads, length, head_dim] layout the
    batched matmuls take: measured on one CPU core (16 rows x 150 positions, 16 heads of 64),
    1.3 ms per gather, against 8.3 ms for advanced indexing into a slot-major pool and 2.3 ms
    for a slot-major gather plus transpose.
    `write`/`read` take and give the slot-major [layers, n, kv_heads, head_dim] of a voice."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_heads, num_slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def slot_bytes(self) -> int:
        """Memory one slot (one position, every layer, keys and values) takes."""
        layers, heads, _, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size()

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [layers, n, H, D] computed elsewhere (a voice state) at slots [n]."""
        self.keys.index_copy_(2, slots, keys.transpose(1, 2).to(self.keys))
        self.values.index_copy_(2, slots, values.transpose(1, 2).to(self.values))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [layers, n, H, D] at slots [n]."""
        keys = self.keys.index_select(2, slots).transpose(1, 2).contiguous()
        return keys, self.values.index_select(2, slots).transpose(1, 2).contiguous()

    def copy(self, source: slice, target: slice) -> None:
        """Copy the slots `source` to `target` (a shared page's positions into a private one)."""
        self.keys[:, :, target] = self.keys[:, :, source]
        self.values[:, :, target] = self.values[:, :, source]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new keys/values [n, H, D] at slots [n]."""
        self.keys[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.values[layer].index_copy_(1, slots, v.transpose(0, 1))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys/values at slots [n], head-major: [H, n, D]."""
        return self.keys[layer].index_select(1, slots), self.values[layer].index_select(1, slots)


LANE_RUN = 64


class KVLanes:
    """Each row of a decode batch's context as one dense run:
    [layers, lanes, kv_heads, capacity, head_dim] for keys and for values.

    A decode step reads every row's whole context in every layer. Gathered from the pool's
    scattered slots, that was a padded copy per layer per step, which cost 3-4x the attention
    itself (16 rows x 150 positions, 16 heads of 64, one core: 4.3 ms a layer gathered, 1.1 ms
    read in place). Here row i of a step sits in lane i, so a step reads `[:rows, :, :length]`
    of a layer as a view. A row's context is copied in from the pool once, when it takes a lane;
    after that each step appends its one position. The pool gets every position as well and stays
    the record: a row whose lane went to another re-seats from it.

    The lanes are reserved once, `rows` lanes of `capacity` positions, and do not move: grown
    on demand, every lane was zeroed and copied while the step waited (64 rows of the 2M model,
    2 cores: 140-210 ms, in the first step of a burst of new streams, which ran the streams
    already playing dry). The reservation is `torch.empty`: on a CPU its pages take memory only
    once written, and a lane is zeroed only as far as a step reads it (`clean`), so memory is
    what the rows' contexts reach, `nbytes`. A step past the reservation still grows it.
    """

    def __init__(self, pool: KVPool, rows: int = 0, capacity: int = 0):
        self.pool = pool
        layers, heads, _, dim = pool.keys.shape
        shape = (layers, rows, heads, _rounded(capacity), dim)
        self.keys = pool.keys.new_empty(shape)
        self.values = pool.values.new_empty(shape)
        self.owners: list[object | None] = [None] * rows  # whose context each lane holds
        self.lengths: list[int] = [0] * rows  # positions the lane holds once its step is done
        self.clean: list[int] = [0] * rows  # positions of the lane written or zeroed

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        """Memory the lanes' written positions take (the rest of the reservation takes none
        on a CPU until a step reads that far)."""
        return self.pool.slot_bytes * sum(self.clean)

    def seat(
        self, histories: list[torch.Tensor], owners: list[object | None], length: int
    ) -> list[int]:
        """Seat row r, whose context before this step is at pool slots `histories[r]`, in one
        of lanes 0 .. rows - 1, lanes at least `length` long. `owners[r]` identifies the context
        (None: a padding row with none). Rows keep the lane they held if it is in range and up
        to date; the others move from a lane out of range or fill from the pool. Returns the
        rows in lane order."""
        rows = len(histories)
        self._grow(rows, length)
        held = {id(owner): lane for lane, owner in enumerate(self.owners) if owner is not None}

        def current(row: int) -> int | None:
            lane = held.get(id(owners[row])) if owners[row] is not None else None
            return lane if lane is not None and self.lengths[lane] == len(histories[row]) else None

        lane_of = [
            lane if (lane := current(r)) is not None and lane < rows else None for r in range(rows)
        ]
        free = iter(sorted(set(range(rows)) - set(lane_of)))
        for row in range(rows):
            if lane_of[row] is not None:
                continue
            lane = lane_of[row] = next(free)
            n = len(histories[row])
            source = current(row)
            if source is not None:  # a lane out of range: nobody writes it in this seating
                self.keys[:, lane, :, :n] = self.keys[:, source, :, :n]
                self.values[:, lane, :, :n] = self.values[:, source, :, :n]
            elif n:
                self.keys[:, lane, :, :n] = self.pool.keys.index_select(2, histories[row])
                self.values[:, lane, :, :n] = self.pool.values.index_select(2, histories[row])
            self.clean[lane] = max(self.clean[lane], n)
        seated = {id(owner) for owner in owners if owner is not None}
        self.owners = [None if id(owner) in seated else owner for owner in self.owners]
        for row, lane in enumerate(lane_of):
            self.owners[lane] = owners[row]
            # Counted as if the step succeeds: after a failed one the lengths disagree with the
            # retry's history, so the retry re-seats from the pool.
            self.lengths[lane] = len(histories[row]) + 1
        self._zero_up_to(rows, length)
        return sorted(range(rows), key=lane_of.__getitem__)

    def prefault(self, positions: int) -> None:
        """Write (zero) every lane up to `positions` now. A lane's first seating otherwise
        page-faults its memory in while the step waits: 16 full-size rows of 300 positions
        seated into fresh lanes took 155 ms on one core, into lanes written before 47-58 ms, and
        a burst of 16 new streams at once waited that long for its second frame."""
        self._zero_up_to(len(self.owners), positions)

    def _zero_up_to(self, rows: int, length: int) -> None:
        """Lanes 0 .. rows - 1 hold finite values up to `length`: a step reads that far in
        every lane and masks what is not the row's own, but a mask cannot hide a NaN of memory
        never written. Zeroed in runs of `_rounded` positions, once per lane and run."""
        for lane in range(rows):
            if self.clean[lane] < length:
                end = min(_rounded(length), self.capacity)
                self.keys[:, lane, :, self.clean[lane] : end] = 0
                self.values[:, lane, :, self.clean[lane] : end] = 0
                self.clean[lane] = end

    def store(
        self,
        layer: int,
        lanes: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new keys/values [rows, kv_heads, D] at positions[i] of lane lanes[i]."""
        self.keys[layer, lanes, :, positions] = k
        self.values[layer, lanes, :, positions] = v

    def context(self, layer: int, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of lanes 0 .. rows - 1, positions 0 .. length - 1: [rows, kv_heads, length, D]."""
        return self.keys[layer, :rows, :, :length], self.values[layer, :rows, :, :length]

    def _grow(self, rows: int, length: int) -> None:
        """Past the reservation: more lanes, or twice the positions (a copy of every lane)."""
        lanes, capacity = self.keys.shape[1], self.capacity
        if rows <= lanes and length <= capacity:
            return
        layers, _, heads, _, dim = self.keys.shape
        grown_capacity = capacity if length <= capacity else max(_rounded(length), 2 * capacity)
        shape = (layers, max(rows, lanes), heads, grown_capacity, dim)
        for name in ("keys", "values"):
            grown = self.keys.new_empty(shape)
            grown[:, :lanes, :, :capacity] = getattr(self, name)
            setattr(self, name, grown)
        added = shape[1] - lanes
        self.owners += [None] * added
        self.lengths += [0] * added
        self.clean += [0] * added


def _rounded(length: int) -> int:
    """Positions in runs of 64: lanes are zeroed, and grow, a run at a time."""
    return -(-length // LANE_RUN) * LANE_RUN


@dataclass
class SequenceStep:
    """One sequence's part of a FlowLM step.

    slots: the slot of every position of the sequence after this step, history first.
    num_new: how many trailing positions are computed in this step.
    """

    slots: torch.Tensor
    num_new: int


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention over gathered keys, head-major.

    q [Hkv, R, g * n, D] (g query heads per KV head, n queries each), keys/values [Hkv, R, L, D],
    bias broadcastable to [Hkv, R, g, n, L] (0 or -inf). The query heads of a group share one
    read of their KV head (no repeat); softmax runs in float32 whatever the KV dtype.
    """
    scores = torch.matmul(q * q.shape[-1] ** -0.5, keys.transpose(-1, -2))
    hkv, rows, gn, length = scores.shape
    scores = scores.view(hkv, rows, -1, bias.shape[-2], length).float() + bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(hkv, rows, gn, length)
    return torch.matmul(probs, values)


@dataclass
class DecodeAttention:
    """Attention for a step where every sequence adds one token (implements `KVCache`).

    read_slots [B, L]: each row's slots, padded (to its longest row, or a page multiple) with
    slot 0, which `bias` hides. Each layer gathers the rows' keys and values once from the
    head-major pool, straight into the [Hkv, B, L, D] layout the batched matmuls read.
    """

    pool: KVPool
    write_slots: torch.Tensor  # [B]
    read_slots: torch.Tensor  # [B, L]
    bias: torch.Tensor  # [1, B, 1, 1, L]: 0 where a row may see a key, -inf elsewhere

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.store(layer, self.write_slots, k, v)
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        q = q.view(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)
        k_ctx, v_ctx = self.pool.gather(layer, self.read_slots.view(-1))
        context = (kv_heads, rows, self.read_slots.shape[1], dim)
        out = _attend(q, k_ctx.view(context), v_ctx.view(context), self.bias)  # [Hkv, B, g, D]
        return out.transpose(0, 1).reshape(rows, heads, dim)


@dataclass
class VarlenAttention:
    """Attention for a packed pass of sequences adding several tokens each (implements `KVCache`).

    Queries arrive packed, [N, H, D]. Each sequence attends only to its own keys, causally: work
    and memory O(sum n_i * L_i), where a block-diagonal mask over the packed pass would be
    O(N * sum L_i).
    """

    pool: KVPool
    write_slots: torch.Tensor  # [N]
    read_slots: list[torch.Tensor]  # per sequence [L_i]
    num_new: list[int]  # per sequence n_i, in query order
    biases: list[torch.Tensor]  # per sequence [n_i, L_i]: 0 where a query may see a key, -inf

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.store(layer, self.write_slots, k, v)
        _, heads, dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        outputs = []
        for q_seq, slots, bias in zip(
            q.split(self.num_new), self.read_slots, self.biases, strict=True
        ):
            n = q_seq.shape[0]
            # [n, H, D] -> [Hkv, 1, g * n, D]: a group's queries side by side against its KV head.
            q_seq = q_seq.view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
            q_seq = q_seq.reshape(kv_heads, 1, group * n, dim)
            k_ctx, v_ctx = self.pool.gather(layer, slots)
            out = _attend(q_seq, k_ctx[:, None], v_ctx[:, None], bias)  # [Hkv, 1, g * n, D]
            outputs.append(out.view(kv_heads, group, n, dim).permute(2, 0, 1, 3))
        return torch.cat(outputs).reshape(-1, heads, dim)


SlotAttention = DecodeAttention | VarlenAttention


Upload = Callable[[torch.Tensor], torch.Tensor]


def plan_step(
    pool: KVPool,
    steps: list[SequenceStep],
    key_multiple: int = 1,
    upload: Upload | None = None,
) -> tuple[torch.Tensor, SlotAttention]:
    """Positions [N] and attention metadata for one packed FlowLM step.

    In a decode step the key length is rounded up to `key_multiple`, so that step shapes repeat.
    Everything is planned on the host and moved to the pool's device once, by `upload` (the
    engine's `DeviceIO.upload`; default `.to`); no step reads back from the device.
    """
    to_device = upload or _to(pool.keys.device)
    lengths = [len(s.slots) for s in steps]
    positions = torch.cat(
        [torch.arange(n - s.num_new, n) for s, n in zip(steps, lengths, strict=True)]
    )
    write_slots = to_device(torch.cat([s.slots[len(s.slots) - s.num_new :] for s in steps]))
    if all(s.num_new == 1 for s in steps):
        longest = -(-max(lengths) // key_multiple) * key_multiple
        # Pad with slot 0; the bias hides it.
        read_slots = torch.zeros(len(steps), longest, dtype=torch.long)
        for row, s in enumerate(steps):
            read_slots[row, : len(s.slots)] = s.slots
        visible = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        attention: SlotAttention = DecodeAttention(
            pool, write_slots, to_device(read_slots), to_device(bias[None, :, None, None])
        )
    else:
        biases = []
        for s, n in zip(steps, lengths, strict=True):
            # Query r (position n - num_new + r) sees keys 0 .. n - num_new + r.
            query_pos = torch.arange(n - s.num_new, n)
            hidden = torch.arange(n)[None, :] > query_pos[:, None]
            biases.append(to_device(torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))))
        attention = VarlenAttention(
            pool,
            write_slots,
            [to_device(s.slots) for s in steps],
            [s.num_new for s in steps],
            biases,
        )
    return to_device(positions), attention


def _to(device: torch.device) -> Upload:
    return lambda tensor: tensor.to(device)


@dataclass
class LaneAttention:
    """Attention for a decode step through `KVLanes` (implements `KVCache`): row i is lane i.

    Each layer writes the rows' new keys/values to the pool and to their lanes, then attends
    over the lanes, the query heads of a group sharing their KV head, softmax in float32
    whatever the KV dtype: with `native`, through lane_ops' operators (each row up to its own
    length), else in torch over views of the lanes, `length` positions each, masked by `bias`.
    """

    pool: KVPool
    lanes: KVLanes
    write_slots: torch.Tensor  # [B]: each row's new position in the pool
    rows: torch.Tensor  # [B]: 0 .. B - 1, row i's lane, made once for every layer
    positions: torch.Tensor  # [B]: the same position in the row's lane
    length: int  # keys read per row: the longest row, maybe rounded up
    bias: torch.Tensor  # [B, 1, 1, length]: 0 where a row may see a key, -inf elsewhere
    lengths: torch.Tensor  # [B] (int64): keys row i reads, its own position included
    native: bool = False
    # With `native`: where each row's new position starts in a layer of the pool and of the
    # lanes, in elements.
    pool_offsets: torch.Tensor = field(init=False)
    lane_offsets: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.native:
            dim = self.pool.keys.shape[-1]
            self.pool_offsets = (self.write_slots * dim).contiguous()
            lane_stride = self.lanes.keys.stride(1)
            self.lane_offsets = (self.rows * lane_stride + self.positions * dim).contiguous()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.native:
            keys, values = self.lanes.keys[layer], self.lanes.values[layer]
            for new, pool, lanes in ((k, self.pool.keys, keys), (v, self.pool.values, values)):
                lane_ops.store(new, pool[layer], self.pool_offsets)
                lane_ops.store(new, lanes, self.lane_offsets)
            return lane_ops.attend(q, keys, values, self.lengths)
        self.pool.store(layer, self.write_slots, k, v)
        self.lanes.store(layer, self.rows, self.positions, k, v)
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        keys, values = self.lanes.context(layer, rows, self.length)
        q = q.view(rows, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(q * dim**-0.5, keys.transpose(-1, -2)).float() + self.bias
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(rows, heads, dim)


def plan_lane_step(
    lanes: KVLanes,
    steps: list[SequenceStep],
    owners: list[object | None],
    key_multiple: int = 1,
    native: bool = False,
    upload: Upload | None = None,
) -> tuple[list[int], torch.Tensor, LaneAttention]:
    """(order, positions [B], attention) for a decode step (one new position per sequence)
    through `lanes`. The step runs its rows in `order` (order[i]: the step in lane i), so its
    inputs and outputs are in that order; `owners` as in `KVLanes.seat`; `native`: attend
    through lane_ops' operators (loaded, lanes in float32 on the CPU only); `upload` as in
    `plan_step`."""
    assert all(s.num_new == 1 for s in steps)
    device = lanes.pool.keys.device
    to_device = upload or _to(device)
    longest = -(-max(len(s.slots) for s in steps) // key_multiple) * key_multiple
    order = lanes.seat([to_device(s.slots[:-1]) for s in steps], owners, longest)
    steps = [steps[i] for i in order]
    lengths = torch.tensor([len(s.slots) for s in steps])
    positions = lengths - 1
    visible = torch.arange(longest)[None, :] < lengths[:, None]
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    device_positions = to_device(positions)
    attention = LaneAttention(
        lanes.pool,
        lanes,
        to_device(torch.cat([s.slots[-1:] for s in steps])),
        torch.arange(len(steps), device=device),
        device_positions,
        longest,
        to_device(bias[:, None, None]),
        to_device(lengths),
        native,
    )
    return order, device_positions, attention
