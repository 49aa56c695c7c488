#!/usr/bin/env python3
"""Write tests/fixtures/quant/blocks.safetensors: ggml block-quantized rows and their values.

For each ggml type in TYPES (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K), ROWS rows of COLS elements (COLS / block size blocks a row):

* `{TYPE}.blocks` (uint8, (ROWS, row bytes)) and `{TYPE}.values` (float32,
  (ROWS, COLS)): every byte uniformly random (every bit pattern of the
  quants, sub-block scales and high-bit masks, including the ones no
  quantizer writes, such as Q8_0's -128), except each f16 super-block scale
  or min (HALF_FIELDS), a random finite f16 of magnitude in [1e-3, 1]
  (log-uniform) with a random sign, so that every value is finite and of a
  size a float32 sum keeps exact enough.
* `{TYPE}.real_blocks` / `{TYPE}.real_values`: blocks as quantizers write
  them. Q4_0 to Q8_0: gguf-py's `quantize` of N(0, 0.05) data. The
  k-quants: llama.cpp's `llama-quantize` output, the first 2 * ROWS rows of
  `blk.0.ffn_up.weight` (256 wide: one block a row) of
  tests/fixtures/gguf/llama256-{q2_k,q3_k_m,q4_k_m,q5_k_m,q6_k}.gguf (written
  by scripts/make_gguf_fixtures.py), two matrix rows to a fixture row.

Values are gguf-py's own `gguf.quants.dequantize(blocks, type)`: the layouts
are ggml's (`ggml/src/ggml-common.h`), which gguf-py's `quants.py` follows.
Before writing, the script checks HALF_FIELDS against that: with every f16
field zeroed, every block must dequantize to zeros. --ggml-lib
(libggml-base.so, through `ggml_get_type_traits`) checks every value
against ggml's own C `to_float`, allowing one float32 rounding where
ggml's build may fuse `d * q - m` into one FMA, and quantizes
`quantize.Q4_K.source` with ggml's reference quantizer (gguf-py has none
for Q4_K); `quantize.{Q4_0,Q5_0}.blocks` are gguf-py's `quantize`.

The "case" metadata (JSON) has the types' layouts (block size, bytes, f16
field offsets), the seed, the sources of the real blocks and the versions
(the same on every run).
Deterministic (a fixed seed, numpy's PCG64); offline, a second:

    .venv-ref/bin/python scripts/make_quant_fixtures.py --llama-cpp PATH/TO/llama.cpp \\
        --ggml-lib PATH/TO/llama.cpp/build/bin/libggml-base.so
"""

import argparse
import ctypes
import json
import os
import re
import sys

import numpy as np
from safetensors.numpy import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "quant")
GGUF_FIXTURES = os.path.join(ROOT, "tests", "fixtures", "gguf")

SEED = 20261206
ROWS, COLS = 4, 512
REAL_STD = 0.05

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of each block's f16 scale (d) and min (m, dmin) fields, from
# ggml-common.h's block structs.
HALF_FIELDS = {
    "Q4_0": {"d": 0},
    "Q4_1": {"d": 0, "m": 2},
    "Q5_0": {"d": 0},
    "Q5_1": {"d": 0, "m": 2},
    "Q8_0": {"d": 0},
    "Q2_K": {"d": 80, "dmin": 82},  # scales[16], qs[64], d, dmin
    "Q3_K": {"d": 108},  # hmask[32], qs[64], scales[12], d
    "Q4_K": {"d": 0, "dmin": 2},  # d, dmin, scales[12], qs[128]
    "Q5_K": {"d": 0, "dmin": 2},  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": {"d": 208},  # ql[128], qh[64], scales[16] (int8), d
}
# The k-quants' real blocks: the llama256 file whose mix stores
# blk.0.ffn_up.weight in that type.
REAL_FILES = {"Q2_K": "q2_k", "Q3_K": "q3_k_m", "Q4_K": "q4_k_m", "Q5_K": "q5_k_m", "Q6_K": "q6_k"}
REAL_TENSOR = "blk.0.ffn_up.weight"


