"""The Triton cast kernel on which CUDA 13.0.88's ``ptxas`` crashed (SIGSEGV) on an H200, 2026-11-29.

Inductor (torch 2.11, Triton 3.6) wrote it for ``tests/test_cuda.py::test_inductor_checkpointed_blocks_on_the_gpu
[tensorwise]`` (the kernel source and its metadata are copied from a rerun of that test on the H200): one 64 x 64
tensor's amax, nonzero count, scale (float64, ``nextafter``), table record, FP8 cast, and the NaN and zero counts
from the FP8 values read as bytes (``.to(tl.uint8, bitcast=True)``). ``ptxas`` crashed in the one configuration
inductor tried (16 warps, ``R0_BLOCK`` 2048); lightning-fp8 reads the values as float32 since (``--float32-test``
gives that form). Kept to report upstream; not part of the package or the tests.

Reproduce without a GPU (the helpers of ``torch._inductor.runtime.triton_helpers`` it calls are copied below, and
called without the module prefix: a ``@triton.jit`` function reads no non-constexpr global)::

    pip download --no-deps triton==3.6.0 nvidia-cuda-nvcc==13.0.88      # install both into a scratch folder
    TRITON_PTXAS_PATH=<that folder>/nvidia/cu13/bin/ptxas PYTHONPATH=<that folder> \
        python benchmarks/results/ptxas_sigsegv_kernel.py [--float32-test] [--warps N] [--block N]

Seen here: the kernel as written fails (``PTXASError ... error code -11``) with 16 warps and blocks of 2048 and
compiles with (8, 1024), (4, 512), (16, 4096), (32, 2048), (8, 2048), (16, 1024); ``--float32-test`` compiles in all
seven; Triton 3.9 (torch 2.13's) compiles the kernel as written.
"""

import argparse
import os
import tempfile

import triton
import triton.language as tl
from triton.language import math as tl_math
from triton.language.extra import libdevice



# the helpers of torch._inductor.runtime.triton_helpers that the kernel calls
@triton.jit
def maximum(a, b):
    mask = a > b
    if a.dtype.is_floating():
        mask |= a != a
    return tl.where(mask, a, b)

@triton.jit
def minimum(a, b):
    mask = a < b
    if a.dtype.is_floating():
        mask |= a != a
    return tl.where(mask, a, b)

@triton.jit
def _max_combine(a, b):
    return maximum(a, b)

@triton.jit
def max2(a, dim):
    return tl.reduce(a, dim, _max_combine)


