"""The GEMM probe's defaults, in one place for the API (numerics.gemm, numerics.gemm_model),
the CLI (commands.gemm, which reads them before torch is imported) and docs/gemm.md."""

# sampled output elements per GEMM (the whole GEMM when it has no more outputs): the CI's
# width falls as 1 / sqrt(samples), and the time of the emulation grows with it
DEFAULT_SAMPLES = 2048
# the interleaved groups the samples are split into (the t-test's trials)
DEFAULT_TRIALS = 32
# The smallest |relative bias| a GEMM verdict calls biased, unless the user states one: every
# output (and so every weight update through wgrad) off by 0.01%, a learning rate off by a
# factor 1.0001. It sits below bf16's own rounding floor (u/16 = 2.4e-4, numerics.bias) on
# purpose: one rounding of a result is a one-off, while an accumulator's bias grows with K
# (about linearly) and has the same sign at every step.
DEFAULT_TOLERANCE = 1e-4
