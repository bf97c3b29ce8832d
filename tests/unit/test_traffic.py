"""What a compiled program moves and multiplies, read from its text: bytes copied,
sliced and updated per step (framework/analysis/traffic.py) and matmul FLOPs by operand
type (framework/analysis/gemms.py), each instruction times how often its computation
runs (a loop body x its trip count), on a made-up program whose answer is known and on
one XLA compiled here."""

import jax
import jax.numpy as jnp
from framework.analysis import gemms, traffic

PROGRAM = """HloModule jit_step

%body (p: (s32[], f32[8,64], bf16[4,16])) -> (s32[], f32[8,64], bf16[4,16]) {
  %p = (s32[], f32[8,64], bf16[4,16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %buf = f32[8,64]{1,0} get-tuple-element(%p), index=1
  %row = f32[1,64]{1,0} dynamic-slice(%buf, %i, %i), dynamic_slice_sizes={1,64}
  %new = f32[8,64]{1,0} dynamic-update-slice(%buf, %row, %i, %i)
  %x = bf16[4,16]{1,0} get-tuple-element(%p), index=2
  %x8 = f8e4m3fn[4,16]{1,0} convert(%x)
  %w8 = f8e4m3fn[16,32]{1,0} parameter(1)
  %y = f32[4,32]{1,0} dot(%x8, %w8), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/Block/mlp/dot_general"}
  ROOT %t = (s32[], f32[8,64], bf16[4,16]) tuple(%i, %new, %x)
}

%cond (p: (s32[], f32[8,64], bf16[4,16])) -> pred[] {
  %p = (s32[], f32[8,64], bf16[4,16]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[8,64], b: bf16[4,16]) -> f32[8,64] {
  %a = f32[8,64]{1,0} parameter(0)
  %c = f32[8,64]{1,0} copy(%a)
  %h = bf16[4,16]{1,0} parameter(1)
  %head = f32[4,4]{1,0} dot(%h, %h), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/Head/dot_general"}
  %w = (s32[], f32[8,64], bf16[4,16]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[8,64]{1,0} get-tuple-element(%w), index=1
}
"""


def test_bytes_moved_per_step_by_kind():
    moved = traffic.moved_bytes(PROGRAM)
    assert moved == {"copied": 8 * 64 * 4, "sliced": 5 * 64 * 4, "updated": 5 * 64 * 4}


def test_matmul_flops_by_operand_type_and_the_layers_fp8_share():
    flops = gemms.matmul_flops(PROGRAM)
    assert flops == {("f8e4m3fn", True): 5 * 2 * 4 * 32 * 16, ("bf16", False): 2 * 4 * 4 * 16}
    assert gemms.fp8_share(PROGRAM) == 1.0
    assert gemms.fp8_share(PROGRAM.replace("f8e4m3fn[4,16]{1,0} convert",
                                           "bf16[4,16]{1,0} convert")) == 0.0


def test_a_compiled_scan_updates_each_row_once_per_iteration():
    def fill(buf, x):
        def body(c, i):
            return jax.lax.dynamic_update_slice(c, x[None] * i, (i, 0)), None
        return jax.lax.scan(body, buf, jnp.arange(8, dtype=jnp.int32))[0]

    text = jax.jit(fill).lower(jnp.zeros((8, 256)), jnp.ones(256)).compile().as_text()
    assert traffic.moved_bytes(text)["updated"] >= 8 * 256 * 4
    assert traffic.type_bytes("(f32[2,3]{1,0}, bf16[4])") == 2 * 3 * 4 + 4 * 2


