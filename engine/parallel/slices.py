"""Reading a rank's slices of checkpoint tensors, and the rules that say which slices.

Each rank reads, through safetensors' memory map (`safe_open(...).get_slice`), only the rows,
columns or experts of its share, straight into its own smaller parameters: its host memory
peaks near its share of the weights, never at a whole tensor it holds a part of. The loaders'
header checks (`check_sdar_checkpoint`, DiffusionGemma's `check_checkpoint`) run first and say
which checkpoint tensor fills which parameter of the whole model; `SliceRules` turns each of
those into the reads of one rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import torch

from engine.errors import CheckpointError
from engine.loader import _Header, _Target
from engine.parallel.plan import RankShare, Span

Index = tuple[Any, ...]
_ALL = slice(None)
# Bytes of a checkpoint file mapped and touched before it is reopened (see `_read_file`).
MAPPED_WINDOW = 256 << 20
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


@dataclass(frozen=True)
class SliceRead:
    """Checkpoint tensor NAME's SOURCE slice ((): whole) copied into DEST of parameter PARAM;
    `zero`: DEST is zero-filled, nothing is read (a bias only rank 0 adds)."""

    name: str
    source: Index
    param: str
    dest: Index
    zero: bool = False


@dataclass
class ReadLog:
    """What a rank's load read: bytes the reads returned, and each read's name and shape."""

    bytes_read: int = 0
    bytes_zeroed: int = 0  # parameters filled with zeros instead (biases only rank 0 adds)
    reads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def shapes(self, name: str) -> list[tuple[int, ...]]:
        """The shapes read of checkpoint tensor NAME (one per read)."""
        return [shape for n, shape in self.reads if n == name]


class SliceRules:
    """The reads of one rank for the split kinds both families share; a family module says
    which kind each of its parameters is."""

    def __init__(self, share: RankShare) -> None:
        self.share = share

    def whole(self, name: str, target: _Target) -> list[SliceRead]:
        """Replicated: the whole tensor, where the whole model has it."""
        return [SliceRead(name, (), target.param, target.index)]

    def rows(self, name: str, target: _Target, span: Span, dest: Index = ()) -> list[SliceRead]:
        """Rows SPAN of a matrix (or vector) into DEST (column-parallel weights, biases)."""
        return [SliceRead(name, (slice(span.start, span.stop),), target.param, dest)]

    def columns(self, name: str, target: _Target, span: Span) -> list[SliceRead]:
        """Columns SPAN of a matrix (row-parallel weights: output projections)."""
        return [SliceRead(name, (_ALL, slice(span.start, span.stop)), target.param, ())]

    def vocab(self, name: str, target: _Target, vocab_size: int) -> list[SliceRead]:
        """This rank's vocabulary rows of an embedding or LM head."""
        return self.rows(name, target, self.share.vocab(vocab_size))

    def stacked_gate_up(self, name: str, target: _Target, inter: int) -> list[SliceRead]:
        """Experts stacked (E, 2 * inter, hidden), gate rows then up rows: this rank's experts
        whole (`expert`), or its columns of every expert's gate and up (`tensor`)."""
        experts, cols = self.share.experts(target.shape[0]), self.share.expert_columns(inter)
        if cols.count == inter:
            return [SliceRead(name, (slice(experts.start, experts.stop),), target.param, ())]
        return [
            SliceRead(
                name,
                (_ALL, slice(offset + cols.start, offset + cols.stop)),
                target.param,
                (_ALL, slice(half * cols.count, (half + 1) * cols.count)),
            )
            for half, offset in enumerate((0, inter))
        ]

    def stacked_down(self, name: str, target: _Target, inter: int) -> list[SliceRead]:
        """Experts stacked (E, hidden, inter): this rank's experts, or its columns of each."""
        experts, cols = self.share.experts(target.shape[0]), self.share.expert_columns(inter)
        if cols.count == inter:
            return [SliceRead(name, (slice(experts.start, experts.stop),), target.param, ())]
        return [SliceRead(name, (_ALL, _ALL, slice(cols.start, cols.stop)), target.param, ())]


@dataclass
class LoadedShard:
    """A rank's model, the whole model's config (the rank's is `model.config`) and what the
    load read."""

    model: Any  # Model | DiffusionGemmaModel
    config: Any  # ModelConfig | DiffusionGemmaConfig
    read_log: ReadLog


def read_slices(
    reads: Iterable[SliceRead], headers: dict[str, _Header], params: dict[str, torch.Tensor]
) -> ReadLog:
    """Copies every read into its parameter, file by file, through safetensors' memory map;
    checks first that the reads fill every parameter exactly once."""
    reads = list(reads)
    covered: dict[str, int] = defaultdict(int)
    for read in reads:
        param = params[read.param]
        covered[read.param] += prod((param[read.dest] if read.dest else param).shape)
    unfilled = [n for n, p in params.items() if covered[n] != p.numel()]
    if unfilled:
        # A bug in the slice rules, not in the checkpoint: never serve uninitialised weights.
        raise RuntimeError(f"shard plan leaves parameters unfilled: {unfilled}")
    log = ReadLog()
    by_file: dict[Path, list[SliceRead]] = defaultdict(list)
    with torch.no_grad():
        for read in reads:
            if read.zero:
                dest = params[read.param][read.dest] if read.dest else params[read.param]
                log.bytes_zeroed += dest.numel() * dest.element_size()
                dest.zero_()
            else:
                by_file[headers[read.name].file].append(read)
        for file, file_reads in sorted(by_file.items()):
            try:
                _read_file(file, file_reads, headers, params, log)
            except Exception as exc:
                # safetensors raises its own error types for damaged files; name the file.
                raise CheckpointError(
                    f"{file}: cannot read tensors ({exc}); re-download it"
                ) from exc
    return log


def _read_file(
    file: Path,
    reads: list[SliceRead],
    headers: dict[str, _Header],
    params: dict[str, torch.Tensor],
    log: ReadLog,
) -> None:
    """The reads of one file. Pages of the map a read touches stay in this process's RSS
    while the file is open (a column slice touches every row of its tensor), so the file is
    reopened after every MAPPED_WINDOW bytes touched: RSS stays near the rank's share."""
    from safetensors import safe_open

    for run in _windows(reads, headers):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for read in run:
                view = reader.get_slice(read.name)
                tensor = view[read.source] if read.source else view[:]
                log.bytes_read += tensor.numel() * tensor.element_size()
                log.reads.append((read.name, tuple(tensor.shape)))
                param = params[read.param]
                (param[read.dest] if read.dest else param).copy_(tensor)


def _windows(reads: list[SliceRead], headers: dict[str, _Header]) -> Iterator[list[SliceRead]]:
    """READS in runs that touch at most MAPPED_WINDOW bytes of the file (or one larger read)."""
    run: list[SliceRead] = []
    touched = 0
    for read in reads:
        span = _touched_bytes(headers[read.name], read.source)
        if run and touched + span > MAPPED_WINDOW:
            yield run
            run, touched = [], 0
        run.append(read)
        touched += span
    if run:
        yield run


def _touched_bytes(header: _Header, source: Index) -> int:
    """Bytes of the file a read of SOURCE touches: the whole rows (first dimension) it reads
    from, all of them when it slices a later dimension only."""
    shape = header.shape
    rows = shape[0] if shape else 1
    first = source[0] if source else slice(None)
    if isinstance(first, slice):
        start, stop, _ = first.indices(rows)
        rows = max(0, stop - start)
    return rows * prod(shape[1:]) * _DTYPE_BYTES.get(header.dtype, 4)
