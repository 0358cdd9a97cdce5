"""The aarch64 NEON forms of the int4 formats' kernels (csrc/vec16.h's NEON branch, qgemm_core.h's NEON blocks,
decode_attention_f32.h over vec16), which no extension builds here (there is no aarch64 libtorch): the standalone
driver csrc/aarch64_check.cpp, cross-compiled with Debian's aarch64-linux-gnu-g++ for armv8.2-a+dotprod (``sdot``)
and for plain armv8-a (``smull`` + ``saddlp``), run under qemu-aarch64, gives bit for bit what this machine's x86
extension gives: int4_mm / int8_mm and their plain-loop references on odd shapes, bfloat16 and float32 activations
and outputs, the levels' and activations' extremes, subnormal and huge activation groups and a NaN row; and
paged_decode_attention_float32 over 1 to 2,100 keys (several 1,024-key segments, partial and odd-sized pool
blocks), the fast-path and general head shapes, peaked scores (the exp clamp) and a NaN key. Skipped, naming what
is missing, where the cross compiler or qemu-aarch64 isn't installed (scripts/setup.sh installs them when run as
root). What this doesn't show: speed, or that an aarch64 torch extension builds."""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from prefixcache.kernels.build import extension_name
from prefixcache.layers.quant import quantize_weight_group_int8, quantize_weight_int4
from tests.kernels.paged_inputs import random_paged_decode_inputs

CXX, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
DRIVER = Path(__file__).parents[2] / "prefixcache" / "kernels" / "csrc" / "aarch64_check.cpp"
MARCHES = {"armv8.2-a+dotprod": "neon+dotprod", "armv8-a": "neon"}  # -march -> the form it compiles (--form)
SHAPES = [(1, 16, 32), (3, 48, 96), (5, 80, 160), (7, 16, 288), (4, 144, 64), (9, 32, 576)]  # rows, out, in

pytestmark = [
    pytest.mark.requires_isa("avx2"),  # the x86 results come from the int4 kernels' extension
    pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} not installed (apt-get install g++-aarch64-linux-gnu)"),
    pytest.mark.skipif(shutil.which(QEMU) is None or not Path(SYSROOT).is_dir(),
                       reason=f"{QEMU} or the aarch64 libraries ({SYSROOT}) not installed"),
]


