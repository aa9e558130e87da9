"""Reading GGUF files faster than gguf's reader alone, with its results.

Without torch: the API server loads a GGUF's tokenizer with it, and never imports torch."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import gguf
import numpy as np


class GGUFFileReader(gguf.GGUFReader):
    """gguf's reader, slicing the mapped file as a plain array rather than a numpy.memmap: it
    makes a view per metadata value, and a memmap's views cost several times as much (the
    embedded SmolLM2 GGUF, whose tokenizer holds about 150,000 values, took 2.4 s to parse
    instead of 0.7 s, on every first start). The same fields and tensors; tensor data stay
    views of the mapping."""

    def _get(self, offset: int, dtype: np.typing.DTypeLike, count: int = 1,
             override_order: str | None = None) -> np.ndarray:
        mapped = self.__dict__.get("_mapped")
        if mapped is None:
            mapped = self._mapped = self.data.view(np.ndarray)
        count = int(count)
        values = mapped[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))


class GGUFModelReader(GGUFFileReader):
    """The engine's reader: a model's tensors and hyperparameters. Metadata arrays of more
    than SKIPPED_ARRAY_LENGTH values (a tokenizer's vocabulary, merges, scores and token
    types: about 150,000 values in SmolLM2's file, half a second of a first start's critical
    path to parse, which the engine never reads) are skipped: their fields keep their types
    and no values (`contents()` is empty). The tokenizer is read from the file through
    transformers, with a reader of its own (gguf_reads_by_file_reader)."""

    SKIPPED_ARRAY_LENGTH = 1024

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if int(length[0]) <= self.SKIPPED_ARRAY_LENGTH:
            return super()._get_field_parts(orig_offs, raw_type)
        item = gguf.GGUFValueType(int(item_type[0]))
        size = 12 + self._array_bytes(orig_offs + 12, item, int(length[0]))
        return size, [item_type, length], [], [gguf.GGUFValueType.ARRAY, item]

    def _array_bytes(self, offset: int, item: gguf.GGUFValueType, length: int) -> int:
        """The bytes of `length` values of type `item` from `offset`: strings are walked by
        their length prefixes alone."""
        scalar = self.gguf_scalar_to_np.get(item)
        if scalar is not None:
            return length * np.dtype(scalar).itemsize
        if item != gguf.GGUFValueType.STRING:
            raise ValueError(f"Unsupported GGUF array of {item.name}")
        mapped = self.data.view(np.ndarray)
        prefix = struct.Struct("<Q" if self.endianess == gguf.GGUFEndian.LITTLE else ">Q")
        end = offset
        for _ in range(length):
            end += prefix.size + prefix.unpack_from(mapped, end)[0]
        return end - offset


@contextlib.contextmanager
def gguf_reads_by_file_reader() -> Iterator[None]:
    """Within it, `gguf.GGUFReader` is GGUFFileReader: transformers imports that name each
    time it reads a GGUF (its tokenizer from the metadata, 5 s for SmolLM2's, half of it the
    parse). Nothing else changes: the two read the same values."""
    original = gguf.GGUFReader
    gguf.GGUFReader = GGUFFileReader
    try:
        yield
    finally:
        gguf.GGUFReader = original
