"""Packed rows: several documents in one row of a batch, and the ways trainers tell a model
where one document ends.

`Packing` holds the document lengths of every row and derives each convention from them,
so a target receives the one it understands:
  position_ids  [B, L] restarting at 0 in each document (DataCollatorWithFlattening,
                transformers PR #31629; flash-attn varlen reads the boundaries from them)
  doc_ids       [B, L] document index within the row (seq_idx, torchtune's document ids)
  cu_seqlens    [n_docs + 1] int32 offsets over the flattened batch (flash_attn_varlen_func,
                transformers' cu_seq_lens_q/k), with max_seqlen
  block_mask    [B, 1, L, L] block-diagonal causal mask, boolean (True = may attend) or
                additive (0 / finfo.min), as transformers takes a prepared 4-D mask
A row's lengths must sum to its length L; every row has the same L (padding is a document).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument

__all__ = ["Packing", "Document"]


@dataclass(frozen=True)
class Document:
    """One document: its row, its first position and its length (global index = order in
    `Packing.documents`, row-major)."""
    row: int
    start: int
    length: int


@dataclass(frozen=True)
class Packing:
    """Document lengths per row: lengths[b] = (n_0, n_1, ...) summing to the row length."""
    lengths: tuple

    def __post_init__(self):
        rows = tuple(tuple(int(n) for n in row) for row in self.lengths)
        if not rows or any(not row for row in rows):
            raise InvalidArgument(f"lengths={self.lengths!r} must hold one non-empty list of "
                                  f"document lengths per row, e.g. [[5, 7, 4]]")
        bad = [n for row in rows for n in row if n < 1]
        if bad:
            raise InvalidArgument(f"lengths={self.lengths!r}: document lengths must be >= 1, "
                                  f"got {bad[0]!r}")
        totals = {sum(row) for row in rows}
        if len(totals) != 1:
            raise InvalidArgument(f"lengths={self.lengths!r}: every row must sum to the same "
                                  f"length L, got sums {sorted(totals)!r} (pad with a document)")
        object.__setattr__(self, "lengths", rows)

    @classmethod
    def of(cls, lengths) -> "Packing":
        """From [n_0, n_1, ...] (one row) or [[...], [...]] (one list per row), or a Packing."""
        if isinstance(lengths, Packing):
            return lengths
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        if not isinstance(lengths, (list, tuple)) or not lengths:
            raise InvalidArgument(f"lengths={lengths!r} must be document lengths, e.g. [5, 7, 4] "
                                  f"for one row or [[5, 7], [8, 4]] for two")
        if all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
            return cls((tuple(lengths),))
        return cls(tuple(tuple(row) for row in lengths))

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor) -> "Packing":
        """From a [B, L] (or [L]) tensor of document ids, constant within a document: a new
        document starts wherever the id changes."""
        ids = torch.as_tensor(doc_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        if ids.dim() != 2 or ids.shape[1] < 1:
            raise InvalidArgument(f"doc_ids has shape {tuple(ids.shape)!r}, expected [B, L]")
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        return cls._from_starts(starts)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "Packing":
        """From [B, L] position ids: a document starts wherever the position does not grow
        by one (transformers' find_packed_sequence_indices reads them the same way)."""
        pos = torch.as_tensor(position_ids)
        pos = pos[None] if pos.dim() == 1 else pos
        if pos.dim() != 2:
            raise InvalidArgument(f"position_ids has shape {tuple(pos.shape)!r}, expected [B, L]")
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        return cls._from_starts(starts)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, rows: int = 1) -> "Packing":
        """From flash-attn varlen offsets over the flattened batch [0, n_0, n_0+n_1, ...],
        split into `rows` rows of equal length."""
        cu = [int(v) for v in torch.as_tensor(cu_seqlens).tolist()]
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise InvalidArgument(f"cu_seqlens={cu!r} must start at 0 and increase strictly")
        total = cu[-1]
        if total % rows:
            raise InvalidArgument(f"cu_seqlens ends at {total}, not a multiple of rows={rows}")
        L = total // rows
        missing = sorted({L * r for r in range(rows + 1)} - set(cu))
        if missing:
            raise InvalidArgument(f"cu_seqlens={cu!r}: a document crosses the row boundary at "
                                  f"{missing[0]} (rows={rows} of length {L})")
        out = [[] for _ in range(rows)]
        for a, b in zip(cu, cu[1:]):  # a loop over documents
            out[a // L].append(b - a)
        return cls(tuple(tuple(r) for r in out))

    @classmethod
    def _from_starts(cls, starts: torch.Tensor) -> "Packing":
        L = starts.shape[1]
        rows = []
        for row in starts:  # a loop over rows
            s = row.nonzero().flatten()
            rows.append(tuple(torch.diff(s, append=torch.tensor([L])).tolist()))
        return cls(tuple(rows))

    # -- shape ---------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        return sum(self.lengths[0])

    @property
    def documents(self) -> list[Document]:
        docs = []
        for b, row in enumerate(self.lengths):
            start = 0
            for n in row:
                docs.append(Document(b, start, n))
                start += n
        return docs

    def tile(self, n: int) -> "Packing":
        """The packing of n copies of the batch stacked along the batch axis."""
        return Packing(self.lengths * n)

    # -- conventions -----------------------------------------------------------------------
    def doc_ids(self, device=None) -> torch.Tensor:
        """[B, L] int64: document index within its row."""
        return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                            for row in self.lengths]).to(device)

    def global_doc_ids(self, device=None) -> torch.Tensor:
        """[B, L] int64: document index in `documents` order (row-major)."""
        offsets = torch.tensor([0] + [len(r) for r in self.lengths[:-1]]).cumsum(0)
        return (self.doc_ids() + offsets[:, None]).to(device)

    def position_ids(self, device=None, start: int = 0) -> torch.Tensor:
        """[B, L] int64: position within the document, from `start`."""
        ids = self.doc_ids()
        L = ids.shape[1]
        first = torch.ones_like(ids, dtype=torch.bool)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        idx = torch.arange(L).expand_as(ids)
        begin = torch.where(first, idx, torch.zeros_like(idx)).cummax(1).values
        return (idx - begin + start).to(device)

    def cu_seqlens(self, device=None) -> torch.Tensor:
        """[n_docs + 1] int32 offsets over the flattened batch (flash_attn_varlen_func)."""
        flat = torch.tensor([n for row in self.lengths for n in row])
        return torch.cat([torch.zeros(1, dtype=torch.long), flat.cumsum(0)]).to(torch.int32).to(device)

    @property
    def max_seqlen(self) -> int:
        return max(n for row in self.lengths for n in row)

    def block_mask(self, dtype: torch.dtype = torch.bool, device=None, causal: bool = True,
                   window: int | None = None) -> torch.Tensor:
        """[B, 1, L, L]: query i may attend key j iff both lie in one document (and j <= i
        when causal, and i - j < window for a sliding window). Boolean (True = attend) for
        dtype=torch.bool, else additive: 0 where allowed and finfo(dtype).min where not, as
        eager attention adds it to the scores."""
        ids = self.doc_ids(device)
        L = ids.shape[1]
        allowed = ids[:, :, None] == ids[:, None, :]
        i = torch.arange(L, device=ids.device)
        if causal:
            allowed &= i[None, :, None] >= i[None, None, :]
        if window is not None:
            allowed &= (i[None, :, None] - i[None, None, :]) < window
        allowed = allowed[:, None]
        if dtype == torch.bool:
            return allowed
        zero = torch.zeros((), dtype=dtype, device=ids.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
