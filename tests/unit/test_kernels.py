"""Kernels per step by kind (framework/analysis/kernels.py), on a made-up program whose
answer is known: a loop of 4 quantizations (an absolute maximum, its scalar all-reduce,
a cast to E4M3) and an FP8 GEMM fusion, then a library attention kernel. The
reducers applied by the reduce and the all-reduce are not kernels."""

from framework.analysis.kernels import KINDS, kernels_per_step

PROGRAM = """HloModule jit_step

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%fused_amax (p0: bf16[64,32]) -> f32[] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %f = f32[64,32]{1,0} convert(%p0)
  %abs = f32[64,32]{1,0} abs(%f)
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%abs, %zero), dimensions={0,1}, to_apply=%max
}

%fused_cast (p0: bf16[64,32], p1: f32[]) -> f8e4m3fn[64,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = f32[] parameter(1)
  %s = bf16[64,32]{1,0} broadcast(%p1), dimensions={}
  %d = bf16[64,32]{1,0} divide(%p0, %s)
  ROOT %c = f8e4m3fn[64,32]{1,0} convert(%d)
}

%fused_gemm (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %y = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %p = (s32[], bf16[64,32]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%p), index=1
  %amax = f32[] fusion(%x), kind=kInput, calls=%fused_amax
  %ars = f32[] all-reduce-start(%amax), replica_groups={{0,1}}, to_apply=%max
  %whole = f32[] all-reduce-done(%ars)
  %x8 = f8e4m3fn[64,32]{1,0} fusion(%x, %whole), kind=kLoop, calls=%fused_cast
  %w8 = f8e4m3fn[32,16]{1,0} parameter(1)
  %y = bf16[64,16]{1,0} fusion(%x8, %w8), kind=kCustom, calls=%fused_gemm
  ROOT %t = (s32[], bf16[64,32]) tuple(%i, %x)
}

%cond (p: (s32[], bf16[64,32])) -> pred[] {
  %p = (s32[], bf16[64,32]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: bf16[64,32]) -> bf16[64,32] {
  %a = bf16[64,32]{1,0} parameter(0)
  %t0 = (s32[], bf16[64,32]) tuple(%a, %a)
  %w = (s32[], bf16[64,32]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %o = (bf16[2,64,32]{2,1,0}, u8[0]{0}) custom-call(%a, %a, %a), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %r = bf16[64,32]{1,0} get-tuple-element(%w), index=1
}
"""


def test_kernels_per_step_by_kind():
    got = kernels_per_step(PROGRAM)
    assert set(got) == set(KINDS)
    assert got == {"gemm": 4, "attention": 1, "collective": 4, "scalar_all_reduce": 4,
                   "fp8_cast": 4, "amax": 4, "fusion": 0, "other": 0}


def test_a_cast_to_bfloat16_is_no_fp8_cast_and_a_vector_all_reduce_no_scalar_one():
    plain = PROGRAM.replace("ROOT %c = f8e4m3fn[64,32]{1,0} convert(%d)",
                            "ROOT %c = bf16[64,32]{1,0} convert(%d)")
    plain = plain.replace("%ars = f32[] all-reduce-start", "%ars = f32[8] all-reduce-start")
    got = kernels_per_step(plain)
    assert got["fp8_cast"] == 0 and got["fusion"] == 4
    assert got["scalar_all_reduce"] == 0 and got["collective"] == 4


def test_fp8_values_only_moved_are_no_cast():
    """A collective matmul's ring writes its FP8 blocks into place: FP8 in, FP8 out."""
    moved = PROGRAM.replace("%fused_cast (p0: bf16[64,32], p1: f32[])",
                            "%fused_cast (p0: f8e4m3fn[64,32], p1: f32[])")
    moved = moved.replace("  %p0 = bf16[64,32]{1,0} parameter(0)\n  %p1 = f32[] parameter(1)\n"
                          "  %s = bf16[64,32]{1,0} broadcast(%p1), dimensions={}\n"
                          "  %d = bf16[64,32]{1,0} divide(%p0, %s)\n"
                          "  ROOT %c = f8e4m3fn[64,32]{1,0} convert(%d)",
                          "  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)\n  %p1 = f32[] parameter(1)\n"
                          "  ROOT %c = f8e4m3fn[64,32]{1,0} copy(%p0)")
    assert "copy(%p0)" in moved
    got = kernels_per_step(moved)
    assert got["fp8_cast"] == 0 and got["fusion"] == 4
