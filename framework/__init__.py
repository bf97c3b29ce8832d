"""A JAX framework for training decoder LLMs on one (pipe, data, context, tensor) device mesh.

Packages, in the order a run uses them (docs/architecture.md has the picture and the
import rules, which tests/unit/test_architecture.py enforces):

    config/     errors.py   the typed settings and every error a user can be shown
    runtime/    devices, processes, signals, the run lock: the machine a run is on
    parallel/   the mesh and the three parallelisms: rules, tensor, data, pipeline/
    model/      the Llama, in logical axes; attention kernels; the naive reference
    engine/     the jitted step on the mesh: train state, step, split backward, optimizer
    analysis/   what a program costs: audit, profile, memory and comm models, planner
    io/         data, tokenizers, checkpoints, Hugging Face weights
    run/        the command line: train, loop, hooks, tracking, sweeps, generation
    compile/    the step compiled for a TPU slice or GPU cluster this machine is not

Every command (framework.run, framework.compile, framework.generate, tools/) imports JAX
first through `framework.runtime.quiet.import_jax`, after its signal handlers: the
start-up lines of JAX's accelerator plugins stay off stderr.
"""
