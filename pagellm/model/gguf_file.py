"""Reading GGUF files faster than gguf's reader alone, with its results.

Without torch: the API server loads a GGUF's tokenizer with it, and never imports torch."""

from __future__ import annotations

import contextlib
import struct
import sys
from collections.abc import Iterator

import numpy as np


@contextlib.contextmanager
def _without_mistral_common() -> Iterator[None]:
    """Imports in this block find no mistral_common. gguf's vocab module imports it for its
    own conversion of Mistral vocabularies, which pagellm never calls, and goes on without it:
    `import gguf` takes 0.10 s instead of 0.44 on a 2-core EPYC, in the engine core and in the
    API server of a first start alike (restarts import neither). A None in sys.modules makes
    an import fail; the entry is taken out again at once, so that pagellm's Mistral support
    (pagellm/mistral) imports the package as usual. Where mistral_common is already imported,
    gguf takes it."""
    if "mistral_common" in sys.modules:
        yield
        return
    sys.modules["mistral_common"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("mistral_common", ...) is None:
            del sys.modules["mistral_common"]


with _without_mistral_common():
    import gguf


class GGUFFileReader(gguf.GGUFReader):
    """gguf's reader, slicing the mapped file as a plain array rather than a numpy.memmap: it
    makes a view per metadata value, and a memmap's views cost several times as much (the
    embedded SmolLM2 GGUF, whose tokenizer holds about 150,000 values, took 2.4 s to parse
    instead of 0.7 s, on every first start). Arrays of scalars or strings are read in one
    pass rather than value by value through `_get_field_parts`: 0.14 s instead of 0.85 s for
    that file, CPU a first start's API server spends rebuilding the tokenizer while the
    kernels compile. The same fields, parts and tensors; tensor data stay views of the
    mapping."""

    def _get(self, offset: int, dtype: np.typing.DTypeLike, count: int = 1,
             override_order: str | None = None) -> np.ndarray:
        count = int(count)
        values = self._mapped()[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)
        values = values[:count]
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))

    def _mapped(self) -> np.ndarray:
        mapped = self.__dict__.get("_mapped_bytes")
        if mapped is None:
            mapped = self._mapped_bytes = self.data.view(np.ndarray)
        return mapped

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        """An array's parts as gguf's reader makes them (its type, its length, then each
        value's parts: a string's length and bytes, a scalar alone), in one pass."""
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item, count = gguf.GGUFValueType(int(item_type[0])), int(length[0])
        if item == gguf.GGUFValueType.STRING:  # a length and the bytes, the second the value
            values, end = self._string_parts(orig_offs + 12, count)
            data = list(range(3, 2 + len(values), 2))
        elif item in self.gguf_scalar_to_np:
            array = self._get(orig_offs + 12, self.gguf_scalar_to_np[item], count)
            values, end = [array[i:i + 1] for i in range(count)], orig_offs + 12 + array.nbytes
            data = list(range(2, 2 + count))
        else:  # arrays of arrays: gguf's walk
            return super()._get_field_parts(orig_offs, raw_type)
        types = [gguf.GGUFValueType.ARRAY] + ([item] if count else [])
        return end - orig_offs, [item_type, length, *values], data, types

    def _string_parts(self, offset: int, count: int) -> tuple[list[np.ndarray], int]:
        """Each string's length (uint64) and bytes (uint8) as views of the mapping, and the
        offset past the last."""
        mapped, parts, end = self._mapped(), [], offset
        length_type = np.dtype(np.uint64).newbyteorder(self.byte_order)
        for start, length in self._string_extents(offset, count):
            end = start + 8 + length
            parts.append(mapped[start:start + 8].view(length_type))
            parts.append(mapped[start + 8:end])
        return parts, end

    def _string_extents(self, offset: int, count: int) -> Iterator[tuple[int, int]]:
        """(offset, byte length) of `count` consecutive strings from `offset`, walked by their
        length prefixes."""
        prefix = struct.Struct("<Q" if self.endianess == gguf.GGUFEndian.LITTLE else ">Q")
        mapped = self._mapped()
        for _ in range(count):
            length = prefix.unpack_from(mapped, offset)[0]
            yield offset, length
            offset += 8 + length


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
        end = offset
        for start, string_bytes in self._string_extents(offset, length):
            end = start + 8 + string_bytes
        return end - offset


@contextlib.contextmanager
def gguf_reads_by_file_reader() -> Iterator[None]:
    """Within it, `gguf.GGUFReader` is GGUFFileReader: transformers imports that name each
    time it reads a GGUF (its tokenizer from the metadata: 2.3-2.4 s for SmolLM2's, its
    imports aside, against 3.0-3.6 s with gguf's walk of the arrays). Nothing else changes:
    the two read the same parts."""
    original = gguf.GGUFReader
    gguf.GGUFReader = GGUFFileReader
    try:
        yield
    finally:
        gguf.GGUFReader = original