@triton.jit
def triton_red_fused__to_copy_abs_amax_as_strided_bitwise_and_clamp_eq_ge_gt_index_put_index_select_lt_maximum_mul_ne_nextafter_reciprocal_sub_sum_view_where_zeros_like_0(in_ptr0, in_ptr1, in_ptr2, out_ptr1, out_ptr2, out_ptr3, out_ptr4, out_ptr5, out_ptr6, out_ptr7, out_ptr8, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    xnumel = 1
    r0_numel = 4096
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = tl.full([XBLOCK], True, tl.int1)[:, None]
    r0_base = tl.arange(0, R0_BLOCK)[None, :]
    rbase = r0_base
    _tmp3 = tl.full([XBLOCK, R0_BLOCK], float("-inf"), tl.float32)
    _tmp9 = tl.full([XBLOCK, R0_BLOCK], 0, tl.int32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_0 = r0_index
        tmp0 = tl.load(in_ptr0 + (r0_0), r0_mask, eviction_policy='evict_last', other=0.0)
        tmp1 = tl_math.abs(tmp0)
        tmp2 = tl.broadcast_to(tmp1, [XBLOCK, R0_BLOCK])
        tmp4 = maximum(_tmp3, tmp2)
        _tmp3 = tl.where(r0_mask, tmp4, _tmp3)
        tmp5 = tl.full([1, 1], 0.0, tl.float32)
        tmp6 = tmp0 != tmp5
        tmp7 = tmp6.to(tl.int32)
        tmp8 = tl.broadcast_to(tmp7, [XBLOCK, R0_BLOCK])
        tmp10 = _tmp9 + tmp8
        _tmp9 = tl.where(r0_mask, tmp10, _tmp9)
    tmp3 = max2(_tmp3, 1)[:, None]
    tmp9 = tl.sum(_tmp9, 1)[:, None]
    tl.store(out_ptr1 + (tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1)), tmp9, None)
    tmp24 = tl.load(in_ptr1 + (0))
    tmp25 = tl.broadcast_to(tmp24, [1, 1])
    tmp11 = tmp3.to(tl.float64)
    tmp12 = tl.full([1, 1], 1e-12, tl.float64)
    tmp13 = maximum(tmp11, tmp12)
    tmp14 = tl.full([1, 1], 1, tl.int32)
    tmp15 = (tmp14 / tmp13)
    tmp16 = tl.full([1, 1], 448.0, tl.float64)
    tmp17 = tmp15 * tmp16
    tmp18 = tmp17.to(tl.float32)
    tmp19 = tmp18.to(tl.float64)
    tmp20 = tmp19 > tmp17
    tmp21 = tl.full([1, 1], 0.0, tl.float32)
    tmp22 = libdevice.nextafter(tmp18, tmp21)
    tmp23 = tl.where(tmp20, tmp22, tmp18)
    tmp26 = tl.full([1, 1], 3, tl.int32)
    tmp27 = tmp25 + tmp26
    tmp28 = tmp25 < 0
    tmp29 = tl.where(tmp28, tmp27, tmp25)
    tl.device_assert((0 <= tmp29) & (tmp29 < 3), "index out of bounds: 0 <= tmp29 < 3")
    tmp31 = (tmp14 / tmp23)
    tmp32 = tl.load(in_ptr2 + (tmp29), None, eviction_policy='evict_last')
    tmp33 = maximum(tmp32, tmp3)
    tl.store(out_ptr2 + (tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1)), tmp23, None)
    tl.store(out_ptr3 + (tl.broadcast_to(tmp29, [XBLOCK, 1])), tmp23, None)
    tl.store(out_ptr4 + (tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1)), tmp31, None)
    tl.store(out_ptr5 + (tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1)), tmp33, None)
    _tmp53 = tl.full([XBLOCK, R0_BLOCK], 0, tl.int32)
    _tmp59 = tl.full([XBLOCK, R0_BLOCK], 0, tl.int32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_0 = r0_index
        tmp34 = tl.load(in_ptr0 + (r0_0), r0_mask, eviction_policy='evict_first', other=0.0)
        tmp35 = tmp34 * tmp23
        tmp36 = tl_math.abs(tmp35)
        tmp37 = tl.full([1, 1], float("inf"), tl.float32)
        tmp38 = tmp36 < tmp37
        tmp39 = tl.full([1, 1], -448.0, tl.float32)
        tmp40 = maximum(tmp35, tmp39)
        tmp41 = tl.full([1, 1], 448.0, tl.float32)
        tmp42 = minimum(tmp40, tmp41)
        tmp43 = tmp35 - tmp35
        tmp44 = tl_math.abs(tmp43)
        tmp45 = tl.where(tmp38, tmp42, tmp44)
        tmp46 = tmp45.to(tl.float8e4nv)
        tmp47 = tmp46.to(tl.uint8, bitcast=True)
        tmp48 = tl.full([1, 1], 127, tl.uint8)
        tmp49 = tmp47 & tmp48
        tmp50 = tmp49 >= tmp48
        tmp51 = tmp50.to(tl.int32)
        tmp52 = tl.broadcast_to(tmp51, [XBLOCK, R0_BLOCK])
        tmp54 = _tmp53 + tmp52
        _tmp53 = tl.where(r0_mask, tmp54, _tmp53)
        tmp55 = tl.full([1, 1], 0, tl.uint8)
        tmp56 = tmp49 == tmp55
        tmp57 = tmp56.to(tl.int32)
        tmp58 = tl.broadcast_to(tmp57, [XBLOCK, R0_BLOCK])
        tmp60 = _tmp59 + tmp58
        _tmp59 = tl.where(r0_mask, tmp60, _tmp59)
        tl.store(out_ptr6 + (tl.broadcast_to(r0_0, [XBLOCK, R0_BLOCK])), tmp46, r0_mask)
    tmp53 = tl.sum(_tmp53, 1)[:, None]
    tmp59 = tl.sum(_tmp59, 1)[:, None]
    tl.store(out_ptr7 + (tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1)), tmp53, None)
    tl.store(out_ptr8 + (tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1)), tmp59, None)


SIGNATURE = {"in_ptr0": "*fp32", "in_ptr1": "*i64", "in_ptr2": "*fp32", "out_ptr1": "*i32", "out_ptr2": "*fp32",
             "out_ptr3": "*fp32", "out_ptr4": "*fp32", "out_ptr5": "*fp32", "out_ptr6": "*fp8e4nv", "out_ptr7": "*i32",
             "out_ptr8": "*i32", "xnumel": "constexpr", "r0_numel": "i32", "XBLOCK": "constexpr", "R0_BLOCK": "constexpr"}
ALIGNED = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12)  # the arguments inductor marked divisible by 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--float32-test", action="store_true", help="count from the values as float32, not bytes")
    parser.add_argument("--warps", type=int, default=16)
    parser.add_argument("--block", type=int, default=2048)
    args = parser.parse_args()
    fn = triton_red_fused__to_copy_abs_amax_as_strided_bitwise_and_clamp_eq_ge_gt_index_put_index_select_lt_maximum_mul_ne_nextafter_reciprocal_sub_sum_view_where_zeros_like_0  # noqa: E501
    if args.float32_test:  # the same kernel with lightning-fp8's current counting form
        src = open(__file__).read()
        src = src.replace("tmp47 = tmp46.to(tl.uint8, bitcast=True)", "tmp47 = (tmp46.to(tl.float32) != 0).to(tl.uint8)")
        path = os.path.join(tempfile.mkdtemp(), "kernel_float32_test.py")
        with open(path, "w") as f:
            f.write(src)
        namespace: dict = {"__name__": "kernel_float32_test", "__file__": path}
        exec(compile(src, path, "exec"), namespace)
        fn = namespace[fn.fn.__name__]
    source = triton.compiler.ASTSource(fn, SIGNATURE, {"xnumel": 1, "XBLOCK": 1, "R0_BLOCK": args.block},
                                       {(i,): [["tt.divisibility", 16]] for i in ALIGNED})
    target = triton.backends.compiler.GPUTarget("cuda", 90, 32)
    try:
        triton.compile(source, target=target, options={"num_warps": args.warps, "num_stages": 1, "debug": True,
                                                       "sanitize_overflow": False})  # as inductor compiles it
    except Exception as err:  # noqa: BLE001 - what ptxas said is the result
        print(f"failed: {type(err).__name__}: {str(err).splitlines()[0]}")
        return 1
    print("compiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