FUSED = """HloModule jit_step

%fused_slice (p0: f32[8,64], p1: s32[]) -> f32[1,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %s = f32[1,64]{1,0} dynamic-slice(%p0, %p1, %p1), dynamic_slice_sizes={1,64}
  ROOT %c = f32[1,64]{1,0} copy(%s)
}

%fused_transpose (p0: f32[8,64]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  ROOT %c2 = f32[8,64]{0,1} copy(%p0)
}

ENTRY %main (a: f32[8,64], i: s32[]) -> (f32[1,64], f32[8,64]) {
  %a = f32[8,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %f = f32[1,64]{1,0} fusion(%a, %i), kind=kCustom, calls=%fused_slice
  %g = f32[8,64]{0,1} fusion(%a), kind=kLoop, calls=%fused_transpose
  ROOT %r = (f32[1,64], f32[8,64]) tuple(%f, %g)
}
"""


def test_a_copy_fused_with_its_slice_is_counted_once_as_the_slice():
    """The GPU compiler's dynamic_slice_fusion materializes the slice with a copy in the
    same kernel: its bytes are sliced, not also copied; a copy fusion of its own (a
    relayout) is copied."""
    assert traffic.moved_bytes(FUSED) == {"copied": 8 * 64 * 4, "sliced": 64 * 4,
                                          "updated": 0.0}


def test_a_slice_fused_into_the_kernel_that_reads_it_writes_nothing():
    """A residual's slice fused into the elementwise work on it is read where it lies."""
    read = FUSED.replace("ROOT %c = f32[1,64]{1,0} copy(%s)",
                         "ROOT %e = f32[1,64]{1,0} exponential(%s)")
    assert traffic.moved_bytes(read) == {"copied": 8 * 64 * 4, "sliced": 0.0, "updated": 0.0}


KERNELS = """HloModule jit_step

%fused_slice (p0: f32[8,64], p1: s32[]) -> f32[1,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %s = f32[1,64]{1,0} dynamic-slice(%p0, %p1, %p1), dynamic_slice_sizes={1,64}
  ROOT %e = f32[1,64]{1,0} exponential(%s)
}

%fused_update (p0: f32[8,64], p1: f32[1,64], p2: s32[]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = f32[1,64]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  ROOT %u = f32[8,64]{1,0} dynamic-update-slice(%p0, %p1, %p2, %p2)
}

ENTRY %main (a: f32[8,64], i: s32[]) -> f32[8,64] {
  %a = f32[8,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %row = f32[1,64]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_slice
  %g = (f32[1,64]{1,0}, s8[4194304]{0}) custom-call(%row, %row), custom_call_target="__cublas$gemm"
  %y = f32[1,64]{1,0} get-tuple-element(%g), index=0
  ROOT %new = f32[8,64]{1,0} fusion(%a, %y, %i), kind=kLoop, calls=%fused_update
}
"""


def test_what_every_kernel_reads_and_writes():
    """A fused slice reads its slice (and its index), not the buffer; a library call
    its operands and its output, not its workspace; an update in place reads and
    writes the update, not the buffer."""
    row = 64 * 4
    slice_kernel = (row + 4) + row
    library = 2 * row + row
    update_kernel = (row + 4) + row
    assert traffic.accessed_bytes(KERNELS) == slice_kernel + library + update_kernel


def test_an_elementwise_kernel_compiled_here_reads_and_writes_its_arrays_once():
    text = jax.jit(lambda x: jnp.exp(x) * 2).lower(jnp.ones(1024)).compile().as_text()
    assert traffic.accessed_bytes(text) == 2 * 1024 * 4


def test_a_slice_of_a_bitcast_stack_reads_only_the_slice():
    viewed = KERNELS.replace(
        "  %s = f32[1,64]{1,0} dynamic-slice(%p0, %p1, %p1), dynamic_slice_sizes={1,64}",
        "  %v = f32[8,64]{1,0} bitcast(%p0)\n"
        "  %s = f32[1,64]{1,0} dynamic-slice(%v, %p1, %p1), dynamic_slice_sizes={1,64}")
    assert "bitcast(%p0)" in viewed
    assert traffic.accessed_bytes(viewed) == traffic.accessed_bytes(KERNELS)