def random_halves(rng, n):
    """n random finite f16 of magnitude in [1e-3, 1] (log-uniform) and random sign, as bytes (n, 2)."""
    magnitude = 10.0 ** rng.uniform(-3.0, 0.0, n)
    sign = np.where(rng.integers(0, 2, n) == 1, -1.0, 1.0)
    h = (sign * magnitude).astype(np.float16)
    assert np.all(np.isfinite(h)) and np.all(np.abs(h) >= np.float16(1e-3)) and np.all(np.abs(h) <= 1)
    return h.view(np.uint8).reshape(n, 2)


def random_blocks(rng, gguf, name):
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    n = ROWS * (COLS // block_size)
    blocks = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    for offset in HALF_FIELDS[name].values():
        blocks[:, offset:offset + 2] = random_halves(rng, n)
    return blocks.reshape(ROWS, -1)


def check_half_fields(gguf, name, blocks):
    """Zeroing the f16 fields zeroes every value: HALF_FIELDS names all the scales gguf-py reads."""
    qtype = gguf.GGMLQuantizationType[name]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    zeroed = blocks.reshape(-1, type_size).copy()
    for offset in HALF_FIELDS[name].values():
        zeroed[:, offset:offset + 2] = 0
    back = gguf.quants.dequantize(zeroed.reshape(blocks.shape), qtype)
    assert not np.any(back), f"{name}: values left with every f16 field zeroed: the offsets are wrong"
    # And each field matters on its own.
    for field, offset in HALF_FIELDS[name].items():
        one = blocks.reshape(-1, type_size).copy()
        one[:, offset:offset + 2] = 0
        assert not np.array_equal(gguf.quants.dequantize(one.reshape(blocks.shape), qtype),
                                  gguf.quants.dequantize(blocks, qtype)), f"{name}: {field} at {offset} unused"


# The formats a float folder can be quantized to at load, whose quantizers
# are checked against gguf-py's.
QUANTIZED = ["Q4_0", "Q5_0"]


def real_blocks(rng, gguf, name):
    """(blocks, description) of ROWS rows as a quantizer writes them."""
    qtype = gguf.GGMLQuantizationType[name]
    if name in REAL_FILES:
        path = os.path.join(GGUF_FIXTURES, f"llama256-{REAL_FILES[name]}.gguf")
        reader = gguf.GGUFReader(path)
        (t,) = [t for t in reader.tensors if t.name == REAL_TENSOR]
        assert t.tensor_type == qtype, (path, REAL_TENSOR, t.tensor_type.name)
        data = np.array(t.data, dtype=np.uint8)
        per_row = COLS // int(t.shape[0])  # t.shape is ggml's (ne0 = row length, ne1)
        assert data.shape[0] >= ROWS * per_row, data.shape
        blocks = data[:ROWS * per_row].reshape(ROWS, -1)
        return blocks, (f"llama-quantize: tests/fixtures/gguf/{os.path.basename(path)} {REAL_TENSOR} rows "
                        f"0..{ROWS * per_row - 1} ({int(t.shape[0])} wide), {per_row} to a row")
    x = (REAL_STD * rng.standard_normal((ROWS, COLS))).astype(np.float32)
    return np.asarray(gguf.quants.quantize(x, qtype)), f"gguf-py quantize of N(0, {REAL_STD}) float32"


class GgmlTypeTraits(ctypes.Structure):
    """ggml.h's `struct ggml_type_traits`."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


def ggml_to_float(lib, gguf, name, blocks):
    """ggml's C dequantization (its type traits' to_float) of `blocks`."""
    lib.ggml_get_type_traits.restype = ctypes.POINTER(GgmlTypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    qtype = gguf.GGMLQuantizationType[name]
    traits = lib.ggml_get_type_traits(int(qtype)).contents
    assert traits.type_name.decode().upper() == name, traits.type_name
    assert (traits.blck_size, traits.type_size) == gguf.GGML_QUANT_SIZES[qtype]
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)(
        traits.to_float)
    src = np.ascontiguousarray(blocks)
    out = np.zeros((blocks.shape[0], COLS), dtype=np.float32)
    to_float(src.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return out


def ggml_from_float_ref(lib, gguf, name, x):
    """ggml's C reference quantizer (its type traits' from_float_ref,
    `quantize_row_{type}_ref`) of the float32 rows `x`."""
    lib.ggml_get_type_traits.restype = ctypes.POINTER(GgmlTypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    qtype = gguf.GGMLQuantizationType[name]
    traits = lib.ggml_get_type_traits(int(qtype)).contents
    assert traits.type_name.decode().upper() == name, traits.type_name
    from_float = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int64)(
        traits.from_float_ref)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    src = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // block_size * type_size), dtype=np.uint8)
    from_float(src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data, src.size)
    return out


def check_against_ggml(lib, gguf, name, blocks, values):
    ours = ggml_to_float(lib, gguf, name, blocks)
    if np.array_equal(ours, values):
        return "bit-exact"
    # One rounding apart at most: an FMA in ggml's build against numpy's multiply then add.
    ulp = np.spacing(np.maximum(np.abs(ours), np.abs(values)))
    diff = np.abs(ours - values)
    assert np.all(diff <= ulp), f"{name}: ggml's to_float differs by {np.max(diff / ulp)} ulp"
    return f"within 1 ulp ({int(np.count_nonzero(diff))} of {values.size} differ)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                        help="llama.cpp's source tree (its gguf-py/)")
    parser.add_argument("--ggml-lib", required=True,
                        help="llama.cpp's libggml-base.so: ggml's own C dequantize checks every value, "
                             "and its reference quantizer writes quantize.Q4_K")
    args = parser.parse_args()
    if not args.llama_cpp or not os.path.isdir(os.path.join(args.llama_cpp, "gguf-py", "gguf")):
        sys.exit("--llama-cpp (or LLAMA_CPP_DIR) must name llama.cpp's source tree")
    llama_cpp = os.path.abspath(args.llama_cpp)
    sys.path.insert(0, os.path.join(llama_cpp, "gguf-py"))
    import gguf

    with open(os.path.join(llama_cpp, "gguf-py", "pyproject.toml"), encoding="utf-8") as f:
        gguf_version = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    lib = ctypes.CDLL(os.path.abspath(args.ggml_lib))

    rng = np.random.default_rng(SEED)
    tensors, layouts, real_sources, ggml_check = {}, {}, {}, {}
    for name in TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        assert COLS % block_size == 0, name
        layouts[name] = {"block_size": block_size, "type_size": type_size,
                         "blocks_per_row": COLS // block_size, "row_bytes": COLS // block_size * type_size,
                         "f16_fields": HALF_FIELDS[name]}

        blocks = random_blocks(rng, gguf, name)
        check_half_fields(gguf, name, blocks)
        values = np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32)
        assert values.shape == (ROWS, COLS) and np.all(np.isfinite(values)), name
        tensors[f"{name}.blocks"] = blocks
        tensors[f"{name}.values"] = values

        real, source = real_blocks(rng, gguf, name)
        real_values = np.asarray(gguf.quants.dequantize(real, qtype), dtype=np.float32)
        assert real.shape == blocks.shape and real_values.shape == (ROWS, COLS), (name, real.shape)
        tensors[f"{name}.real_blocks"] = np.ascontiguousarray(real, dtype=np.uint8)
        tensors[f"{name}.real_values"] = real_values
        real_sources[name] = source

        if lib is not None:
            ggml_check[name] = {"blocks": check_against_ggml(lib, gguf, name, blocks, values),
                                "real_blocks": check_against_ggml(lib, gguf, name, real, real_values)}

    # Floats and gguf-py's quantization of them, for the quantizers a
    # float folder is kept in at load (`--dtype q4_0`): a stream of its own,
    # so the tensors above stay as they were. Each row's blocks: N(0, 1)
    # scaled from 1e-3 to 1e3; row 0's first block all zeros, its second
    # a tie of magnitudes at opposite signs (the first wins), its third a
    # value of 8.5 steps (the rounding's edge).
    qrng = np.random.default_rng(SEED + 1)
    quantized = {}
    for name in QUANTIZED:
        qtype = gguf.GGMLQuantizationType[name]
        scale = 10.0 ** qrng.uniform(-3, 3, size=(ROWS, COLS // 32, 1))
        x = (qrng.standard_normal((ROWS, COLS // 32, 32)) * scale).astype(np.float32).reshape(ROWS, COLS)
        x[0, :32] = 0
        x[0, 32:64] = np.linspace(-1, 1, 32, dtype=np.float32)
        x[0, 63], x[0, 40] = np.float32(2), np.float32(-2)
        x[0, 64:96] = np.float32(0.25)
        x[0, 64] = np.float32(-1)
        tensors[f"quantize.{name}.source"] = x
        tensors[f"quantize.{name}.blocks"] = np.asarray(gguf.quants.quantize(x, qtype), dtype=np.uint8)
        quantized[name] = f"gguf-py quants.quantize of quantize.{name}.source (float32)"

    # Q4_K (`--dtype q4_k`): gguf-py has no quantizer for it, so the
    # oracle is ggml's own C reference (`quantize_row_q4_K_ref`, what
    # llama-quantize writes without an importance matrix), through
    # --ggml-lib. Each row two super-blocks of N(0, 1) scaled per
    # sub-block from 1e-3 to 1e3; row 0's sub-blocks: all zeros, all
    # positive (the min clipped to 0), constant, and one outlier.
    krng = np.random.default_rng(SEED + 2)
    scale = 10.0 ** krng.uniform(-3, 3, size=(ROWS, COLS // 32, 1))
    x = (krng.standard_normal((ROWS, COLS // 32, 32)) * scale).astype(np.float32).reshape(ROWS, COLS)
    x[0, :32] = 0
    x[0, 32:64] = np.abs(x[0, 32:64]) + np.float32(0.5)
    x[0, 64:96] = np.float32(0.75)
    x[0, 100] = np.float32(40) * np.max(np.abs(x[0, 96:128]))
    tensors["quantize.Q4_K.source"] = x
    tensors["quantize.Q4_K.blocks"] = ggml_from_float_ref(lib, gguf, "Q4_K", x)
    quantized["Q4_K"] = "ggml's from_float_ref (quantize_row_q4_K_ref, --ggml-lib) of quantize.Q4_K.source (float32)"

    case = {
        "quantize": quantized,
        "types": TYPES,
        "rows": ROWS,
        "cols": COLS,
        "layouts": layouts,
        "seed": SEED,
        "rng": "numpy.random.default_rng(seed) (PCG64), drawn type by type in the order of types",
        "blocks": "{TYPE}.blocks: uniformly random bytes, each f16 field of layouts[TYPE].f16_fields a random "
                  "finite f16 of magnitude in [1e-3, 1] (log-uniform) and random sign; "
                  "row r is blocks_per_row consecutive blocks",
        "values": "{TYPE}.values / {TYPE}.real_values: gguf-py's gguf.quants.dequantize of the blocks, float32",
        "real_blocks": real_sources,
        "numpy": np.__version__,
        "gguf_py": gguf_version,
    }
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "blocks.safetensors")
    save_file(tensors, path, metadata={"case": json.dumps(case, ensure_ascii=False)})
    for name in TYPES:
        line = f"{name}: blocks {tensors[name + '.blocks'].shape}, values {tensors[name + '.values'].shape}"
        if name in ggml_check:
            line += f", ggml to_float: {ggml_check[name]}"
        print(line)
    print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