def _compiler_version() -> str:
    return subprocess.run([CXX, "-dumpfullversion"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def drivers() -> dict[str, Path]:
    """-march -> the driver built for it, cached under the temp dir by a digest of the sources and headers it
    compiles (build.extension_name), the march and the compiler's version: compiled once, about 3 s each."""
    cache = Path(tempfile.gettempdir()) / "prefixcache_aarch64" / f"{extension_name('aarch64_check', [DRIVER])}_{_compiler_version()}"
    cache.mkdir(parents=True, exist_ok=True)
    built = {}
    for march in MARCHES:
        binary = cache / f"aarch64_check_{march.replace('+', '_')}"
        if not binary.exists():
            partial = binary.with_suffix(".partial")
            subprocess.run([CXX, "-std=c++17", "-O3", "-Wall", "-Werror", f"-march={march}", "-DPREFIXCACHE_NO_TORCH",
                            str(DRIVER), "-o", str(partial)], check=True, capture_output=True)
            partial.replace(binary)
        built[march] = binary
    return built


def _run(binary: Path, stdin: bytes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([QEMU, "-L", SYSROOT, str(binary), *args], input=stdin, capture_output=True, timeout=120)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()


class Case:
    """One call: the driver's stdin for it, and the x86 extension's outputs in the order the driver writes them
    (a product: the kernel's, then the reference's; attention: its output)."""

    def __init__(self, name: str, stdin: bytes, expected: list[torch.Tensor]):
        self.name, self.stdin, self.expected = name, stdin, expected


def _product(op: str, x: torch.Tensor, weight, bias: torch.Tensor | None, out_dtype: torch.dtype, x86) -> Case:
    m, k = x.shape
    n = weight.scale.shape[0] * 16
    header = struct.pack("<7q", 0 if op == "int4" else 1, m, k, n, x.dtype == torch.bfloat16,
                         out_dtype == torch.bfloat16, bias is not None)
    parts = [header, _bits(x), weight.packed.numpy().tobytes(), _bits(weight.scale)]
    if op == "int4":
        parts.append(_bits(weight.min))
        expected = [x86.int4_mm(x, weight.packed, weight.scale, weight.min, bias, out_dtype),
                    x86.int4_mm_reference(x, weight.packed, weight.scale, weight.min, bias, out_dtype)]
    else:
        expected = [x86.int8_mm(x, weight.packed, weight.scale, weight.correction, bias, out_dtype),
                    x86.int8_mm_reference(x, weight.packed, weight.scale, bias, out_dtype)]
    if bias is not None:
        parts.append(bias.numpy().tobytes())
    return Case(f"{op} {m}x{k}->{n} x={x.dtype} out={out_dtype} bias={bias is not None}", b"".join(parts), expected)


def _attention(seed: int, lens: list[int], x86, heads=6, kv_heads=2, head_dim=64, block=16, q_scale=1.0,
               nan_key: bool = False) -> Case:
    """Rows of the given context lengths over a shuffled pool (:func:`random_paged_decode_inputs`)."""
    q, k, v, table, context_lens = random_paged_decode_inputs(seed, lens, heads, kv_heads, head_dim, block, q_scale,
                                                              nan_key)
    slots, width = k.shape[0], table.shape[1]
    scale = head_dim ** -0.5
    header = struct.pack("<8qf", 2, len(lens), heads, kv_heads, head_dim, slots, width, block, scale)
    stdin = b"".join([header, _bits(q), _bits(k), _bits(v), table.numpy().tobytes(), context_lens.numpy().tobytes()])
    expected = x86.paged_decode_attention_float32(q, k, v, table, context_lens, block, scale)
    return Case(f"attention lens={lens} heads={heads}/{kv_heads} head_dim={head_dim} block={block} "
                f"q_scale={q_scale} nan_key={nan_key}", stdin, [expected])


def _cases() -> list[Case]:
    from prefixcache.kernels.cpu_kernels import load_int4_kernels

    x86 = load_int4_kernels()
    cases = []
    for m, n, k in SHAPES:
        g = torch.Generator().manual_seed(31 * m + n + k)
        w = torch.randn(n, k, generator=g) * 0.05
        x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3
        bias = torch.randn(n, generator=g)
        w4, w8 = quantize_weight_int4(w, bias), quantize_weight_group_int8(w)
        for x_dtype, out_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.bfloat16)]:
            xd = x.to(x_dtype)
            cases += [_product("int4", xd, w4, bias, out_dtype, x86), _product("int4", xd, w4, None, out_dtype, x86),
                      _product("int8", xd, w8, None, out_dtype, x86), _product("int8", xd, w8, bias, out_dtype, x86)]
    # the extremes: every level 15 (int4) or +-127 (int8) against activations +-127 (the largest sums a lane
    # sees: 32 * 15 * 127 per int4 group), then rows whose groups quantize with a subnormal d (1e-36), to zero
    # (1e-39: 1 / d overflows), from huge values (1e30) and a NaN row (d = NaN: NaN outputs)
    n, k = 32, 128
    w4_levels = torch.full((n, k), 15.0)
    w4_levels[:, 0::32] = 0.0
    w8_levels = torch.where(torch.arange(k) % 3 == 0, -127.0, 127.0).expand(n, k).clone()
    alternating = torch.where(torch.arange(k) % 2 == 0, 5.0, -5.0)
    x = torch.stack([torch.full((k,), 3.0), torch.full((k,), -3.0), alternating, alternating * 2e-37,
                     alternating * 2e-40, alternating * 1e30, torch.full((k,), float("nan"))])
    w4, w8 = quantize_weight_int4(w4_levels * 0.01), quantize_weight_group_int8(w8_levels * 0.01)
    for out_dtype in (torch.float32, torch.bfloat16):
        cases += [_product("int4", x, w4, None, out_dtype, x86), _product("int8", x, w8, None, out_dtype, x86)]
    # SmolLM2's head shape (head_dim 64, 3 query heads per kv head) and the others of the fast paths, the general
    # path (head_dim 48, 5 per kv head), odd block sizes, scores peaked enough that exp's clamp acts, a NaN key
    cases += [_attention(3, [1, 17, 100, 1025, 2100], x86),
              _attention(4, [40, 3, 1030], x86, heads=9, kv_heads=3, block=7),
              _attention(5, [33, 250], x86, heads=2, kv_heads=1, head_dim=128, block=32),
              _attention(6, [19, 64, 1], x86, heads=10, kv_heads=2, head_dim=48, block=5),
              _attention(7, [300, 45], x86, q_scale=40.0),
              _attention(8, [30, 20], x86, nan_key=True),
              # bf16 outputs hide most one-ulp float32 differences: a changed summation order (hsum16's tree)
              # shows in a few of these 49,152 outputs and in none of the cases above
              _attention(9, [50 + 37 * i for i in range(24)], x86, heads=16, kv_heads=4, head_dim=128)]
    return cases


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return _cases()


def test_each_march_compiles_the_form_it_names(drivers):
    """--form reports the integer form compiled in; the dotprod build's code holds sdot, the armv8-a one none."""
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    for march, form in MARCHES.items():
        run = _run(drivers[march], b"", "--form")
        assert run.returncode == 0 and run.stdout.decode().strip() == form
        if objdump:
            code = subprocess.run([objdump, "-d", str(drivers[march])], capture_output=True, text=True, check=True).stdout
            assert ("\tsdot\t" in code) == (form == "neon+dotprod")


@pytest.mark.parametrize("march", list(MARCHES))
def test_the_neon_forms_give_the_x86_extensions_bits(drivers, cases, march):
    run = _run(drivers[march], b"".join(c.stdin for c in cases))
    assert run.returncode == 0, run.stderr.decode()
    out, pos = run.stdout, 0
    assert len(out) == sum(t.numel() * t.element_size() for c in cases for t in c.expected)
    nans = 0
    for c in cases:
        for what, expected in zip(("kernel", "reference"), c.expected):
            got = out[pos:pos + expected.numel() * expected.element_size()]
            pos += len(got)
            assert got == _bits(expected), f"{march} {what} differs: {c.name}"
        nans += int(torch.isnan(c.expected[0]).sum())
    # the products' NaN row (32 outputs) in the 4 extreme cases and the NaN key's 3 heads x 64: NaN on both
    # machines, the same bits
    assert nans == 4 * 32 + 3 * 64


def test_malformed_input_is_refused_with_a_message(drivers):
    bad = struct.pack("<7q", 0, 1, 40, 16, 0, 0, 0)  # K = 40: not a multiple of 32
    run = _run(drivers["armv8-a"], bad)
    assert run.returncode == 2 and b"K a positive multiple of 32" in run.stderr
    truncated = struct.pack("<7q", 1, 2, 32, 16, 0, 0, 0) + b"\0" * 10  # x needs 2 * 32 floats
    run = _run(drivers["armv8-a"], truncated)
    assert run.returncode == 2 and b"truncated x" in run.stderr
    heads = struct.pack("<8qf", 2, 1, 6, 4, 64, 16, 1, 16, 0.125)  # 6 query heads over 4 kv heads
    run = _run(drivers["armv8-a"], heads)
    assert run.returncode == 2 and b"H a multiple of KVH" in run.stderr