def test_a_pipeline_conditional_counts_each_branch_as_often_as_its_table_runs_it():
    """The tick executor's cells are two-way conditionals inside their kind's named
    scope (framework/parallel/pipeline/lowering.py); given the share of ticks the table
    runs a kind's work in (`Program.scope_weights`), its branch (lax.cond's true one:
    `branch_computations`' second) counts that share of the loop's runs and the idle
    ranks' pass-through the rest (`hlo.Program.runs`); a scope named again inside its
    branch is not weighed twice. A plain conditional further inside a weighted scope
    (a padded layer's skip) is not the table's: both its branches count as their scope
    says. Without weights every branch counts every time."""
    from framework.analysis import hlo

    def step(x):
        def tick(i, x):
            with jax.named_scope("cell_forward"):
                x = jax.lax.cond(i % 10 < 3, lambda x: jnp.sin(x) * 3.0,
                                 lambda x: jnp.cos(x) + 1.0, x)
            with jax.named_scope("stage_work"), jax.named_scope("layer"):
                return jax.lax.cond(i % 2 == 0, lambda x: jnp.exp(x) * 2.0,
                                    lambda x: jnp.log(x) + 2.0, x)
        return jax.lax.fori_loop(0, 10, tick, x)

    program = hlo.parse(jax.jit(step).lower(jnp.ones(64)).compile().as_text())
    conds = [i for instrs in program.computations.values() for i in instrs
             if i.opcode == "conditional"]
    assert len(conds) == 2
    ops = lambda comps: {i.opcode for c in comps for i in program.computations[c]}
    branches = {op: program.reachable([b]) for cond in conds for b in cond.branches
                for op in ops(program.reachable([b])) & {"sine", "cosine", "exponential", "log"}}
    weights = {"cell_forward": 0.3, "stage_work": 0.4}
    runs = {}
    for factor, _, instr in hlo.kernels(program, weights):
        comp = next(c for c, instrs in program.computations.items() if instr in instrs)
        for op, comps in branches.items():
            if comp in comps:
                runs.setdefault(op, set()).add(round(factor, 6))
    # lax.cond's branches are (false, true): the work 3 of 10 ticks, the idle branch 7
    assert runs == {"sine": {3.0}, "cosine": {7.0}, "exponential": {4.0}, "log": {4.0}}
    unweighted = {round(f, 6) for f, _, i in hlo.kernels(program)
                  if any(i in program.computations[c] for cs in branches.values() for c in cs)}
    assert unweighted == {10}


def test_a_send_switch_counts_each_pattern_as_often_as_its_table_sends_it():
    """A channel's sends are a switch over its patterns inside the channel's scope P
    (framework/parallel/pipeline/comm.py); the weights name pattern k `P_k` (the share
    of ticks that send it, `Program.scope_weights`): branch k counts that share of the
    loop's runs, branch 0 (nobody sends) the rest, whatever op_names the branches
    carry (the compiler keeps identical branches of two switches once)."""
    from framework.analysis import hlo

    def step(x):
        def tick(i, x):
            with jax.named_scope("send_act1"):
                return jax.lax.switch(i % 3, [lambda x: x * 0.0, lambda x: jnp.sin(x) * 2.0,
                                              lambda x: jnp.exp(x) + 1.0], x)
        return jax.lax.fori_loop(0, 10, tick, x)

    program = hlo.parse(jax.jit(step).lower(jnp.ones(64)).compile().as_text())
    (cond,) = [i for instrs in program.computations.values() for i in instrs
               if i.opcode == "conditional"]
    weights = {"send_act1_1": 0.2, "send_act1_2": 0.3}
    runs = {}
    for k, branch in enumerate(cond.branches):
        inside = program.reachable([branch])
        runs[k] = {round(f, 6) for f, _, i in hlo.kernels(program, weights)
                   if any(i in program.computations[c] for c in inside)}
    assert runs[1] == {2.0} and runs[2] == {3.0} and runs[0] <= {5.0}


