"""First-use capture: graphs captured when calls first need them, per call structure, as
`jax.jit` compiles (`first_use`), with the structures, the kinds of calls, room for more and
what a failed capture does."""
