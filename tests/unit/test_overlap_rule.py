"""The rule that says which asynchronous collectives overlap computation
(framework/analysis/overlap.py), on a hand-written scheduled GPU program: only a matmul
beside the transfer counts (a dot, a library gemm, or a fusion, loop or branch holding
one); elementwise work alone does not."""

from framework.analysis import hlo, overlap

PROGRAM = """HloModule m

%cast (p: f32[64,64]) -> bf16[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  ROOT %c = bf16[64,64]{1,0} convert(%p)
}

%gemm (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  ROOT %d = bf16[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch_dot (t: (bf16[64,64])) -> bf16[64,64] {
  %t = (bf16[64,64]{1,0}) parameter(0)
  %x = bf16[64,64]{1,0} get-tuple-element(%t), index=0
  ROOT %f = bf16[64,64]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm
}

%branch_id (t: (bf16[64,64])) -> bf16[64,64] {
  %t = (bf16[64,64]{1,0}) parameter(0)
  ROOT %x = bf16[64,64]{1,0} get-tuple-element(%t), index=0
}

ENTRY %main (w: f32[64,64], x: bf16[64,64], i: s32[]) -> bf16[64,64] {
  %w = f32[64,64]{1,0} parameter(0)
  %x = bf16[64,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %ar1 = bf16[64,64]{1,0} all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%gemm
  %cv = bf16[64,64]{1,0} fusion(%w), kind=kLoop, calls=%cast
  %ar1d = bf16[64,64]{1,0} all-reduce-done(%ar1)
  %ar2 = bf16[64,64]{1,0} all-reduce-start(%ar1d), replica_groups={{0,1}}, to_apply=%gemm
  %mm = bf16[64,64]{1,0} fusion(%x, %cv), kind=kCustom, calls=%gemm
  %ar2d = bf16[64,64]{1,0} all-reduce-done(%ar2)
  %tu = (bf16[64,64]{1,0}) tuple(%mm)
  %cp = bf16[64,64]{1,0} collective-permute-start(%ar2d), source_target_pairs={{0,1}}
  %cond = bf16[64,64]{1,0} conditional(%i, %tu, %tu), branch_computations={%branch_id, %branch_dot}
  %cpd = bf16[64,64]{1,0} collective-permute-done(%cp)
  %lib = bf16[64,64]{1,0} collective-permute-start(%cpd), source_target_pairs={{0,1}}
  %cb = bf16[64,64]{1,0} custom-call(%x, %x), custom_call_target="__cublas$gemm"
  %libd = bf16[64,64]{1,0} collective-permute-done(%lib)
  %sync = bf16[64,64]{1,0} all-reduce-start(%libd), replica_groups={{0,1}}, to_apply=%gemm, backend_config={"collective_backend_config":{"is_sync":true}}
  %mm2 = bf16[64,64]{1,0} fusion(%x, %cv), kind=kCustom, calls=%gemm
  %syncd = bf16[64,64]{1,0} all-reduce-done(%sync)
  ROOT %out = bf16[64,64]{1,0} add(%syncd, %mm2)
}
"""


def test_only_a_matmul_beside_the_transfer_counts():
    found = overlap.overlapped_names(hlo.parse(PROGRAM))
    # ar1: a weight's cast only; ar2: a gemm fusion; cp: a branch that may run a dot;
    # lib: a cuBLAS call; sync: the compiler runs it on the compute stream.
    assert found == {"ar2", "cp", "lib"}