def test_a_pipeline_conditional_under_autodiff_is_weighed_as_its_scope():
    """Autodiff wraps the scopes it passes through (`jvp(cell_forward)/cond`,
    `transpose(jvp(cell_forward))/cond`): a two-way conditional directly inside such a
    wrapped weighted scope is still the table's, in the forward and in its transpose."""
    from framework.analysis import hlo

    def cell(x, i):
        with jax.named_scope("cell_forward"):
            return jax.lax.cond(i % 10 < 3, lambda x: jnp.sin(x) * 3.0,
                                lambda x: jnp.cos(x) + 1.0, x).sum()

    step = lambda x: jax.lax.fori_loop(0, 10, lambda i, x: jax.grad(cell)(x, i), x)
    program = hlo.parse(jax.jit(step).lower(jnp.ones(64)).compile().as_text())
    conds = [i for instrs in program.computations.values() for i in instrs
             if i.opcode == "conditional"]
    assert len(conds) == 2  # the forward's and its transpose's
    runs = lambda branch: {round(f, 6) for f, _, i in hlo.kernels(program, {"cell_forward": 0.3})
                           if any(i in program.computations[c]
                                  for c in program.reachable([branch]))}
    # lax.cond's branches are (false, true): the work 3 of 10 ticks, the idle branch 7
    assert [[runs(b) for b in cond.branches] for cond in conds] == [[{7.0}, {3.0}]] * 2


ACCUMULATE = """HloModule jit_step

%fused_accumulate (p0: f32[8,64], p1: f32[1,64], p2: s32[]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = f32[1,64]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %s = f32[1,64]{1,0} dynamic-slice(%p0, %p2, %p2), dynamic_slice_sizes={1,64}
  %a = f32[1,64]{1,0} add(%s, %p1)
  ROOT %u = f32[8,64]{1,0} dynamic-update-slice(%p0, %a, %p2, %p2)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}

%fused_scatter (q0: f32[8,64], q1: s32[2,1], q2: f32[2,64]) -> f32[8,64] {
  %q0 = f32[8,64]{1,0} parameter(0)
  %q1 = s32[2,1]{1,0} parameter(1)
  %q2 = f32[2,64]{1,0} parameter(2)
  ROOT %r = f32[8,64]{1,0} scatter(%q0, %q1, %q2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (a: f32[8,64], u: f32[1,64], i: s32[], j: s32[2,1], r: f32[2,64]) -> f32[8,64] {
  %a = f32[8,64]{1,0} parameter(0)
  %u = f32[1,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %j = s32[2,1]{1,0} parameter(3)
  %r = f32[2,64]{1,0} parameter(4)
  %acc = f32[8,64]{1,0} fusion(%a, %u, %i), kind=kLoop, calls=%fused_accumulate
  ROOT %emb = f32[8,64]{1,0} fusion(%acc, %j, %r), kind=kInput, calls=%fused_scatter
}
"""


def test_an_accumulation_in_place_reads_and_writes_its_rows_not_the_buffer():
    """`a.at[chunk].add(u)` in one kernel (the buffer sliced, added to and updated in
    place: a gradient accumulator's chunk, interleaved 1F1B's [v, Lc, ...] stacks) reads
    the slice and the addend and writes the slice; a scatter-add in place (the
    embedding's gradient) reads its indices and updates, and reads and writes the rows
    they touch. Until 2026-12-03 both counted the whole buffer read and written:
    llama3_8b at pp2-dp2-tp2 interleaved over 8 chunks, 1,402 of its 4,156 GiB a step."""
    row = 64 * 4
    accumulate = row + row + 4 + row  # slice read, addend read, index, update written
    scatter = 2 * 4 + 2 * row + 2 * row + 2 * row  # indices, updates, rows read, written
    assert traffic.accessed_bytes(ACCUMULATE) == accumulate + scatter
    whole = ACCUMULATE.replace("ROOT %u = f32[8,64]{1,0} dynamic-update-slice(%p0, %a, %p2, %p2)",
                               "ROOT %u = f32[8,64]{1,0} add(%p0, %p0)")
    assert traffic.accessed_bytes(whole) == (8 * row + row + 4 + 8 * row) + scatter
