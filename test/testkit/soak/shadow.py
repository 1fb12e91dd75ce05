"""The shadow: the bytes every token's KV must hold, and the check of what
the cache serves against them.

A token's KV bytes (payload and scales, K and V, every layer) are a function
of its whole prefix, row ``h`` of a table where ``h`` is the prefix's rolling
hash, as a model's KV is a function of its prefix; and of the model's KV
head: each head's columns come from a seed of its own, so a rank holds the
bytes of its heads whatever the TP size (``page_head`` pages restored across
TP sizes must match). A mismatch is counted, not raised, so a run reports
them all."""

from __future__ import annotations

import torch

from testkit.soak.stacks import PAGE, SLIDING_WINDOW, SoakLayer

TABLE_ROWS = 4093
"""Rows of the shadow table: a token's row is its prefix's hash modulo this."""


class TokenBytes:
    """One per-layer buffer seen as a token's bytes: a row of the payload or
    of per-token scales, or, for MXFP8, the token's scales in the
    FA4-interleaved ``(pages, H, 32, P/32, D/32)`` layout."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.raw = buffer.view(torch.uint8)
        self.interleaved = buffer.dim() == 5
        self.width = self.raw[0].numel() // (PAGE if self.interleaved else 1)

    def _index(self, slots: torch.Tensor):
        if not self.interleaved:
            return (slots,)
        offset = slots % PAGE
        return slots // PAGE, slice(None), offset % 32, offset // 32, slice(None)

    def get(self, slots: torch.Tensor) -> torch.Tensor:
        return self.raw[self._index(slots)].reshape(len(slots), self.width)

    def set(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        target = self._index(slots)
        self.raw[target] = rows.view(self.raw[target].shape)


class Shadow:
    """The bytes every token's KV must hold: for each buffer of each layer
    (K and V, payload and scales), a table of ``TABLE_ROWS`` rows. On the CPU
    the rows are random bytes written straight into the pool; with
    ``quantize`` (a GPU) they are what SGLang's own ``set_kv_buffer`` makes of
    random bf16 K and V rows, and the soak writes its KV through it."""

    def __init__(
        self,
        seed: int,
        layers: list[SoakLayer],
        allocator,
        quantize: bool,
        first_head: int = 0,
    ) -> None:
        """``first_head``: the model's KV head this rank's first head is."""
        self.layers, self.allocator = layers, allocator
        self.buffers = [
            [
                TokenBytes(buffers[d.layer])
                for buffers in (
                    d.pool.k_buffer,
                    d.pool.v_buffer,
                    d.pool.k_scale_buffer,
                    d.pool.v_scale_buffer,
                )
            ]
            for d in layers
        ]
        device = layers[0].pool.device
        heads = layers[0].pool.head_num
        gens = [
            torch.Generator().manual_seed(seed * 1_000_003 + first_head + h)
            for h in range(heads)
        ]

        def by_head(draw) -> torch.Tensor:
            """Each head's columns drawn from its own generator, side by side
            (a token's row of every buffer is head-major)."""
            return torch.cat([draw(gen) for gen in gens], dim=1).to(device)

        if not quantize:
            self.bf16 = None
            self.tables = [
                [
                    by_head(
                        lambda gen, width=b.width // heads: torch.randint(
                            0,
                            256,
                            (TABLE_ROWS, width),
                            dtype=torch.uint8,
                            generator=gen,
                        )
                    )
                    for b in buffers
                ]
                for buffers in self.buffers
            ]
            return
        self.bf16 = [
            tuple(
                by_head(
                    lambda gen, dim=d.pool.head_dim: torch.randn(
                        TABLE_ROWS, 1, dim, generator=gen
                    )
                )
                .mul_(3.0)
                .to(torch.bfloat16)
                for _ in "kv"
            )
            for d in layers
        ]
        self.tables = [
            [
                torch.empty(TABLE_ROWS, b.width, dtype=torch.uint8, device=device)
                for b in buffers
            ]
            for buffers in self.buffers
        ]
        chunk = PAGE * (layers[0].pool.size // PAGE - 1)
        for first in range(0, TABLE_ROWS, chunk):
            rows = torch.arange(first, min(first + chunk, TABLE_ROWS), device=device)
            slots = rows - first + PAGE  # the pool's own slots, past page 0
            for n, d in enumerate(layers):
                self._set_kv_buffer(n, d, slots, rows)
                for table, b in zip(self.tables[n], self.buffers[n], strict=True):
                    table[rows] = b.get(slots)

    def _set_kv_buffer(self, n: int, d: SoakLayer, slots, rows) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        pool = d.pool
        layer = RadixAttention(
            pool.head_num,
            pool.head_dim,
            pool.head_dim**-0.5,
            pool.head_num,
            layer_id=d.layer,
        )
        k, v = self.bf16[n]
        pool.set_kv_buffer(layer, slots, k[rows], v[rows])

    def snapshot(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Every buffer's bytes at full-attention ``slots``."""
        return [
            b.get(slots).clone()
            for d, buffers in zip(self.layers, self.buffers, strict=True)
            for b in buffers
            if not d.swa
        ]

    @staticmethod
    def rows(token_ids: list[int]) -> list[int]:
        """Each token's table row: the rolling hash of the prefix ending there."""
        h, out = 0, []
        for token in token_ids:
            h = (h * 1000003 + token + 1) % TABLE_ROWS
            out.append(h)
        return out

    def _slots(self, d: SoakLayer, slots: torch.Tensor) -> torch.Tensor:
        if not d.swa:
            return slots
        return self.allocator.translate_loc_from_full_to_swa(slots).long()

    def write(self, slots: torch.Tensor, rows: list[int]) -> None:
        rows_t = torch.tensor(rows, dtype=torch.long, device=slots.device)
        for n, d in enumerate(self.layers):
            space = self._slots(d, slots)
            if self.bf16 is not None:
                self._set_kv_buffer(n, d, space, rows_t)
                continue
            for table, b in zip(self.tables[n], self.buffers[n], strict=True):
                b.set(space, table[rows_t])

    def mismatched(
        self, slots: torch.Tensor, rows: list[int], window_from: int
    ) -> list[int]:
        """The positions in ``slots`` whose bytes differ from the shadow;
        sliding-window layers from position ``window_from`` on."""
        rows_t = torch.tensor(rows, dtype=torch.long, device=slots.device)
        bad = torch.zeros(len(rows), dtype=torch.bool, device=slots.device)
        for n, d in enumerate(self.layers):
            start = window_from if d.swa else 0
            space = self._slots(d, slots[start:])
            for table, b in zip(self.tables[n], self.buffers[n], strict=True):
                bad[start:] |= (b.get(space) != table[rows_t[start:]]).any(dim=1)
        return bad.nonzero().flatten().tolist()

    def check(self, figures, slots: torch.Tensor, token_ids: list[int], label: str):
        """``slots``, a request's row from its first token, against the rows of
        ``token_ids``; sliding-window layers in the window before its end only
        (SGLang frees a request's sliding-window slots behind it as it goes).
        Checked tokens and mismatches counted in ``figures`` (SoakFigures)."""
        length = len(slots)
        if length == 0:
            return
        window_from = max(0, length - SLIDING_WINDOW)
        bad = self.mismatched(slots, self.rows(token_ids[:length]), window_from)
        figures.tokens_checked += length
        if bad:
            figures.mismatches += len(bad)
            if len(figures.first_mismatches) < 10:
                figures.first_mismatches.append(
                    f"{label}: {len(bad)} of {length} tokens, first at "
                    f"position {bad[0]} (slot {int(slots[bad[0]])})"
                )
