"""The block formats weights are kept in, as GGUF (llama.cpp) lays them out. No torch here: the cost
model and the simulator size experts with them.

Each row of a matrix [rows, cols] is cols / block blocks of `nbytes` bytes, one after another
(little-endian; d, dmin, m are IEEE halves):

| name | elems | bytes | one block                                           | value             |
|------|-------|-------|-----------------------------------------------------|-------------------|
| q8_0 | 32    | 34    | d; int8 q[32]                                       | d q               |
| q4_0 | 32    | 18    | d; qs[16]: element i low nibble of qs[i], i+16 high | d (q - 8)         |
| q4_1 | 32    | 20    | d, m; qs[16] as q4_0                                | d q + m           |
| q4_k | 256   | 144   | d, dmin; 12 bytes: 6-bit scales, mins of 8 blocks;  | d sc_j q          |
|      |       |       | qs[128]: group g = blocks 2g (low), 2g+1 (high)     | - dmin m_j        |
| q5_k | 256   | 176   | as q4_k, plus qh[32]: bit j of byte i is the fifth  | as q4_k           |
|      |       |       | bit of element i of block j                         |                   |
| q6_k | 256   | 210   | ql[128], qh[64]: low 4 and high 2 bits; int8        | d sc_t (q - 32)   |
|      |       |       | scales[16] (one per 16 values); d                   |                   |

Six layouts are not GGUF's: q4_k_x8, q5_k_x8 and q6_k_x8 hold q4_k, q5_k and q6_k blocks with rows
interleaved eight at a time, q8_0_x16, q4_0_x16 and q4_1_x16 q8_0, q4_0 and q4_1 blocks with rows
interleaved sixteen at a time, the same bytes rearranged for the products of every path of the
CPU kernels (quant/interleave.py; made at load by quant/tensor.py for_kernels, never written to a
file). Their `family` is the GGUF format: their values, their
cost, their bytes on the bus.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    ggml: int  # gguf.GGMLQuantizationType value
    block: int  # elements per block
    nbytes: int  # bytes per block
    family: str = ""  # a layout of another format's blocks: that format (q4_k_x8: q4_k)
    rows: int = 1  # rows a layout interleaves (8 or 16; GGUF's formats: 1)

    @property
    def blocks_of(self) -> str:
        """The GGUF format whose blocks these are: the family, else this format."""
        return self.family or self.name

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.nbytes

    @property
    def bits(self) -> float:
        """Bits per weight, scales included."""
        return 8.0 * self.nbytes / self.block


FORMATS = {
    f.name: f
    for f in (
        Format("q8_0", 8, 32, 34),
        Format("q4_0", 2, 32, 18),
        Format("q4_1", 3, 32, 20),
        Format("q4_k", 12, 256, 144),
        Format("q5_k", 13, 256, 176),
        Format("q6_k", 14, 256, 210),
    )
}
# Layouts of those blocks that only the engine makes (no file holds them); 268, 269, 270, 264, 258
# and 259 are no ggml types but native/quant.c's Q4_K_X8, Q5_K_X8, Q6_K_X8, Q8_0_X16, Q4_0_X16 and
# Q4_1_X16 (256 + the family's).
Q4_K_X8 = Format("q4_k_x8", 268, 256, 144, family="q4_k", rows=8)
Q5_K_X8 = Format("q5_k_x8", 269, 256, 176, family="q5_k", rows=8)
Q6_K_X8 = Format("q6_k_x8", 270, 256, 210, family="q6_k", rows=8)
Q8_0_X16 = Format("q8_0_x16", 264, 32, 34, family="q8_0", rows=16)
Q4_0_X16 = Format("q4_0_x16", 258, 32, 18, family="q4_0", rows=16)
Q4_1_X16 = Format("q4_1_x16", 259, 32, 20, family="q4_1", rows=16)
LAYOUTS = {f.name: f for f in (Q4_K_X8, Q5_K_X8, Q6_K_X8, Q8_0_X16, Q4_0_X16, Q4_1_X16)}
# a GGUF format -> its interleaved layout
INTERLEAVED = {f.family: f for f in LAYOUTS.values()}
BY_GGML = {f.ggml: f for f in FORMATS.values()}
# The formats `--quant` quantises to at load (and GGUF writers write): the others are read only.
QUANTIZE_TO = ("q8_0", "q4_k", "q4_0", "q6_k")


def suits(fmt: Format, cols: int) -> bool:
    """Whether rows of `cols` values split into whole blocks of `fmt`."""
    return cols % fmt.block == 0


def named(name: str) -> Format:
    """The format or layout called `name` (FORMATS, LAYOUTS)."""
    return FORMATS.get(name) or LAYOUTS[name]
